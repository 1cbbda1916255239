"""A local run ends with the `jobgen submit` that shows it, however that ends (what `timeout`, a
script or a supervisor sends it alone, its terminal closing, `jobgen cancel`), after the checkpoint
the stop asks for; and while it lives, a second submit into its run directory is refused. Real
runs of the tiny model (one simulated node, one rank), as tests/local_run.py makes them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, tiny_model
from tests.processes import signal_all, with_environment
from tests.local_run import _logged_step, _starts, _wait_for

STEPS = 40  # far more than are trained before the stop: the run must not end by itself


def _job(work: Path) -> list[str]:
    tiny_model(work / "tiny")
    (work / "job.yaml").write_text(yaml.safe_dump({
        "name": "lifecycle",
        "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": "tiny/model", "data": "tiny/data.json", "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": STEPS, "logging_interval": 1},
    }))
    return [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"]


@pytest.mark.parametrize("how", ["kill -INT", "kill -TERM", "kill -HUP", "jobgen cancel"])
def test_a_local_run_ends_with_its_jobgen_and_blocks_a_second_submit_while_it_lives(how: str, tmp_path: Path) -> None:
    submit = _job(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_DEBUG_STEP_DELAY": "0.5",
           "XDG_STATE_HOME": str(tmp_path / "state")}  # `jobgen runs` lists this test's runs alone
    run_dir = tmp_path / "runs" / "lifecycle"
    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = "-"
    try:
        _wait_for(lambda: _logged_step(run_dir) >= 2 or first.poll() is not None, "step 2", 180)
        job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]

        second = jobgen(*submit[3:], cwd=tmp_path, env=env)
        errors = [line for line in second.stderr.splitlines() if line.startswith("jobgen: error: ")]
        assert second.returncode == 2 and len(errors) == 1, second.stderr
        assert errors[0].startswith(f"jobgen: error: job {job_id} of run directory {run_dir} is still running here "), errors
        assert f"jobgen cancel {job_id}" in errors[0]
        assert [r["state"] for r in json.loads(jobgen("runs", "--json", env=env).stdout)] == ["running"]  # not "running or lost"

        if how == "jobgen cancel":
            cancelled = jobgen("cancel", job_id, env=env)
            assert cancelled.returncode == 0 and cancelled.stderr == f"jobgen: cancelled job {job_id}\n", cancelled.stderr
        else:
            os.kill(first.pid, getattr(signal, "SIG" + how.split("-")[1]))  # jobgen alone, not its group
        _, said = first.communicate(timeout=180)
    finally:
        if first.poll() is None:  # a failed test leaves nothing training
            signal_all(with_environment("JOBGEN_JOB_ID", job_id) + [first.pid], signal.SIGKILL)
    assert "Aborted!" not in said and "Traceback" not in said, said
    assert "asking every rank to checkpoint at the next step boundary and stop" in said, said
    assert not with_environment("JOBGEN_JOB_ID", job_id)  # nothing of the job trains on
    status = json.loads(jobgen("status", "--json", str(run_dir)).stdout)
    stopped = status["segments"][-1]
    # The word of the signal the script got: jobgen passes SIGINT and SIGTERM on as they came, SIGHUP
    # (which the script does not trap) as SIGTERM; `jobgen cancel` sends SIGINT, as Ctrl-C does.
    assert stopped["outcome"] == ("terminated" if how in ("kill -TERM", "kill -HUP") else "interrupted"), stopped
    assert 2 <= status["step"] < STEPS
    assert first.returncode == 1  # stopped before the end, as after Ctrl-C

    if how == "kill -INT":  # once is enough: the ended job's records block nothing, the same command resumes
        newest = "-"
        resumed = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(lambda: (_starts(run_dir) >= 2 and len((run_dir / "submissions.jsonl").read_text().splitlines()) >= 2)
                      or resumed.poll() is not None, "the second segment to start", 120)
            # A job id names that job exactly: the ended one is not taken for the run's newest.
            earlier = jobgen("cancel", job_id, env=env)
            newest = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
            assert earlier.returncode == 0 and earlier.stderr == (
                f"jobgen: job {job_id} has already ended: nothing to cancel; the run went on as job {newest} (jobgen cancel {run_dir})\n")
            assert resumed.poll() is None
            assert jobgen("cancel", str(run_dir), env=env).stderr == f"jobgen: cancelled job {newest}\n"
            _, said = resumed.communicate(timeout=180)
        finally:
            if resumed.poll() is None:
                signal_all(with_environment("JOBGEN_JOB_ID", newest) + [resumed.pid], signal.SIGKILL)
        assert "is still running" not in said and _starts(run_dir) == 2, said


def test_a_sigterm_during_a_time_limit_stop_keeps_the_time_limit_as_the_outcome(tmp_path: Path) -> None:
    """Slurm's warning (USR1) asks for the checkpoint; when the ranks are still writing it at the
    limit, Slurm's SIGTERM follows. The segment stopped at its time limit (and is requeued as
    such), not by a cancel."""
    submit = _job(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_DEBUG_STEP_DELAY": "0.5",
           "XDG_STATE_HOME": str(tmp_path / "state")}
    run_dir = tmp_path / "runs" / "lifecycle"
    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    job_id = "-"
    try:
        _wait_for(lambda: _logged_step(run_dir) >= 2 or first.poll() is not None, "step 2", 180)
        job_id, script_pid = (run_dir / "local.pid").read_text().split()
        os.kill(int(script_pid), signal.SIGUSR1)  # the warning: requeue.signal's default
        log = run_dir / "logs" / f"{job_id}.out"
        _wait_for(lambda: "time_limit: asking" in log.read_text(), "the warning to be taken", 30)
        os.kill(int(script_pid), signal.SIGTERM)  # the time limit itself, before the checkpoint is done
        _, said = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            signal_all(with_environment("JOBGEN_JOB_ID", job_id) + [first.pid], signal.SIGKILL)
    assert "jobgen: time_limit: asking every rank to checkpoint" in said, said
    assert "jobgen: terminated while stopping for time_limit" in said, said
    status = json.loads(jobgen("status", "--json", str(run_dir)).stdout)
    assert status["segments"][-1]["outcome"] == "time_limit", status["segments"]
    assert 2 <= status["step"] < STEPS
