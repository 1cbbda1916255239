"""`RUN_DIR/trainer-exit.json`: what the batch script reads to decide whether to requeue.

Written by rank 0 only, atomically (temporary file, fsync, rename, fsync of the directory), so a
reader sees either no file or a whole one. Fields:

- reason: "completed" (every step ran and the final model was saved), "stopped" (a signal arrived
  and a complete checkpoint of `last_step` was committed; resuming continues from it), or
  "failed" (an exception or a user error; the process exits non-zero).
- signal: the first stop signal received ("SIGTERM", "SIGUSR1", ...) or null.
- first_step: the optimizer step this run resumed from (0 for a fresh start).
- last_step: the last optimizer step completed by this run (== first_step if none ran).
- checkpoint: path of the newest complete checkpoint (for "stopped" and "completed", the one of
  `last_step`; for "failed", the one a restart would resume from) or null.
- started_at, ended_at: ISO 8601 UTC; train_seconds: seconds spent in the training loop.
- message: one human-readable line.
- job_id, restart: the segment this run was (JOBGEN_JOB_ID, JOBGEN_RESTART_COUNT), as segments.jsonl
  names it, so `jobgen status` shows the message beside its own segment.
- failure: for "failed", what kind, which decides the requeue (docs/exit-codes.md): "user_error",
  "not_finite", "out_of_memory", "health_mismatch" and "crash" are not requeued; "node_health" is,
  without `nodes`.
- nodes: the nodes a failure is attributed to, space-separated (for the batch script), or "".
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Optional

from jobgen.files import replace_atomically
from jobgen.rundir.files import TRAINER_EXIT
from jobgen.train.metrics import this_segment

EXIT_FILE = TRAINER_EXIT


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class NotFinite(RuntimeError):
    """The loss is not finite (raised by the trainer): the run fails and is not requeued."""


@dataclass
class ExitReport:
    reason: str = "failed"
    signal: Optional[str] = None
    first_step: int = 0
    last_step: int = 0
    checkpoint: Optional[str] = None
    started_at: str = field(default_factory=now_iso)
    ended_at: Optional[str] = None
    train_seconds: float = 0.0
    message: str = ""
    job_id: Optional[str] = field(default_factory=lambda: this_segment()["job_id"])
    restart: int = field(default_factory=lambda: this_segment()["restart"])
    failure: Optional[str] = None
    nodes: str = ""


def write_json_atomically(path: str, payload: dict) -> None:
    """Write `payload` to `path` so that readers never see a partial file, and it survives a crash."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    replace_atomically(path, json.dumps(payload, indent=2) + "\n", durable=True)


def write_exit_report(run_dir: str, report: ExitReport) -> str:
    report.ended_at = now_iso()
    path = os.path.join(run_dir, EXIT_FILE)
    write_json_atomically(path, asdict(report))
    return path
