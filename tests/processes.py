"""The machine's process tree, read from /proc: which processes a job started, and which is which
rank. The tests and benchmarks that kill or measure ranks share it (torchrun starts each rank in
a session of its own, so a process group or session does not find them all)."""

from __future__ import annotations

import os
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
