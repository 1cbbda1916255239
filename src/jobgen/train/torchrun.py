"""`jobgen-torchrun`: torchrun, minus the traceback when the job is stopped by a signal.

A scheduler that preempts or cancels a job (PBS, Slurm) sends SIGTERM to every process of the
job. torchrun forwards it to the ranks, waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and then
raises its SignalException out of main, which prints a Python traceback into the node's log for
what is a normal stop. This runs torchrun's own main unchanged and turns that exception into one
line; what the ranks did is in RUN_DIR/trainer-exit.json, which the batch script reads.
"""

from __future__ import annotations

import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except SignalException as stop:
        name = getattr(stop.sigval, "name", str(stop.sigval))
        sys.stderr.write(f"jobgen-torchrun: {name}: the ranks were told to stop and have exited\n")
        sys.exit(128 + int(stop.sigval))


if __name__ == "__main__":
    main()
