"""A rank dies with its torchrun: a scheduler that kills a job by its sessions (Torque) kills
torchrun, and a rank in a session of its own (as torchrun starts each) must not train on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK = "from jobgen.train.lifeline import die_with_torchrun; die_with_torchrun(); print('ready', flush=True); import time; time.sleep(120)"
# torchrun's part: start the rank in a new session, pass on what it prints, then wait.
LAUNCHER = (
    "import os, subprocess, sys, time\n"
    f"rank = subprocess.Popen([sys.executable, '-c', {RANK!r}], start_new_session=True, stdout=subprocess.PIPE, text=True, env=os.environ)\n"
    "print(rank.pid, rank.stdout.readline().strip(), flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_a_rank_started_by_torchrun_dies_when_torchrun_is_killed(under_torchrun: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if under_torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    pid, ready = launcher.stdout.readline().split()
    assert ready == "ready"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 10
    while Path(f"/proc/{pid}").exists() and _state(pid) != "Z" and time.time() < deadline:
        time.sleep(0.1)
    gone = not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"
    if not gone:
        os.kill(int(pid), signal.SIGKILL)
    # Outside torchrun (a rank run by hand) nothing changes: it outlives its parent.
    assert gone == under_torchrun


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
