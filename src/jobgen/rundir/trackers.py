"""The experiment trackers' run ids of a run, kept in RUN_DIR/trackers.json.

A jobgen run is one tracker run however often it is requeued or resumed: the first start that
needs an id makes it (a W&B id is any short text; an MLflow run must be created in its store,
which gives the id) and keeps it here, and every later start reads it back and continues that
run (W&B's resume="allow" with the id, MLflow's run id). Written whole by one writer at a time:
the trainer's rank 0, or node 0's jobgen-torchrun for the job's own program.

    {"wandb": "k3v9q2xa", "mlflow": {"run_id": "9826d4...", "tracking_uri": "file:/.../mlruns"}}
"""

from __future__ import annotations

import json
import secrets
import string
from pathlib import Path
from typing import Any, Callable

from jobgen.files import write_atomic
from jobgen.rundir.files import TRACKER_IDS

WANDB_ID_CHARACTERS = string.ascii_lowercase + string.digits  # what W&B's own generate_id uses


def kept_ids(run_dir: str) -> dict[str, Any]:
    """The ids kept so far ({} before the first start, or for a file that is not ours)."""
    try:
        ids = json.loads(Path(run_dir, TRACKER_IDS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def keep_id(run_dir: str, tracker: str, make: Callable[[], Any]) -> Any:
    """The kept id of `tracker`; made by `make()` and kept on its first use. One writer at a time."""
    ids = kept_ids(run_dir)
    if tracker not in ids:
        ids[tracker] = make()
        write_atomic(Path(run_dir, TRACKER_IDS), json.dumps(ids, indent=1) + "\n")
    return ids[tracker]


def new_wandb_id() -> str:
    return "".join(secrets.choice(WANDB_ID_CHARACTERS) for _ in range(8))


def wandb_offline_folders(run_dir: str, run_id: str) -> str:
    """What `wandb sync` is given: every segment's offline folder of the run (a glob for a shell)."""
    return str(Path(run_dir, "wandb", f"offline-run-*-{run_id}"))
