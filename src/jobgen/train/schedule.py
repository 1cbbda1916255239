"""The learning-rate schedule (transformers' shapes) and the run's length in optimizer steps,
which the schedule's total is, and which a resume must keep."""

from __future__ import annotations

import math

from jobgen.errors import UserError
from jobgen.job.models import Training


def total_steps_of(training: Training, steps_per_epoch: int) -> int:
    """Optimizer steps of the whole run: max_steps when set (the data cycles, epoch after epoch, as
    in the Hugging Face Trainer), else `epochs` passes (the last step of each may be short)."""
    if training.max_steps is not None:
        return training.max_steps
    return steps_per_epoch * training.epochs


class LRFactor:
    """Multiplier of the peak learning rate after `step` optimizer steps (transformers' shapes).
    An object, not a closure, so that LambdaLR's state_dict carries schedule, warmup and total
    into every checkpoint."""

    def __init__(self, schedule: str, warmup: int, total: int) -> None:
        self.schedule, self.warmup, self.total = schedule, warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def check_schedule_total(found_state: dict, factor: LRFactor, checkpoint_name: str) -> None:
    """A resumed run must follow the LR curve the checkpoint's run was on: a different total
    (max_steps, or epochs without max_steps) bends it from the resume point on, and the run would
    match neither its first plan nor its new one. A constant schedule has no total to bend."""
    saved = (found_state.get("lr_scheduler", {}).get("lr_lambdas") or [None])[0]
    if not isinstance(saved, dict) or "total" not in saved or factor.schedule == "constant":
        return
    if saved["total"] != factor.total:
        raise UserError(
            f"training.max_steps: checkpoint {checkpoint_name} belongs to a run of {saved['total']} steps on a "
            f"{factor.schedule} schedule, this job has {factor.total} (from max_steps, or epochs when max_steps is "
            f"unset), which would change the learning rate from the resume point on: set max_steps: {saved['total']} "
            "to resume, or use a new training.output_dir to start a run of the new length"
        )
