"""Linux's parent-death signal, for a process that must not outlive the one that started it: a
rank its torchrun (jobgen.train.lifeline), a local job's script its `jobgen submit`
(jobgen.schedulers.local). Shared by the parts below which neither may import the other."""

from __future__ import annotations

import ctypes
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def signal_when_the_parent_dies(signum: int) -> bool:
    """This process gets `signum` when its parent dies; False where that cannot be asked (not
    Linux, no libc), and nothing then changes."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
