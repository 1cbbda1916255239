"""`JobgenCallback`: a Hugging Face Trainer that saves and stops when jobgen stops its job.

    from jobgen.train.hf import JobgenCallback
    trainer = Trainer(..., callbacks=[JobgenCallback()])

The Trainer does not save on a signal by itself: a preempted one loses every step since its last
periodic checkpoint. This callback installs jobgen's stop handlers (`jobgen.train.stop`: SIGTERM,
SIGUSR1, SIGUSR2, SIGINT only set a flag) and also reads RUN_DIR/stop-requested; at each step end
all ranks agree on the request with one all-reduce (a signal reaches the ranks at different
moments), then every rank sets `should_save` and `should_training_stop`: the Trainer writes
checkpoint-N of that step and `train()` returns, and the script exits 0, which jobgen reads, after
its stop request, as "stopped with a checkpoint" and requeues.

It also seals each checkpoint the Trainer saves: the Trainer's rank 0 writes trainer_state.json,
the file jobgen takes as "complete", without waiting for the other ranks' rng_state_N.pth (no
barrier between them in transformers' _save_checkpoint), so a node lost in between would leave a
"complete" checkpoint that resumes with another RNG or not at all. At on_save every rank has
saved its part; after one barrier rank 0 writes SEALED_MARK into the checkpoint, and at its first
start it says in the run directory from which step it seals (OWN_CHECKPOINTS_SEALED): the batch
script then passes only sealed checkpoints of later steps.

Its DataLoader worker processes outlive a stop signal for as long as the ranks may take to stop
(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, requeue.warning_seconds in a jobgen job): torch's workers die
at a SIGTERM from anyone but their rank, and Slurm's preemption signals every process of the
job's steps, so the rank raised "DataLoader worker ... is killed by signal: Terminated" before
the callback could save. A worker then ends by itself once that time is up.

At the end of training it also has the stop signals ignored once the script exits (a late one
would kill the rank while Python finalizes) and the process group destroyed, while Python is
still whole: a Trainer never destroys it, and gloo's worker threads can then abort
(SIGABRT) the interpreter's finalization on some rank of a complete run (pytorch/pytorch#179291),
which jobgen would read as a failed node.

transformers and torch are imported when the callback is made, not with this module, and
DeepSpeed never: a script may import this before it decides what to use.
"""

from __future__ import annotations

import atexit
import functools
import os
from pathlib import Path
from typing import Any

from jobgen.files import write_atomic
from jobgen.rundir.files import OWN_CHECKPOINTS_SEALED, SEALED_MARK, STOP_REQUESTED
from jobgen.rundir.rewind import own_checkpoints_sealed_after
from jobgen.train.stop import StopRequest


class StopAtStepEnd:
    """JobgenCallback's behaviour; JobgenCallback is this and transformers' TrainerCallback."""

    def __init__(self, run_dir: str | None = None) -> None:
        run_dir = run_dir or os.environ.get("JOBGEN_RUN_DIR")
        self.run_dir = run_dir or None
        self.stop = StopRequest(os.path.join(run_dir, STOP_REQUESTED) if run_dir else None).install()
        self.stopped_at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        loader = kwargs.get("train_dataloader")
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's wrapper iterates its base
        if loader is not None and getattr(loader, "num_workers", 0) > 0:
            loader.worker_init_fn = functools.partial(outlive_stop_signals, loader.worker_init_fn)
        if self.run_dir and state.is_world_process_zero:
            # The step it starts from: the checkpoints up to it were written before it sealed (a run
            # begun under an older jobgen) and stay complete without the seal; a run taken back to
            # an earlier step (jobgen submit --resume-from) seals from there.
            sealed_after = own_checkpoints_sealed_after(Path(self.run_dir))
            if sealed_after is None or sealed_after > state.global_step:
                write_atomic(Path(self.run_dir) / OWN_CHECKPOINTS_SEALED, f"{state.global_step}\n")
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        _barrier()  # every rank has written its part of the checkpoint
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and checkpoint.is_dir():
            write_atomic(checkpoint / SEALED_MARK, f"every rank saved step {state.global_step}\n")
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.stopped_at is None and self._agreed(args):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"jobgen: stop requested ({self.stop.signal_name or 'on another rank'}): saving checkpoint-"
                      f"{state.global_step} and stopping", flush=True)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        atexit.register(destroy_gloo_process_group)
        atexit.register(ignore_stop_signals)  # registered last: runs first
        return control

    def _agreed(self, args: Any) -> bool:
        """Whether any rank has a stop request: every rank stops at the same step, or one would
        wait in the save's collectives for the others."""
        import torch.distributed as dist

        asked = 1 if self.stop.requested else 0
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return bool(asked)
        import torch

        device = args.device if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([asked], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def outlive_stop_signals(init_fn: Any, worker_id: int) -> None:
    """A DataLoader worker's init (module level: a worker of the spawn or forkserver kind gets it
    pickled): a stop signal starts the time the rank has to stop, then SIGALRM ends the worker as
    the signal would have. Set after torch's own worker handlers, which this one replaces."""
    import signal

    from jobgen.train.stop import STOP_SIGNALS

    grace = max(1, int(float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or 60)))

    def stop_later(signum: int, frame: object) -> None:
        if signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            signal.alarm(grace)

    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_later)
    if init_fn is not None:
        init_fn(worker_id)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def ignore_stop_signals() -> None:
    """At exit: the stop signals ignored from here on. Python restores a signal's default action
    while it finalizes, so the stop signal jobgen-torchrun forwards after this rank already read the
    stop file (and saved) would kill it there, and a rank killed by a signal is a failed node."""
    import signal

    from jobgen.train.stop import STOP_SIGNALS

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def destroy_gloo_process_group() -> None:
    """At exit: a gloo process group goes before the interpreter does. Not NCCL's, whose destroy
    may wait on another rank; its teardown is not the one that aborts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


_made: dict[str, type] = {}


def __getattr__(name: str) -> type:
    # PEP 562: JobgenCallback is made at its first import, when transformers is imported, not before.
    if name != "JobgenCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _made:
        from transformers import TrainerCallback

        _made[name] = type(name, (StopAtStepEnd, TrainerCallback), {
            "__module__": __name__,
            "__doc__": "A TrainerCallback: on jobgen's stop request (a signal, or RUN_DIR/stop-requested), saves a "
                       "checkpoint at the next step end on every rank and ends training. run_dir defaults to "
                       "$JOBGEN_RUN_DIR (set on every node of a jobgen job); outside one, only the signals count.",
        })
    return _made[name]
