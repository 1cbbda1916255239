"""`jobgen status` of a run whose segment was killed before the script could record its end.

Torque's qrerun (SIGKILL within 1 ms), a SIGKILL on Slurm or a lost node leave a start line with no
end; the same job id then starts again. That first segment has ended, whatever the scheduler:
status says it was killed, with its steps as far as the trainer's records show. The run directory
here is written line by line as the batch script and the trainer write it (the real Torque rerun
is in tests/test_pbs_servers.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import jobgen


def write_jsonl(path: Path, entries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def start(job_id: str, restart: int, at: str) -> dict:
    return {"event": "start", "job_id": job_id, "restart": restart, "started_at": at, "at": at,
            "first_step": None, "last_step": None, "outcome": "", "train_seconds": None}


def end(job_id: str, restart: int, started: str, at: str, first: int, last: int, outcome: str) -> dict:
    return {"event": "end", "job_id": job_id, "restart": restart, "started_at": started, "at": at,
            "first_step": first, "last_step": last, "outcome": outcome, "train_seconds": 30.0}


@pytest.mark.parametrize("job_id", ["23.tqserver", "4711", "7.pbsserver"])  # Torque, Slurm, PBS Pro
def test_a_segment_killed_without_an_end_record_is_shown_as_ended(tmp_path: Path, job_id: str) -> None:
    run = tmp_path / "run"
    write_jsonl(run / "segments.jsonl", [
        start(job_id, 0, "2026-11-24T10:00:00Z"),
        start(job_id, 1, "2026-11-24T10:01:00Z"),
        end(job_id, 1, "2026-11-24T10:01:00Z", "2026-11-24T10:02:00Z", 4, 12, "completed"),
    ])
    base = 1795514400  # 2026-11-24T10:00:00Z
    write_jsonl(run / "output" / "metrics.jsonl",
                [{"step": step, "time": base + 20 + 4 * step, "loss": 1.0} for step in range(1, 7)]
                + [{"step": step, "time": base + 80 + 3 * step, "loss": 1.0} for step in range(5, 13)])
    write_jsonl(run / "output" / "startup.jsonl", [
        {"job_id": job_id, "restart": 0, "first_step": 0, "started": base + 2, "total": 20, "seconds": {}},
        {"job_id": job_id, "restart": 1, "first_step": 4, "started": base + 62, "total": 18, "seconds": {}},
    ])
    report = jobgen("status", str(run), "--json")
    assert report.returncode == 0, report.stderr
    first, second = json.loads(report.stdout)["segments"]
    assert (first["outcome"], first["first_step"], first["last_step"]) == ("killed by the scheduler", 0, 6)
    assert first["ended_at"] == "2026-11-24T10:00:44Z"  # its last metrics line
    assert (second["outcome"], second["first_step"], second["last_step"]) == ("completed", 4, 12)
    table = jobgen("status", str(run)).stdout
    first_row = table.splitlines()[3].split()
    assert first_row[:2] == [job_id, "0"] and first_row[4:8] == ["0->6", "killed", "by", "the"], table
    assert "running or lost" not in table


def test_the_last_segment_without_an_end_is_still_running_or_lost(tmp_path: Path) -> None:
    # No later start of the same job: nothing says it has ended (it may be running now). A start
    # of another job id (a second submission) does not end it either.
    run = tmp_path / "run"
    write_jsonl(run / "segments.jsonl", [start("7", 0, "2026-11-24T10:00:00Z"), start("8", 0, "2026-11-24T10:00:05Z")])
    segments = json.loads(jobgen("status", str(run), "--json").stdout)["segments"]
    assert [s["outcome"] for s in segments] == ["running or lost", "running or lost"]


def test_a_segment_killed_while_it_stopped_ended_by_that_stop(tmp_path: Path) -> None:
    # OpenPBS preempts: SIGTERM, then SIGKILL after the queue's kill_delay. On a loaded node the
    # ranks were still saving when the script was killed; it had recorded why it was stopping.
    run = tmp_path / "run"
    stopping = {**start("7.pbsserver", 0, "2026-11-24T10:00:00Z"), "event": "stopping", "at": "2026-11-24T10:00:40Z",
                "outcome": "preempted"}
    write_jsonl(run / "segments.jsonl", [
        start("7.pbsserver", 0, "2026-11-24T10:00:00Z"), stopping,
        start("7.pbsserver", 1, "2026-11-24T10:01:00Z"),
        {**stopping, "restart": 1, "at": "2026-11-24T10:01:30Z", "outcome": "time_limit"},
        end("7.pbsserver", 1, "2026-11-24T10:01:00Z", "2026-11-24T10:02:00Z", 4, 12, "completed"),
    ])
    write_jsonl(run / "output" / "metrics.jsonl", [{"step": step, "time": 1795514400 + 5 * step, "loss": 1.0} for step in range(1, 5)])
    first, second = json.loads(jobgen("status", str(run), "--json").stdout)["segments"]
    assert (first["outcome"], first["last_step"], first["ended_at"]) == ("preempted", 4, "2026-11-24T10:00:20Z")
    # A segment whose end line came says how it ended, whatever it was stopping for.
    assert second["outcome"] == "completed" and "stopping" not in second


def test_a_killed_segment_of_the_jobs_own_program_ends_at_the_checkpoint_the_next_resumed_from(tmp_path: Path) -> None:
    # An own program writes no trainer records: the next segment's start says where it resumed.
    run = tmp_path / "run"
    write_jsonl(run / "segments.jsonl", [
        start("7.pbsserver", 0, "2026-11-24T10:00:00Z"),
        {**start("7.pbsserver", 0, "2026-11-24T10:00:00Z"), "event": "stopping", "outcome": "preempted"},
        start("7.pbsserver", 1, "2026-11-24T10:01:00Z"),
        end("7.pbsserver", 1, "2026-11-24T10:01:00Z", "2026-11-24T10:02:00Z", 3, 12, "completed"),
    ])
    first, _ = json.loads(jobgen("status", str(run), "--json").stdout)["segments"]
    assert (first["outcome"], first["last_step"]) == ("preempted", 3)
