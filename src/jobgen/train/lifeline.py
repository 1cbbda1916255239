"""A rank ends when the torchrun that started it dies.

torchrun starts every rank in a session of its own. A scheduler that ends a job by killing its
sessions (Torque's MoM, on qrerun, qdel and at the walltime: SIGKILL within milliseconds) kills
torchrun and the node script but not the ranks: they train on, and the job's rerun, started at
once on the same nodes, trains beside them into the same checkpoints. Linux's parent-death signal
ends the rank with its torchrun. A torchrun that stops normally waits for its ranks first, so this
changes nothing for a checkpoint written at a stop signal.
"""

from __future__ import annotations

import os
import signal

from jobgen.parent_death import signal_when_the_parent_dies


def die_with_torchrun() -> None:
    """In a rank that torchrun started (Linux): SIGKILL when torchrun dies."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()
    if not signal_when_the_parent_dies(signal.SIGKILL):
        return
    if os.getppid() != parent:  # torchrun died before the call: nothing would signal this rank
        os.kill(os.getpid(), signal.SIGKILL)
