"""Peer snapshots (training.snapshot_every), LoRA and Q-LoRA: two nodes, one rank each, as two
torchrun agents on this host with node names of their own and separate snapshot folders. SIGKILL of every process
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

from jobgen.train import peer_snapshot, snapshot_file
from tests.helpers import free_port
from tests.processes import descendants, signal_all

SETTINGS = dict(epochs=2, save_interval=100, async_save=True)  # 12 steps; a checkpoint only at the last
METHODS = {"lora": {}, "qlora": {"method": "qlora", "precision": "bf16"}}  # Q-LoRA: bitsandbytes' 4-bit on the CPU


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


def write_two_node_job(run_dir: Path, tiny: Path, tools, method: str = "lora") -> Path:
    import yaml

    job = tools.write_job(run_dir, tiny, procs=1, **SETTINGS, **METHODS[method])
    text = yaml.safe_load(job.read_text())
    text["resources"]["nodes"] = 2
    job.write_text(yaml.safe_dump(text))
    return job


@pytest.fixture(scope="module")
def uninterrupted(tiny, tools, tmp_path_factory):
    """uninterrupted(method): the adapter of a run of it never interrupted (made once)."""
    made: dict = {}

    def of(method: str) -> dict:
        if method not in made:
            root = tmp_path_factory.mktemp(f"peer-{method}")
            job = write_two_node_job(root / "straight", tiny, tools, method)
            wait_all(two_nodes(job, tools, root / "memory"), job)
            made[method] = tools.adapter_weights(job.parent / "output")
        return made[method]

    return of


def logged_steps(output: Path) -> list[int]:
    path = output / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("method", METHODS)
def test_a_node_powered_off_between_checkpoints_loses_at_most_one_step_and_resumes_bitwise(
    method, uninterrupted, tiny, tools, tmp_path
):
    reference = uninterrupted(method)
    job = write_two_node_job(tmp_path / "run", tiny, tools, method)
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
    assert final.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), f"{name} differs from the uninterrupted run"
    # A completed run leaves nothing in memory.
    assert not list((memory / "a").glob("jobgen-snapshots-*/*/a"))


def test_a_snapshot_file_gives_back_every_state_as_it_was_and_a_cut_one_is_refused():
    from collections import OrderedDict

    states = {
        "optimizer": OrderedDict(flat=torch.randn(300), step=torch.tensor(7), empty=torch.zeros(0, 3, dtype=torch.bfloat16)),
        "module": [torch.randn(5, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bool), torch.arange(4).reshape(2, 2).t()],
        "rng": {"cpu": torch.get_rng_state(), "python": (3, tuple(range(5)), None)},
        "scalars": {"epoch": 1, "shape": torch.Size([2, 3]), "dtype": torch.float16, "text": b"#!/usr/bin/env python\n"},
    }
    data = b"".join(bytes(piece) for piece in snapshot_file.pieces(states))
    back = snapshot_file.load(bytearray(data))

    def same(a, b):
        assert type(a) is type(b), (a, b)
        if isinstance(a, torch.Tensor):
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), (a, b)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(states, back)
    with pytest.raises(ValueError, match="not a whole snapshot"):
        snapshot_file.load(bytearray(data[:-1]))  # a write cut short is never taken for a snapshot


def test_each_rank_sends_to_its_place_on_the_next_node_and_keeps_the_previous_nodes():
    nodes = ["cn1", "cn1", "cn2", "cn2", "cn3", "cn3"]
    assert [peer_snapshot.ring_neighbours(nodes, r) for r in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    assert peer_snapshot.ring_neighbours(["cn1", "cn1"], 1) == (None, None)  # one node: nobody else to hold them


def test_the_newest_step_held_whole_and_newer_than_the_disk_is_chosen():
    held = {(7, 0, 2): 0, (7, 1, 2): 0, (8, 0, 2): 0, (6, 0, 2): 1, (6, 1, 2): 1}
    assert peer_snapshot.choose(held, disk=4) == (7, 2)  # step 8 lacks rank 1: a node lost before it arrived
    assert peer_snapshot.choose(held, disk=7) == (None, None)  # the disk is as new
    assert peer_snapshot.choose(held, disk=None) == (7, 2)
    # Another world's snapshots (a resize) are whole only with every rank of that world.
    assert peer_snapshot.choose({(9, 0, 4): 0, (9, 1, 4): 0, (9, 2, 4): 2}, disk=None) == (None, None)


def test_another_runs_snapshots_and_pieces_a_kill_left_are_removed(tmp_path):
    mine = peer_snapshot.snapshot_name(5, 1, 2, "aa")
    for name in (mine, peer_snapshot.snapshot_name(5, 0, 2, "bb"), f".{peer_snapshot.snapshot_name(6, 0, 2, 'aa')}.x1y2.tmp",
                 "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert peer_snapshot.inventory(str(tmp_path), "aa") == {(5, 1, 2): str(tmp_path / mine)}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, "notes.txt"])  # not ours to judge: left alone
    for step in (6, 7):
        (tmp_path / peer_snapshot.snapshot_name(step, 0, 2, "aa")).write_bytes(b"x")
    peer_snapshot.prune(str(tmp_path), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "notes.txt") == [
        peer_snapshot.snapshot_name(6, 0, 2, "aa"), peer_snapshot.snapshot_name(7, 0, 2, "aa")]


def test_a_node_that_cannot_keep_snapshots_trains_without_them_and_says_so_once(make_job, tools, tmp_path):
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    job = make_job("no-memory", epochs=1)
    done = tools.train(job, JOBGEN_SNAPSHOT_DIR=str(not_a_folder))
    assert done.returncode == 0, done.stdout
    said = [line for line in done.stdout.splitlines() if "no snapshots in this segment" in line]
    assert len(said) == 1 and "set JOBGEN_SNAPSHOT_DIR to a node-local folder it can write" in said[0], done.stdout
    assert tools.exit_report(job.parent)["reason"] == "completed"
