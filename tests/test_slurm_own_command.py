"""Training scripts of the user's own (launch.command) on the real Slurm test cluster: 2 nodes x 1
rank, preempted mid-run, requeued by Slurm and resumed from the checkpoint saved at the signal, via
launch.resume_argument. Two scripts (tests/own_scripts.py): a Hugging Face Trainer with
JobgenCallback (DDP on gloo, the Trainer's own), and a plain torch.distributed script that handles
SIGTERM itself. Every step is trained once, and the final loss equals an uninterrupted run's
exactly (the Trainer's resume restores its RNG states and skips the batches it trained; the plain
script restores model and optimizer and draws each step's batch from the step: on CPU both are
exact)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, tiny_model
from tests.own_scripts import HELD_IN_EACH_PHASE, PREEMPTED_AT, SCRIPTS, command, lines, logged, write_script
from tests.test_slurm_requeue import (VENV_PATH, preempt_nodes_of, release_when_requeued, segments,
                                      wait_for, wait_until_done)

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def start(folder: Path, script: str, tiny: Path, name: str, step_delay: float, **variables) -> tuple[str, Path]:
    folder.mkdir(parents=True)
    write_script(folder, script)
    job = {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1, "command": command(script, tiny), "checkpoints": "out/checkpoint-*",
                   **SCRIPTS[script][1]},
        # The Trainer's data comes from 2 DataLoader worker processes, which Slurm's preemption
        # signals as it does every process of the job's steps.
        "environment": {"variables": {"STEP_DELAY": step_delay, "EXTRA_ARGS": '{"dataloader_num_workers": 2}', **variables}},
        "requeue": {"max_restarts": 5, "warning_seconds": 30},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", "job.yaml"], cwd=folder,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), folder / "runs" / f"jobgen-test-{name}"


def test_a_preempted_script_of_the_users_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    script = "hf-trainer"
    tiny = tmp_path / "tiny"
    tiny_model(tiny)
    # The uninterrupted run beside the one to preempt, on the partition's two other nodes; the
    # preemption takes only the other job's nodes. (Waiting for the reference to end before
    # preempting every node raced: on a loaded machine the run to preempt reached its step 12 first.)
    reference_id, _ = start(tmp_path / "reference", script, tiny, f"{script}-reference", step_delay=0)
    job_id, run_dir = start(tmp_path / "preempted", script, tiny, f"{script}-preempt", step_delay=2)
    wait_for(lambda: any(entry["step"] >= 3 for entry in logged(tmp_path / "preempted")), "step 3", timeout=240)
    preempt_nodes_of(job_id)
    release_when_requeued(job_id, restarts=1)
    assert wait_until_done(job_id, timeout=300) == "COMPLETED"
    assert wait_until_done(reference_id, timeout=300) == "COMPLETED"

    first, second = segments(run_dir)
    assert first["outcome"] == "preempted" and second["outcome"] == "completed", (first, second)
    # Saved at the signal (checkpoint-N), and the restart resumed from it: no step lost, none twice.
    assert second["first_step"] == first["last_step"] >= 3
    log = jobgen("logs", str(run_dir)).stdout
    assert f"resuming from {tmp_path}/preempted/out/checkpoint-{first['last_step']} (launch.resume_argument)" in log
    steps = [entry["step"] for entry in logged(tmp_path / "preempted")]
    assert steps == list(range(1, 13)), steps
    reference = logged(tmp_path / "reference")
    assert [entry["step"] for entry in reference] == list(range(1, 13))
    assert logged(tmp_path / "preempted")[-1]["loss"] == reference[-1]["loss"]
    status = jobgen("status", str(run_dir)).stdout
    assert "own program (launch.command)" in status
    print(f"preempted at step {first['last_step']}; final loss {reference[-1]['loss']} in both")


def test_a_script_of_the_users_preempted_at_each_moment_of_its_life_is_requeued_every_time_and_ends_as_an_uninterrupted_run(
        tmp_path: Path) -> None:
    script = "plain-ddp"
    reference_id, _ = start(tmp_path / "reference", script, tmp_path, f"{script}-reference", step_delay=0)
    job_id, run_dir = start(tmp_path / "preempted", script, tmp_path, f"{script}-preempt", step_delay=1,
                            **HELD_IN_EACH_PHASE)
    out = tmp_path / "preempted" / "out"
    for restarts, (moment, marker) in enumerate(PREEMPTED_AT, start=1):
        # Counted while the job waits in the queue: its next segment's marks are the new lines.
        before = lines(out / marker)
        wait_for(lambda: lines(out / marker) > before, f"{moment} ({marker}), segment {restarts}", timeout=240)
        preempt_nodes_of(job_id)
        release_when_requeued(job_id, restarts=restarts)
    assert wait_until_done(job_id, timeout=300) == "COMPLETED"
    assert wait_until_done(reference_id, timeout=300) == "COMPLETED"

    ends = segments(run_dir)
    log = jobgen("logs", str(run_dir)).stdout
    assert [end["outcome"] for end in ends] == ["preempted"] * len(PREEMPTED_AT) + ["completed"], (ends, log)
    assert "launch.command failed" not in log and "was killed by SIGTERM" not in log, log
    # Each segment from the one before's newest complete checkpoint: no step lost, none twice.
    for before, after in zip(ends, ends[1:]):
        assert after["first_step"] == (before["last_step"] or 0), (before, after)
    steps = [entry["step"] for entry in logged(tmp_path / "preempted")]
    assert steps == list(range(1, 13)), steps
    reference = logged(tmp_path / "reference")
    assert [entry["step"] for entry in reference] == list(range(1, 13))
    assert logged(tmp_path / "preempted")[-1]["loss"] == reference[-1]["loss"]
    print(f"preempted at steps {[end['last_step'] for end in ends[:-1]]}; final loss {reference[-1]['loss']} in both")


# A program whose rank 1 dies by a signal after its last step, as torch can abort in gloo's
# teardown: srun (--kill-on-bad-exit) ends the other node's task with SIGTERM and exits 143.
# No stop was asked for and the scheduler signalled nothing: a failure, not a preemption.
ABORT_AFTER_LAST_STEP = r'''
import json, os, time
rank = int(os.environ["RANK"])
for step in (1, 2, 3):
    time.sleep(0.2)
    if rank == 0:
        os.makedirs(f"out/checkpoint-{step}", exist_ok=True)
        json.dump({"global_step": step}, open(f"out/checkpoint-{step}/trainer_state.json", "w"))
if rank == 1:
    os.abort()
time.sleep(60)  # rank 0 still tearing down when rank 1 is gone
'''


def test_a_rank_that_dies_by_a_signal_after_its_last_step_fails_the_job_and_is_not_requeued(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "train.py").write_text(ABORT_AFTER_LAST_STEP)
    job = {
        "name": "jobgen-test-abort-at-exit",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1, "command": ["python", "train.py"], "checkpoints": "out/checkpoint-*"},
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", "job.yaml"], cwd=tmp_path,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    job_id, run_dir = out.stdout.strip(), tmp_path / "runs" / "jobgen-test-abort-at-exit"
    assert wait_until_done(job_id, timeout=180) == "FAILED"
    ends = [segment for segment in segments(run_dir)]
    log = jobgen("logs", str(run_dir)).stdout
    assert [segment["outcome"] for segment in ends] == ["failed"], (ends, log)
    assert "launch.command failed" in log and "requeueing" not in log, log
    assert "preempted" not in jobgen("status", str(run_dir)).stdout
