"""A real local run that a user stopped with Ctrl-C and resumed: one simulated node (one rank:
the cheapest real run), the tiny model, LoRA on DeepSpeed ZeRO-2, reporting to W&B (offline) and
MLflow (a file store). Made once per session, for tests/test_progress.py (what a user sees while it
runs), tests/test_plot.py (the picture of its two segments) and tests/test_trackers.py (one tracker
run across both)."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import tiny_model

STEPS = 6
STOP_AFTER_STEP = 2


@dataclass(frozen=True)
class StoppedAndResumed:
    run_dir: Path
    terminal: str  # the first `jobgen submit`, on a terminal, until Ctrl-C stopped it
    submit_piped: str  # the second, which resumed, with its output in a pipe
    follow_piped: str  # `jobgen logs -f` in a pipe during the second


@pytest.fixture(scope="session")
def stopped_and_resumed_run(tmp_path_factory) -> StoppedAndResumed:
    work = tmp_path_factory.mktemp("local-run")
    tiny_model(work / "tiny")
    job = {
        "name": "stop-resume",
        "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": "tiny/model", "data": "tiny/data.json", "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": STEPS, "logging_interval": 1,
                     "report_to": ["wandb", "mlflow"]},
    }
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_DEBUG_STEP_DELAY": "0.5",
           # W&B's own settings and caches here, not in the home folder; its mode is jobgen's choice.
           "WANDB_CONFIG_DIR": str(work / "wandb-config"), "WANDB_CACHE_DIR": str(work / "wandb-cache"),
           "WANDB_DATA_DIR": str(work / "wandb-data")}
    for name in ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        env.pop(name, None)
    submit = [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"]
    run_dir = work / "runs" / "stop-resume"

    # 1. On a terminal (a pseudo-terminal), in its own process group as a shell would start it.
    leader, follower = pty.openpty()
    first = subprocess.Popen(submit, cwd=work, env=env, stdin=follower, stdout=subprocess.PIPE, stderr=follower,
                             start_new_session=True)
    os.close(follower)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_until_closed, args=(leader, chunks), daemon=True)
    reader.start()
    _wait_for(lambda: _logged_step(run_dir) >= STOP_AFTER_STEP or first.poll() is not None, "step 2 of the first run", 180)
    os.killpg(first.pid, signal.SIGINT)  # what Ctrl-C on that terminal sends
    first.wait(timeout=120)
    reader.join(timeout=30)

    # 2. Again, the same command, with its output in a pipe; and `jobgen logs -f` in a pipe.
    second = subprocess.Popen(submit, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _starts(run_dir) >= 2, "the second run's segment to start", 60)
    follow = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "logs", "-f", str(run_dir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, submit_piped = second.communicate(timeout=300)
    assert second.returncode == 0, submit_piped
    follow_piped, errors = follow.communicate(timeout=30)  # it ends by itself once the job has ended
    assert follow.returncode == 0, errors
    return StoppedAndResumed(run_dir, b"".join(chunks).decode(errors="replace"), submit_piped, follow_piped)


def _read_until_closed(fd: int, chunks: list[bytes]) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every process holding the terminal has closed it
            break
        if not data:
            break
        chunks.append(data)
    os.close(fd)


def _logged_step(run_dir: Path) -> int:
    path = run_dir / "output" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _starts(run_dir: Path) -> int:
    """How many segments have started: their start lines (a stop also writes lines, a `stopping`
    then an `end`, so the lines alone do not count segments)."""
    path = run_dir / "segments.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if line.startswith('{"event": "start"'))


def _wait_for(condition, what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)
