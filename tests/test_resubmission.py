"""What a run directory rules out is refused at `jobgen submit`, before the queue and the nodes'
start: a completed run submitted again as it was, and a run of another length over a checkpoint
on a decaying schedule. Each one line naming the field and the fix; nothing is written or started.
Before, the first started its nodes for a segment that trained nothing and counted as an
interruption (goodput 61.8% -> 45.3%), the second was refused by the trainer 20 s after the queue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from jobgen import Job
from jobgen.errors import JobgenError
from jobgen.rundir.resubmission import refusal
from jobgen.rundir.run import RunDir


def job_values(tmp_path: Path, **training) -> dict:
    return {"name": "again", "run_dir": str(tmp_path / "runs" / "again"),
            "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"}, "launch": {"procs_per_node": 1},
            "training": {"model": "tiny/model", "data": "tiny/data.json", "method": "lora", "max_steps": 30, **training}}


def earlier_run(tmp_path: Path, *, checkpoints: list[int], ended: str = "", last_step: int = 0, **training) -> Path:
    """A run directory as an earlier `jobgen submit` of the job left it: its job file, its complete
    checkpoints (and one half-written, which never counts) and, with `ended`, a segment that ended so."""
    values = job_values(tmp_path, **training)
    run_dir = Path(values["run_dir"])
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(Job.from_values(values).spec.model_dump(mode="json")))
    for step in checkpoints:
        (run_dir / "output" / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
        (run_dir / "output" / "checkpoints" / f"step-{step:06d}" / "COMPLETE").touch()
    (run_dir / "output" / "checkpoints" / f".tmp-step-{99:06d}").mkdir(parents=True)
    (run_dir / "submissions.jsonl").write_text(json.dumps({"job_id": "local-1", "scheduler": "local",
                                                           "submitted_at": "2026-01-01T00:00:00Z"}) + "\n")
    if ended:
        start = {"job_id": "local-1", "restart": 0, "started_at": "2026-01-01T00:00:00Z"}
        lines = [{"event": "start", **start, "at": start["started_at"]},
                 {"event": "end", **start, "at": "2026-01-01T00:05:00Z", "first_step": 0, "last_step": last_step,
                  "outcome": ended, "train_seconds": 300}]
        (run_dir / "segments.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


def test_a_completed_run_submitted_again_as_it_was_is_refused_before_anything_starts(tmp_path: Path) -> None:
    run_dir = earlier_run(tmp_path, checkpoints=[10, 20, 30], ended="completed", last_step=30)
    with pytest.raises(JobgenError) as refused:
        Job.from_values(job_values(tmp_path)).submit("local", check_files=False)
    assert str(refused.value) == (
        f"{run_dir} completed at step 30: submitted again as it is, it would train nothing; give the job another "
        "name (or run_dir) to train it again, or `jobgen submit --resume-from STEP` to train again from an earlier "
        "checkpoint of it")
    assert len((run_dir / "submissions.jsonl").read_text().splitlines()) == 1  # nothing submitted
    assert not list((run_dir / "logs").iterdir())


def test_another_length_over_a_checkpoint_on_a_decaying_schedule_is_refused_naming_the_length_that_resumes(tmp_path: Path) -> None:
    run_dir = earlier_run(tmp_path, checkpoints=[11], ended="time_limit", last_step=11)
    with pytest.raises(JobgenError) as refused:
        Job.from_values(job_values(tmp_path, max_steps=60)).submit("local", check_files=False)
    assert str(refused.value) == (
        f"training.max_steps: {run_dir} has a checkpoint at step 11 of a run of max_steps 30 on a cosine schedule; this "
        "job has max_steps 60, which would change the learning rate from the resume point on: set max_steps: 30 to "
        "resume it, or give the job another name (or run_dir) to start a run of the new length")
    epochs = refusal(RunDir(run_dir), Job.from_values(job_values(tmp_path, max_steps=None, epochs=2)).spec)
    assert epochs is not None and "this job has epochs 2" in epochs and "set max_steps: 30 to resume it" in epochs


@pytest.mark.parametrize("case", ["constant-schedule", "set-aside-by-resume-from", "no-checkpoint-yet", "own-program",
                                  "stopped-same-length"])
def test_what_the_trainer_would_take_is_not_refused(tmp_path: Path, case: str) -> None:
    if case == "constant-schedule":  # a constant schedule has no total to bend: a longer run continues it
        run_dir = earlier_run(tmp_path, checkpoints=[30], ended="completed", last_step=30, lr_schedule="constant")
        job = Job.from_values(job_values(tmp_path, max_steps=60, lr_schedule="constant")).spec
    elif case == "set-aside-by-resume-from":  # its newest complete checkpoint is older than where it completed
        run_dir = earlier_run(tmp_path, checkpoints=[10], ended="completed", last_step=30)
        job = Job.from_values(job_values(tmp_path)).spec
    elif case == "no-checkpoint-yet":
        run_dir = earlier_run(tmp_path, checkpoints=[], ended="failed", last_step=0)
        job = Job.from_values(job_values(tmp_path, max_steps=60)).spec
    elif case == "own-program":  # it decides its own length
        run_dir = earlier_run(tmp_path, checkpoints=[30], ended="completed", last_step=30)
        job = Job.from_values({**job_values(tmp_path), "training": None,
                               "launch": {"procs_per_node": 1, "command": ["python", "train.py"]}}).spec
    else:
        run_dir = earlier_run(tmp_path, checkpoints=[10, 20], ended="preempted", last_step=20)
        job = Job.from_values(job_values(tmp_path)).spec
    assert refusal(RunDir(run_dir), job) is None
