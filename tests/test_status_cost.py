"""`jobgen status`: what each interruption of a run cost, in steps trained again and seconds from
the last step logged before it to the first new step and to the first step past where it was.
The run directory is written as the batch script and the trainer write it; the figures of real
interruptions are asserted where they happen (tests/test_slurm_separate_hosts.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import jobgen
from tests.test_status_killed import end, start, write_jsonl

BASE = 1795514400  # 2026-11-24T10:00:00Z


def steps(job_id: str, restart: int, first: int, last: int, at: float, every: float) -> list[dict]:
    return [{"step": step, "time": at + every * (step - first), "loss": 1.0, "job_id": job_id, "restart": restart}
            for step in range(first, last + 1)]


def test_a_node_failure_and_a_preemption_each_say_what_they_cost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_jsonl(run / "segments.jsonl", [
        start("4711", 0, "2026-11-24T10:00:00Z"),
        {**end("4711", 0, "2026-11-24T10:00:00Z", "2026-11-24T10:00:40Z", 0, 8, "node_failed"), "nodes": "cn002"},
        start("4711", 1, "2026-11-24T10:00:45Z"),
        end("4711", 1, "2026-11-24T10:00:45Z", "2026-11-24T10:02:00Z", 4, 10, "preempted"),
        start("4711", 2, "2026-11-24T10:03:00Z"),
        end("4711", 2, "2026-11-24T10:03:00Z", "2026-11-24T10:04:00Z", 10, 12, "completed"),
    ])
    # Segment 0 logs steps 1-8 (the last at +30 s) and ends at +40 s; segment 1 starts at +45 s,
    # resumes from step 4's checkpoint (its trainer 12 s from its start to that step) and logs step
    # 5 at +58 s, step 9 at +70 s, step 10 at +73 s; segment 2 resumes from step 10 and logs 11 at +200 s.
    write_jsonl(run / "output" / "metrics.jsonl",
                steps("4711", 0, 1, 8, BASE + 16, 2) + steps("4711", 1, 5, 10, BASE + 58, 3) + steps("4711", 2, 11, 12, BASE + 200, 2))
    phases = {"imports": 6.0, "process group": 0.5, "model load": 3.0, "checkpoint load": 1.0, "first step": 1.5}
    write_jsonl(run / "output" / "startup.jsonl", [{"job_id": "4711", "restart": 1, "first_step": 4, "total": 12.0,
                                                    "seconds": phases}])
    report = jobgen("status", str(run), "--json")
    assert report.returncode == 0, report.stderr
    failed, preempted = json.loads(report.stdout)["interruptions"]
    assert failed == {"job_id": "4711", "restart": 1, "after": "node_failed", "nodes": ["cn002"], "reached": 8, "resumed_from": 4,
                      "steps_trained_again": 4, "seconds_to_first_new_step": 28.0, "seconds_to_where_it_was": 40.0,
                      "seconds_to_segment_end": 10.0, "seconds_to_next_start": 5.0, "start_up_seconds": 12.0, "start_up": phases}
    assert (preempted["steps_trained_again"], preempted["seconds_to_first_new_step"]) == (0, 127.0)
    table = jobgen("status", str(run)).stdout
    assert ("restart 1 of job 4711, after node_failed (cn002): 4 step(s) trained again (5-8); "
            "first new step after 28 s; past step 8 after 40 s; where: 10 s to the segment's end, 5 s to the next start, "
            "12.0 s start-up (imports 6.0, model load 3.0, first step 1.5, ...)") in table, table
    assert "restart 2 of job 4711, after preempted: no step trained again; first new step after 127 s" in table, table


def test_a_run_of_one_segment_or_without_the_trainers_records_shows_steps_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_jsonl(run / "segments.jsonl", [start("9", 0, "2026-11-24T10:00:00Z"),
                                         end("9", 0, "2026-11-24T10:00:00Z", "2026-11-24T10:01:00Z", 0, 12, "completed")])
    assert json.loads(jobgen("status", str(run), "--json").stdout)["interruptions"] == []
    assert "interruption" not in jobgen("status", str(run)).stdout
    # A job's own program: no metrics.jsonl, the steps from the segments' end lines.
    write_jsonl(run / "segments.jsonl", [start("9", 0, "2026-11-24T10:00:00Z"),
                                         end("9", 0, "2026-11-24T10:00:00Z", "2026-11-24T10:01:00Z", 0, 6, "preempted"),
                                         start("9", 1, "2026-11-24T10:02:00Z"),
                                         end("9", 1, "2026-11-24T10:02:00Z", "2026-11-24T10:03:00Z", 6, 12, "completed")])
    table = jobgen("status", str(run)).stdout
    assert "restart 1 of job 9, after preempted: no step trained again" in table, table
    assert "first new step" not in table
