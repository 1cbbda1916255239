"""The machine's process tree, read from /proc: which processes a job started, and which is which
rank. The tests and benchmarks that kill or measure ranks share it (torchrun starts each rank in
a session of its own, so a process group or session does not find them all)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every process of this machine."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return table


def descendants(pids: list[int], table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """pids and every process they started, still running."""
    table = table or process_table()
    found = set(pids)
    while True:
        more = {pid for pid, (ppid, _) in table.items() if ppid in found} - found
        if not more:
            return sorted(pid for pid in found if pid in table)
        found |= more


def ranks_of(root: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers among root's descendants: the processes with RANK in
    their environment whose parent has none (a worker's own children inherit its RANK)."""
    table = process_table()
    rank_of = {}
    for pid in descendants([root], table):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank_of.update({pid: int(item[5:]) for item in environ if item.startswith(b"RANK=")})
    return {rank: pid for pid, rank in rank_of.items() if table[pid][0] not in rank_of}


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def with_environment(name: str, value: str) -> list[int]:
    """This machine's processes whose environment has name=value: a local job's, by its
    JOBGEN_JOB_ID, which its script, nodes and ranks all inherit."""
    wanted = f"{name}={value}".encode()
    found = []
    for pid in process_table():
        try:
            if wanted in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


# --- A node's faults, as the Slurm and PBS tests cause them ---------------------------------------


def rank_pids(run_dir: Path, node_rank: int) -> list[int]:
    """The rank processes of one node, as its hang supervisor publishes them in the run directory
    (RUN_DIR/heartbeat/node-K.json), and their children."""
    node = json.loads((run_dir / "heartbeat" / f"node-{node_rank}.json").read_text())
    pids = [rank["pid"] for rank in node["ranks"]]
    return pids + [pid for pid, (parent, _) in process_table().items() if parent in pids]


def hang_node(run_dir: Path, node_rank: int, timeout: float = 300) -> float:
    """Stops a node's ranks with SIGSTOP (a real hang: the other ranks block in their collective)
    until the hang supervisor has written RUN_DIR/hang.json, then continues them (the supervisor
    kills them: none is left stopped). Returns when they were stopped."""
    stopped = rank_pids(run_dir, node_rank)
    stopped_at = time.time()
    signal_all(stopped, signal.SIGSTOP)
    try:
        while not (run_dir / "hang.json").exists():
            if time.time() > stopped_at + timeout:
                raise AssertionError(f"the hang was not detected in {timeout} s")
            time.sleep(1)
    finally:
        signal_all(stopped, signal.SIGCONT)
    return stopped_at


def kill_node(run_dir: Path, node_rank: int) -> float:
    """Kills all of a node's processes at once with SIGKILL, as when the node goes down: its
    torchrun (the ranks' parent, which the node's task became) and everything under it. Returns
    when."""
    table = process_table()
    ranks = [pid for pid in rank_pids(run_dir, node_rank) if pid in table]
    torchrun = {table[pid][0] for pid in ranks if table[pid][0] not in ranks}
    assert len(torchrun) == 1, (ranks, torchrun)
    killed_at = time.time()
    signal_all(descendants(sorted(torchrun), table), signal.SIGKILL)
    return killed_at
