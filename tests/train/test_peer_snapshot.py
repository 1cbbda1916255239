"""Peer snapshots (training.snapshot_every): two nodes, one rank each, as two torchrun agents on
this host with node names of their own and separate snapshot folders. SIGKILL of every process
with no checkpoint on disk since step 0's start, and node b's memory gone with it (a power-off):
the restart resumes from the newest step node a holds whole, at most one step before the last one
trained, and ends bitwise equal to a run never interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jobgen.train import peer_snapshot
from tests.helpers import free_port
from tests.processes import descendants, signal_all

SETTINGS = dict(epochs=2, save_interval=100, async_save=True)  # 12 steps; a checkpoint only at the last


def two_nodes(job: Path, tools, snapshots: Path, **env: str) -> list[subprocess.Popen]:
    """Node a (node rank 0) and node b, each a torchrun agent with one rank."""
    port = free_port()
    procs = []
    for node_rank, node in enumerate("ab"):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "jobgen.train", "--job", str(job),
        ]
        log = open(job.parent / f"node-{node}.log", "a")
        procs.append(subprocess.Popen(
            command, cwd=job.parent, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=tools.subprocess_env(JOBGEN_NODE_NAME=node, JOBGEN_SNAPSHOT_DIR=str(snapshots / node), **env),
        ))
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen], job: Path, timeout: float = 300) -> None:
    for proc in procs:
        proc.wait(timeout=timeout)
    logs = "".join((job.parent / f"node-{n}.log").read_text() for n in "ab")
    assert all(p.returncode == 0 for p in procs), logs[-6000:]


def write_two_node_job(run_dir: Path, tiny: Path, tools) -> Path:
    import yaml

    job = tools.write_job(run_dir, tiny, procs=1, **SETTINGS)
    text = yaml.safe_load(job.read_text())
    text["resources"]["nodes"] = 2
    job.write_text(yaml.safe_dump(text))
    return job


@pytest.fixture(scope="module")
def uninterrupted(tiny, tools, tmp_path_factory):
    root = tmp_path_factory.mktemp("peer")
    job = write_two_node_job(root / "straight", tiny, tools)
    wait_all(two_nodes(job, tools, root / "memory"), job)
    return tools.adapter_weights(job.parent / "output")


def logged_steps(output: Path) -> list[int]:
    path = output / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_node_powered_off_between_checkpoints_loses_at_most_one_step_and_resumes_bitwise(
    uninterrupted, tiny, tools, tmp_path
):
    job = write_two_node_job(tmp_path / "run", tiny, tools)
    output, memory = job.parent / "output", tmp_path / "memory"
    procs = two_nodes(job, tools, memory, JOBGEN_DEBUG_STEP_DELAY="0.4")
    deadline = time.monotonic() + 240
    while max(logged_steps(output), default=0) < 7:
        assert all(p.poll() is None for p in procs), "a node ended before step 7"
        assert time.monotonic() < deadline, "step 7 not reached"
        time.sleep(0.05)
    signal_all(descendants([p.pid for p in procs]), signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)
    trained = max(logged_steps(output))
    assert not list((output / "checkpoints").glob("step-*")), "a checkpoint on disk: the case is a resume from memory"
    # Node b's memory is gone with its power; node a's holds its own snapshots and b's.
    held_by_a = sorted(os.listdir(next((memory / "a").glob("jobgen-snapshots-*/*/a"))))
    import shutil

    shutil.rmtree(memory / "b")
    assert {n.split(".")[1] for n in held_by_a if peer_snapshot.NAME.match(n)} == {"rank-00000", "rank-00001"}, held_by_a

    wait_all(two_nodes(job, tools, memory), job)
    logs = (job.parent / "node-a.log").read_text()
    resumed = json.loads((output / "checkpoints" / "step-000012" / "trainer_state.json").read_text())
    assert resumed["step"] == 12
    manifests = [json.loads(p.read_text()) for p in (output / "checkpoints").glob("step-*/manifest.json")]
    from_memory = [m for m in manifests if "written_from" in m]
    start = int(logs.split("resumed from ")[1].split("(step ")[1].split(")")[0].split(",")[0])
    assert start >= trained - 1, f"resumed from step {start}, {trained} were trained: more than one step lost"
    assert "snapshot of step" in logs and "held in the memory of a" in logs, logs[-4000:]
    assert not from_memory or from_memory[0]["written_from"] == "snapshot held in the memory of a"
    final = tools.adapter_weights(output)
    assert final.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
    # A completed run leaves nothing in memory.
    assert not list((memory / "a").glob("jobgen-snapshots-*/*/a"))
