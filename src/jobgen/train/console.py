"""Where a rank's output goes inside a jobgen job: all of it to the rank's own file, and to the
node's log only what a user should read there.

Every rank of every node prints the same library lines (DeepSpeed's accelerator, bitsandbytes'
kernels, FutureWarnings): in the node logs they would say everything world-size times. So each
rank's stdout and stderr (the file descriptors, so C libraries' output too) go to
RUN_DIR/logs/JOBID-ranks/0-999/JOBID-rankR.out (jobgen.rundir.files.rank_log); rank 0's also
still reach its node's log, once; the other ranks show there only their own warnings and errors (the `jobgen-train` logger) and a crash's summary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import TextIO

from jobgen.rundir.files import rank_log


_tee: "subprocess.Popen[bytes] | None" = None
_tee_pipe: "tuple[int, int] | None" = None  # (st_dev, st_ino) of the pipe into tee


def rank_log_path(run_dir: str, job_id: str, rank: int) -> str:
    return os.path.join(run_dir, rank_log(job_id, rank))


def open_rank_log(run_dir: str, job_id: str, rank: int) -> int:
    """The rank's log, opened to append (its folder made by the first rank that needs it)."""
    path = rank_log_path(run_dir, job_id, rank)
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def route_output(run_dir: str, job_id: str, rank: int) -> TextIO:
    """Redirects fds 1 and 2 as the module says; returns a stream to the node's log."""
    path = rank_log_path(run_dir, job_id, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    node_log = os.dup(2)
    if rank == 0:
        # tee ignores the stop signals a scheduler sends the whole job: the stop is worth logging.
        global _tee, _tee_pipe
        os.close(open_rank_log(run_dir, job_id, rank))  # its folder, for tee
        _tee = subprocess.Popen(
            ["tee", "-a", path], stdin=subprocess.PIPE, stdout=node_log, preexec_fn=_ignore_stop_signals
        )
        target = os.dup(_tee.stdin.fileno())  # type: ignore[union-attr]
        _tee.stdin.close()  # type: ignore[union-attr]
        _tee_pipe = _identity(target)
    else:
        target = open_rank_log(run_dir, job_id, rank)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    return os.fdopen(node_log, "w", buffering=1)


def finish_output() -> None:
    """Before the process exits: rank 0's last lines reach the node log before torchrun ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _tee is not None:
        # tee ends when the last writer of its pipe closes it, and fds 1 and 2 may not be the
        # last: a library can hold a copy (DeepSpeed's op builder dups stderr and never closes
        # it). Waiting for tee then took until the scheduler's SIGKILL, several seconds of every
        # preemption. Close every descriptor of the pipe this process holds.
        for fd in _descriptors():
            if fd in (1, 2) or _identity(fd) == _tee_pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
        try:
            _tee.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a child process still holds it: its lines are in the rank's file
            pass


def _identity(fd: int) -> "tuple[int, int] | None":
    try:
        stat = os.fstat(fd)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _descriptors() -> list[int]:
    """This process's open file descriptors (Linux's /proc; elsewhere only 1 and 2)."""
    try:
        return sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        return [1, 2]


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
