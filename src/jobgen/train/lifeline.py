"""A rank ends when the torchrun that started it dies.

torchrun starts every rank in a session of its own. A scheduler that ends a job by killing its
sessions (Torque's MoM, on qrerun, qdel and at the walltime: SIGKILL within milliseconds) kills
torchrun and the node script but not the ranks: they train on, and the job's rerun, started at
once on the same nodes, trains beside them into the same checkpoints. Linux's parent-death signal
ends the rank with its torchrun. A torchrun that stops normally waits for its ranks first, so this
changes nothing for a checkpoint written at a stop signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_torchrun() -> None:
    """In a rank that torchrun started (Linux): SIGKILL when torchrun dies."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # torchrun died before the call: nothing would signal this rank
        os.kill(os.getpid(), signal.SIGKILL)
