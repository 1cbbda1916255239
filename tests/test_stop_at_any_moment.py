"""A stop is a stop whatever moment of a program's life it meets: real local runs (two simulated
nodes, one rank each) of a program of the user's own, stopped as a user does (Ctrl-C to `jobgen
submit`) before its first step, mid-step, inside a save and while it exits. Each ends `interrupted`
(a stop, from its newest complete checkpoint), never `failed`; `jobgen submit` returns within the
job's warning_seconds plus seconds, and no process of the job is left.

Before, a program stopped in its start-up (its handler not yet in place) or in its exit (its
handler put back to the default, as Python does when its interpreter ends) was killed by the stop's
own SIGTERM: torchrun reported the rank failed, the segment `failed` and was not requeued (3 of 6
stops in the start-up window, on main at 3c7ceae), and the node whose ranks had saved waited at
torch's exit barrier 300 s for the node that failed, and a rank whose peer the stop killed waited
for that peer as long as gloo waits (30 min)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobgen.schedulers.local import job_processes
from tests.own_scripts import write_script

WARNING_SECONDS = 30
STEPS = 6

# Each moment: the marker the stop waits for, and the delays (NAME_R: rank R's alone) that hold
# the program there.
MOMENTS = {
    "before-its-first-step": ("started-0", {"START_DELAY": "3"}),
    # Rank 1 has its handler and is about to join the group; rank 0 is still importing: the stop
    # kills rank 0, node 0's torchrun ends and takes the group's store with it, and rank 1, told to
    # stop by its flag alone, would try to reach that store for 30 minutes.
    "as-one-rank-starts": ("handler-1", {"START_DELAY_0": "8", "INIT_DELAY_1": "4"}),
    "mid-step": ("steps.jsonl", {"STEP_DELAY": "0.5"}),
    "inside-a-save": ("saving-0", {"SAVE_DELAY": "2", "STEP_DELAY": "0.2"}),
    "while-it-exits": ("exiting-0", {"EXIT_DELAY": "3"}),
}
# Two trials of each, but one where the stop waits out the ranks' grace (30 s).
TRIALS = [(moment, trial) for moment in MOMENTS for trial in range(1 if moment == "as-one-rank-starts" else 2)]


def write_job(folder: Path) -> None:
    folder.mkdir(parents=True)
    write_script(folder, "plain-ddp")
    job = {"name": "own", "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 1, "command": ["python", "train.py", "out"],
                      "resume_argument": "--resume {checkpoint}", "checkpoints": "out/checkpoint-*",
                      "checkpoint_complete_file": "COMPLETE"},
           "environment": {"variables": {"STEPS": STEPS, "SAVE_EVERY": 3}},
           "requeue": {"warning_seconds": WARNING_SECONDS}}
    (folder / "job.yaml").write_text(yaml.safe_dump(job))


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"the job ended before {path.name}:\n{process.communicate()[0]}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.parametrize("moment, trial", TRIALS, ids=[f"{moment}-{trial}" for moment, trial in TRIALS])
def test_an_own_program_stopped_at_any_moment_ends_as_a_stop_and_returns(tmp_path: Path, moment: str, trial: int) -> None:
    marker, delays = MOMENTS[moment]
    write_job(tmp_path / "work")
    work = tmp_path / "work"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", **delays}
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=work,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(work / "out" / marker, submit)
        stopped = time.monotonic()
        submit.send_signal(signal.SIGINT)  # Ctrl-C
        output = submit.communicate(timeout=WARNING_SECONDS + 60)[0]
    finally:
        submit.kill()
    took = time.monotonic() - stopped
    run_dir = work / "runs" / "own"
    segment = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()][-1]
    logs = "\n".join(path.read_text() for path in sorted((run_dir / "logs").glob("*.out")))
    assert segment["outcome"] == "interrupted", f"{moment}: {segment}\n{output}\n{logs}"
    assert "launch.command failed" not in output and "was killed by SIGTERM" not in logs, logs
    newest = max((int(complete.parent.name.split("-")[1]) for complete in (work / "out").glob("checkpoint-*/COMPLETE")),
                 default=None)
    assert segment["last_step"] == newest, (segment, newest)
    if moment == "inside-a-save":
        assert newest is not None and newest >= 3, newest  # the save it was in completed
    assert took < WARNING_SECONDS + 30, f"jobgen submit returned {took:.0f} s after Ctrl-C:\n{output}"
    job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
    assert job_processes(job_id) == {}, f"processes of the job left: {job_processes(job_id)}"


def test_a_jobgen_submit_killed_outright_still_stops_its_job_and_leaves_no_process(tmp_path: Path) -> None:
    # SIGKILL: nothing of `jobgen submit` can pass a stop on. Its job's script is sent SIGTERM when
    # it dies (the parent-death signal), checkpoints and stops, and writes its log to the end
    # though the pipe to `jobgen submit` is gone.
    work = tmp_path / "work"
    write_job(work)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "STEP_DELAY": "0.5"}
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=work,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(work / "out" / "steps.jsonl", submit)
    finally:
        submit.kill()
    submit.wait()
    run_dir = work / "runs" / "own"
    job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
    deadline = time.monotonic() + WARNING_SECONDS + 30
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(job_id) == {}, f"processes of the job left: {job_processes(job_id)}"
    segment = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()][-1]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert segment["outcome"] == "terminated", f"{segment}\n{log}"
    assert "jobgen: stopped (terminated)" in log, log


def test_jobgens_own_commands_are_found_beside_the_python_that_runs_jobgen(tmp_path: Path) -> None:
    # `.venv/bin/jobgen submit` without .venv activated: jobgen-torchrun is not on the user's PATH.
    job = {"name": "beside", "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 1, "command": [sys.executable, "-c", "print('the program ran')"]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not on PATH" not in done.stdout + done.stderr
    logs = "".join(path.read_text() for path in (tmp_path / "runs" / "beside" / "logs").rglob("*.out"))
    assert "the program ran" in logs, logs


def test_jobgen_train_stopped_in_its_start_up_ends_as_a_stop(tmp_path: Path) -> None:
    # Ctrl-C as soon as the node starts its rank: the trainer is importing torch and DeepSpeed, its
    # handlers not yet in place; the stop file is read at its first step boundary.
    from tests.helpers import tiny_model

    tiny_model(tmp_path / "tiny")
    job = {"name": "train-stop", "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 1}, "requeue": {"warning_seconds": WARNING_SECONDS},
           "training": {"model": "tiny/model", "data": "tiny/data.json", "method": "lora", "precision": "fp32",
                        "per_device_batch_size": 2, "max_length": 64, "max_steps": 6}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "train-stop"
    try:
        deadline = time.monotonic() + 120
        while not any("starting 1 rank(s)" in path.read_text() for path in (run_dir / "logs").glob("*-node0.out")):
            assert submit.poll() is None and time.monotonic() < deadline, "node 0 never started its rank"
            time.sleep(0.05)
        stopped = time.monotonic()
        submit.send_signal(signal.SIGINT)
        output = submit.communicate(timeout=WARNING_SECONDS + 120)[0]
    finally:
        submit.kill()
    segment = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()][-1]
    assert segment["outcome"] == "interrupted", f"{segment}\n{output}"
    assert "training failed" not in output, output
    assert time.monotonic() - stopped < WARNING_SECONDS + 60, output
