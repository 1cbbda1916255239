"""Background checkpoint saves (training.async_save): SIGKILL of the whole job at each phase of a
save, then a resume from the newest complete checkpoint that ends bitwise equal to a run that was
never interrupted (2 ranks, ZeRO-2, LoRA with dropout, gloo on the CPU).

The kill moments are chosen with JOBGEN_DEBUG_SAVE_PAUSE=PHASE@STEP:SECONDS, which holds the save
of STEP at PHASE and leaves OUTPUT_DIR/debug-save-pause-PHASE-rankR: the snapshot (training paused
on every rank), the background write (first file written, none durable, training going on), and
the commit (rank 0: manifest written, COMPLETE not yet). benchmarks/checkpoint_kill_fuzz.py does
the same at 20 random moments.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import free_port
from tests.processes import descendants, signal_all

SETTINGS = dict(epochs=1, save_interval=2, snapshot_every=0)  # 6 steps; saves at 2, 4, 6; the disk only


@pytest.fixture(scope="module")
def uninterrupted(tiny, tools, tmp_path_factory):
    """The reference run, with the synchronous save path (so the two paths are compared too)."""
    job = tools.write_job(tmp_path_factory.mktemp("async") / "straight", tiny, async_save=False, **SETTINGS)
    done = tools.train(job)
    assert done.returncode == 0, done.stdout
    return tools.adapter_weights(job.parent / "output")


def kill_whole_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank at once (torchrun starts each rank in a session of its own)."""
    signal_all(descendants([proc.pid]), signal.SIGKILL)
    proc.wait(timeout=30)


def _complete_steps(output: Path) -> list[int]:
    root = output / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step-*") if (p / "COMPLETE").exists())


def _run_until_killed(job: Path, tools, phase: str, step: int) -> str:
    """Start the job with the save of `step` held at `phase`, SIGKILL it all there; its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "-m", "jobgen.train", "--job", str(job),
    ]
    env = tools.subprocess_env(JOBGEN_DEBUG_SAVE_PAUSE=f"{phase}@{step}:120")
    proc = subprocess.Popen(command, cwd=job.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    marker = job.parent / "output" / f"debug-save-pause-{phase}-rank0"
    marker.unlink(missing_ok=True)
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert proc.poll() is None, f"the trainer ended before the {phase} of step {step}:\n{proc.stdout.read()}"
        assert time.monotonic() < deadline, f"the save of step {step} never reached {phase}"
        time.sleep(0.05)
    kill_whole_job(proc)
    output = proc.stdout.read()
    proc.stdout.close()
    return output


def test_sigkill_at_each_phase_of_a_save_then_resume_from_the_newest_complete_checkpoint_bitwise(
    uninterrupted, tiny, tools, tmp_path
):
    job = tools.write_job(tmp_path / "killed", tiny, **SETTINGS)
    output = job.parent / "output"
    checkpoints = output / "checkpoints"

    # 1. Killed while training is paused for the snapshot of step 4: step 2 was committed before
    #    (one save in flight at most), step 4 has only a temporary directory.
    _run_until_killed(job, tools, "snapshot", 4)
    assert _complete_steps(output) == [2] and (checkpoints / ".tmp-step-000004").is_dir()

    # 2. Resumed from step 2, killed while step 4's files are being written in the background
    #    and training goes on.
    log = _run_until_killed(job, tools, "write", 4)
    assert "removing incomplete checkpoint" in log and "resumed from" in log and "step-000002" in log
    assert _complete_steps(output) == [2]

    # 3. Resumed from step 2 again, step 4 committed in the background, killed at step 6's commit:
    #    its manifest is written, COMPLETE is not.
    _run_until_killed(job, tools, "commit", 6)
    assert _complete_steps(output) == [2, 4]
    assert (checkpoints / ".tmp-step-000006" / "manifest.json").exists()
    assert not (checkpoints / ".tmp-step-000006" / "COMPLETE").exists()

    # 4. The last run resumes from step 4 and ends as if nothing had happened.
    resumed = tools.train(job)
    assert resumed.returncode == 0, resumed.stdout
    assert "removing incomplete checkpoint" in resumed.stdout
    report = tools.exit_report(job.parent)
    assert (report["reason"], report["first_step"], report["last_step"]) == ("completed", 4, 6)
    assert report["checkpoint"].endswith("step-000006")
    again = tools.adapter_weights(output)
    assert uninterrupted.keys() == again.keys()
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], again[name]), name


def test_the_snapshot_is_a_copy_that_training_cannot_change():
    from jobgen.train.background_save import host_copy

    weight = torch.ones(4)
    view = weight[:2]
    state = collections.OrderedDict(module={"w": weight, "again": weight}, optimizer=[{"exp_avg": view, "step": 3}])
    copy = host_copy(state, {})
    weight.add_(1.0)  # the next optimizer step, in place
    assert type(copy) is collections.OrderedDict
    assert torch.equal(copy["module"]["w"], torch.ones(4)) and torch.equal(copy["optimizer"][0]["exp_avg"], torch.ones(2))
    assert copy["module"]["w"] is copy["module"]["again"]  # one tensor stays one tensor
    assert copy["optimizer"][0]["exp_avg"].untyped_storage().nbytes() == 2 * 4  # a view is saved alone
