"""The commit a run trains its hub model at, pinned in RUN_DIR/model-commit.json.

A hub model named by a branch or tag (`training.model_revision: main`) moves when its authors push,
and a shared cache's refs/main moves whenever anyone downloads the model again. A run resumed on
other weights or another tokenizer than it started with would go on, silently wrong. So the first
to learn the commit records it here, `jobgen prepare` (which downloads it) or the trainer's first
start (which finds it in the cache, or downloads it), and every later start of the run loads that
commit, wherever the branch points then. A commit named in the job needs no pin. To move a run to
the branch's new commit, start a new run (another name), or delete the file before its next start
(a resume from a checkpoint then trains on other weights than it started with).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from jobgen.files import write_atomic
from jobgen.job.hub_cache import COMMIT
from jobgen.rundir.files import MODEL_COMMIT

if TYPE_CHECKING:
    from jobgen.job.models import Job


def needs_pin(model: str, revision: str) -> bool:
    """A hub model at a branch or tag; not a local folder, not a commit."""
    return not os.path.isdir(model) and not COMMIT.match(revision)


def pinned_commit(run_dir: str, model: str, revision: str) -> Optional[str]:
    """The commit the run is pinned to for `model` at `revision`; None when it is not (a pin for
    another model or revision is the job's earlier settings, which a resume refuses anyway)."""
    try:
        record = json.loads(Path(run_dir, MODEL_COMMIT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (record.get("model"), record.get("revision")) != (model, revision):
        return None
    commit = record.get("commit")
    return commit if isinstance(commit, str) and COMMIT.match(commit) else None


def pin_commit(run_dir: str, model: str, revision: str, commit: str) -> str:
    """Pins `commit` unless the run is pinned already; the commit the run is pinned to. The first
    pin wins (created with a hard link, which fails where the file exists), so ranks and nodes
    that start together agree on one commit."""
    pinned = pinned_commit(run_dir, model, revision)
    if pinned:
        return pinned
    path = Path(run_dir, MODEL_COMMIT)
    path.parent.mkdir(parents=True, exist_ok=True)  # `jobgen prepare` may come before the run's first submit
    text = json.dumps({"model": model, "revision": revision, "commit": commit}) + "\n"
    if path.exists():  # a pin of the job's earlier model or revision: this one replaces it
        write_atomic(path, text)
        return commit
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    temp = Path(temp_name)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        out.write(text)
    os.chmod(temp, 0o644)
    try:
        os.link(temp, path)
    except FileExistsError:
        pass
    finally:
        temp.unlink()
    return pinned_commit(run_dir, model, revision) or commit


def load_revision(run_dir: str, model: str, revision: str) -> str:
    """The revision to load `model` at in this run: its pinned commit, else `revision`."""
    return (pinned_commit(run_dir, model, revision) if needs_pin(model, revision) else None) or revision


def at_its_pin(job: Job) -> Job:
    """`job` with training.model_revision at the commit its run is pinned to, where it is pinned:
    what the run's next start loads, and so what `jobgen validate` checks."""
    training = job.training
    if training is None:  # a program of the job's own loads what it loads
        return job
    revision = load_revision(os.path.abspath(job.effective_run_dir), training.model, training.model_revision)
    if revision == training.model_revision:
        return job
    return job.model_copy(update={"training": training.model_copy(update={"model_revision": revision})})
