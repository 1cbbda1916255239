"""The best checkpoint by eval loss (`training.keep_best`): tracked, pointed to, kept and exported.

With evaluation on, every eval loss is offered to BestSoFar; a lower one than any before makes
its step the best, and the trainer saves a checkpoint of that step if it was not saving one
anyway. The best so far (step and loss) is in the trainer_state.json of every checkpoint, so a
resumed run compares each loss as the uninterrupted run did. When a checkpoint that is the best
is committed, CheckpointStore.commit points OUTPUT_DIR/checkpoints/best.json at it, written
atomically once the checkpoint is complete and renamed (never at a half-written one), and
keep_checkpoints' rotation passes over the checkpoint it names. On a start, the pointer is set
from the resumed checkpoint's state (restore_pointer): a checkpoint newer than that, set aside
as corrupt, is not the best any more. At the end the best checkpoint's weights are saved to
OUTPUT_DIR/best, beside OUTPUT_DIR/final.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Optional

from jobgen.train.exit_report import write_json_atomically

log = logging.getLogger("jobgen.train")

POINTER = "best.json"  # in the checkpoints folder: {"step", "eval_loss", "checkpoint"}
STATE_KEY = "best"  # in trainer_state.json: {"step", "eval_loss"}, the best up to that checkpoint


@dataclass
class BestSoFar:
    step: Optional[int] = None
    loss: Optional[float] = None

    @classmethod
    def from_state(cls, state: Optional[dict]) -> "BestSoFar":
        """The best as a checkpoint's trainer_state.json recorded it (none before any evaluation)."""
        best = (state or {}).get(STATE_KEY) or {}
        return cls(best.get("step"), best.get("eval_loss"))

    def offer(self, step: int, loss: float) -> bool:
        """True where `loss` is the lowest so far (ties keep the earlier step)."""
        if not math.isfinite(loss) or (self.loss is not None and loss >= self.loss):
            return False
        self.step, self.loss = step, loss
        return True

    def as_state(self) -> Optional[dict]:
        return None if self.step is None else {"step": self.step, "eval_loss": self.loss}


def pointed_checkpoint(root: str) -> Optional[str]:
    """The name of the checkpoint best.json points to, or None (no pointer, or an unreadable one)."""
    try:
        with open(os.path.join(root, POINTER), encoding="utf-8") as handle:
            name = json.load(handle).get("checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def write_pointer(root: str, name: str, best: dict) -> None:
    """Rank 0, once checkpoint `name` is complete and renamed: best.json names it."""
    write_json_atomically(os.path.join(root, POINTER), {**best, "checkpoint": name})


def restore_pointer(root: str, best: BestSoFar, name_of_step, is_complete) -> None:
    """Rank 0 on a start: best.json as the resumed state says (removed where it names no best, or
    the best's checkpoint is gone)."""
    pointer = os.path.join(root, POINTER)
    if best.step is not None:
        name = name_of_step(best.step)
        if is_complete(name):
            if pointed_checkpoint(root) != name:
                write_pointer(root, name, best.as_state())
            return
        log.warning("the best checkpoint so far, %s (eval loss %.4f), is gone; a better eval loss will make a new one",
                    name, best.loss)
    if os.path.exists(pointer):
        os.remove(pointer)
