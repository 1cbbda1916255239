"""The run directory: everything about one job on disk, so later commands can find and explain it.

    RUN_DIR/job.yaml            the resolved job (every layer applied), as the trainer reads it
    RUN_DIR/job.<scheduler>.sh  the exact script that runs
    RUN_DIR/submission.txt      the exact text handed to the scheduler (the script itself)
    RUN_DIR/submissions.jsonl   one line per submission: job id, time, scheduler
    RUN_DIR/segments.jsonl      written by the script: one start and one end line per segment
    RUN_DIR/logs/               written live by the job: JOBID.out (the batch script),
                                JOBID-nodeK.out (node K: torchrun, rank 0),
                                JOBID-ranks/0-999/JOBID-rankR.out (a folder per 1,000 ranks)
    RUN_DIR/output/             the trainer's checkpoints, metrics and final weights

The names are jobgen.rundir.files'. An index in $XDG_STATE_HOME/jobgen (~/.local/state/jobgen)
maps job ids to run directories.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from jobgen.rundir import files as runfiles
from jobgen.rundir.metrics import read_jsonl
from jobgen.errors import JobgenError


def _state_dir() -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "jobgen"


def index_path() -> Path:
    """The user's record of every `jobgen submit`: one line each, job id, scheduler, run directory."""
    return _state_dir() / "index.jsonl"


def index_entries() -> list[dict[str, Any]]:
    return read_jsonl(index_path())


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def job_file(self) -> Path:
        return self.path / runfiles.JOB_FILE

    def settings(self) -> dict[str, Any]:
        """The resolved job as plain data, as the last submission wrote it; {} where it is
        missing or unreadable (the other records still explain the run)."""
        import yaml

        from jobgen.rundir.metrics import SAFE_LOADER

        try:
            found = yaml.load(self.job_file.read_text(), Loader=SAFE_LOADER)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return {}
        return found if isinstance(found, dict) else {}

    def script(self, scheduler: str) -> Path:
        return self.path / runfiles.script(scheduler)

    @property
    def submission_text(self) -> Path:
        return self.path / runfiles.SUBMISSION_TEXT

    @property
    def logs(self) -> Path:
        return self.path / runfiles.LOGS

    def submissions(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / runfiles.SUBMISSIONS)

    def segments(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / runfiles.SEGMENTS)

    def latest(self) -> dict[str, Any]:
        found = self.submissions()
        if not found:
            raise JobgenError(f"{self.path} has no {runfiles.SUBMISSIONS}: it was not made by `jobgen submit`")
        return found[-1]

    def record_submission(self, job_id: str, scheduler: str, **extra: Any) -> dict[str, Any]:
        entry = {"job_id": job_id, "scheduler": scheduler, "submitted_at": _now(), **extra}
        _append_jsonl(self.path / runfiles.SUBMISSIONS, entry)
        _append_jsonl(index_path(), {"job_id": job_id, "scheduler": scheduler, "run_dir": str(self.path),
                                     "submitted_at": entry["submitted_at"]})
        return entry


def find_run(target: str) -> RunDir:
    """A run directory given as a path, or the one a job id was submitted from."""
    return find_target(target)[0]


def find_target(target: str) -> tuple[RunDir, Optional[str]]:
    """The run directory `target` names, and the job id when it names a job rather than the
    directory: a run directory holds every job submitted into it, and the id says which."""
    path = Path(target)
    # logs/ is the first thing a batch script makes: a job that stopped before its first
    # segment (wrong node count, say) has only its log to show.
    if any((path / name).exists() for name in (runfiles.SUBMISSIONS, runfiles.SEGMENTS, runfiles.LOGS)):
        return RunDir(path.resolve()), None
    for entry in reversed(index_entries()):
        if entry.get("job_id") == target:
            return RunDir(Path(entry["run_dir"])), target
    found = one_run_named(target)
    if found is None:
        raise JobgenError(f"'{target}' is neither a run directory, a job id nor the name of a run submitted with "
                          "`jobgen submit` (`jobgen runs` lists them)")
    if (found / runfiles.SWEEP_RECORD).is_file():
        raise JobgenError(f"'{target}' is a sweep ({found}): give one of its points, e.g. {found}/POINT_NAME")
    return RunDir(found), None


def indexed_run_dirs() -> list[Path]:
    """Every run directory in the index, once, the most recently submitted first."""
    newest: dict[str, None] = {}
    for entry in index_entries():
        if isinstance(entry, dict) and isinstance(entry.get("run_dir"), str):
            newest.pop(entry["run_dir"], None)  # re-inserted: the dict keeps submission order
            newest[entry["run_dir"]] = None
    return [Path(run_dir) for run_dir in reversed(newest)]


def runs_named(name: str) -> list[Path]:
    """The run directories (or sweep folders) `name` names, as `jobgen runs` shows them: the job's
    name or its folder's, and a sweep's point as SWEEP_NAME/POINT_NAME; newest first. Only run
    directories still there count: a removed one can be neither read nor resumed."""
    found: dict[Path, None] = {}
    for path in indexed_run_dirs():
        try:
            if not (path / runfiles.SUBMISSIONS).is_file():
                continue
        except OSError:  # on a file system this machine cannot reach now
            continue
        job_name = RunDir(path).settings().get("name")
        names = {path.name} | ({job_name} if isinstance(job_name, str) else set())
        sweep = path.parent
        if (sweep / runfiles.SWEEP_RECORD).is_file():  # a point: the sweep's name names the sweep
            if name in {f"{each}/{path.name}" for each in names}:
                found[path] = None
            elif name in names - {path.name} or name == sweep.name:
                found[sweep] = None
        elif name in names:
            found[path] = None
    return list(found)


_SAID_NEWEST: set[str] = set()


def one_run_named(name: str) -> Optional[Path]:
    """The run directory (or sweep folder) `name` names, the most recently submitted where several
    do (two checkouts' runs of one job, say), the others then listed in a line on stderr; None
    when none does."""
    if not name or name.count("/") > 1:  # a name is NAME or SWEEP_NAME/POINT_NAME
        return None
    found = runs_named(name)
    if len(found) > 1 and name not in _SAID_NEWEST:  # once, though a command may look a name up twice
        _SAID_NEWEST.add(name)
        others = "; ".join(str(path) for path in found[1:])
        sys.stderr.write(f"jobgen: '{name}' names {len(found)} runs: this is the newest, {found[0]}; "
                         f"the other(s): {others} (give a run directory to choose one)\n")
    return found[0] if found else None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _append_jsonl(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # `jobgen runs --prune` rewrites the index under this lock
        handle.write(json.dumps(entry) + "\n")

