"""`jobgen runs`: every run of this user, from the record each `jobgen submit` appends to
$XDG_STATE_HOME/jobgen/index.jsonl (jobgen.rundir.run), one line per run directory, newest first.

A run's state comes from its own records (its newest segment's outcome); the scheduler is asked
only about a run whose records have not ended, so a long list costs no more than a short one.
"""

from __future__ import annotations

import calendar
import fcntl
import json
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable, Optional

from jobgen.errors import JobgenError
from jobgen.rundir import files as runfiles
from jobgen.rundir.outcome import attach_messages, summary
from jobgen.rundir.progress import FINAL_OUTCOMES
from jobgen.rundir.run import RunDir, index_entries, index_path
from jobgen.rundir.status import pair_segments
from jobgen.schedulers import get_scheduler


def runs(pattern: Optional[str] = None, states: Iterable[str] = (), limit: Optional[int] = None) -> list[dict[str, Any]]:
    """One summary per run directory in the index, the most recently submitted first: those whose
    name (or folder's name) matches the glob `pattern`, in one of `states`, at most `limit`."""
    wanted = {state.lower() for state in states}
    found: list[dict[str, Any]] = []
    for entry in _newest_entries():
        if limit is not None and len(found) >= limit:
            break
        run = describe(entry)
        if pattern and not (fnmatchcase(run["name"], pattern) or fnmatchcase(Path(run["run_dir"]).name, pattern)):
            continue
        if wanted and run["state"].lower() not in wanted:
            continue
        found.append(run)
    return found


def _newest_entries() -> list[dict[str, Any]]:
    """The latest index entry of each run directory, the most recently submitted first."""
    newest: dict[str, dict[str, Any]] = {}
    for entry in index_entries():
        if isinstance(entry, dict) and isinstance(entry.get("run_dir"), str):
            newest.pop(entry["run_dir"], None)  # re-inserted: the dict keeps submission order
            newest[entry["run_dir"]] = entry
    return list(reversed(newest.values()))


def gone_run_dirs() -> list[str]:
    """The index's run directories that are no longer there (removed, or no longer run
    directories), newest first. One this machine cannot look into now is not counted."""
    gone = []
    for entry in _newest_entries():
        try:
            if not (Path(entry["run_dir"]) / runfiles.SUBMISSIONS).is_file():
                gone.append(entry["run_dir"])
        except OSError:  # unreachable now (a file system not mounted): kept
            continue
    return gone


def prune(run_dirs: Iterable[str]) -> int:
    """Removes the index's entries of `run_dirs` that are still gone; returns how many lines went.
    The run directories themselves are not touched. Rewritten in place under a lock that
    `jobgen submit` takes to append (jobgen.rundir.run), so that no submission is lost meanwhile."""
    dropping = set(run_dirs)
    path = index_path()
    if not dropping or not path.exists():
        return 0
    with path.open("r+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        lines = handle.read().splitlines(keepends=True)
        still_gone = {run_dir for run_dir in dropping if not (Path(run_dir) / runfiles.SUBMISSIONS).is_file()}
        kept = [line for line in lines if _run_dir_of(line) not in still_gone]
        handle.seek(0)
        handle.write("".join(kept))
        handle.truncate()
    return len(lines) - len(kept)


def _run_dir_of(line: str) -> Optional[str]:
    try:
        entry = json.loads(line)
    except ValueError:
        return None  # a line that does not read is left as it is
    return entry.get("run_dir") if isinstance(entry, dict) else None


def describe(entry: dict[str, Any]) -> dict[str, Any]:
    """name, state, submitted_at, step, total_steps, last_loss, run_dir, job_id and scheduler of one run."""
    path = Path(entry["run_dir"])
    found = {"name": path.name, "state": "gone", "submitted_at": entry.get("submitted_at"), "step": None,
             "total_steps": None, "last_loss": None,
             "run_dir": str(path), "job_id": entry.get("job_id"), "scheduler": entry.get("scheduler")}
    run = RunDir(path)
    try:
        if not (path / runfiles.SUBMISSIONS).is_file():
            return found  # removed, or no longer a run directory
        submissions = run.submissions()
    except OSError:  # unreadable, or on a file system this machine cannot reach now
        return found
    job = run.settings()
    if isinstance(job.get("name"), str):
        found["name"] = job["name"]
    latest = submissions[-1] if submissions else entry
    # A sweep's points share the job's name: each is told by its folder's (a job array's tasks say
    # so in their submissions; elsewhere each point is a job of its own in the sweep's folder).
    if any(entry.get("sweep") for entry in submissions) or (path.parent / runfiles.SWEEP_RECORD).is_file():
        found["name"] = f"{found['name']}/{path.name}"
    segments = attach_messages(pair_segments(run.segments()), run)
    outcome = summary(run, segments, job)
    found.update(
        job_id=latest.get("job_id"), scheduler=latest.get("scheduler"), state=state(latest, segments),
        submitted_at=latest.get("submitted_at") or entry.get("submitted_at"),
        step=outcome["step"], total_steps=outcome["total_steps"], last_loss=outcome["last_loss"],
    )
    return found


def state(latest: dict[str, Any], segments: list[dict[str, Any]]) -> str:
    """How the latest submission's newest segment ended, once it has for good (FINAL_OUTCOMES:
    completed, failed, restarts_exhausted, restart_storm); before that, what the scheduler says: pending or running; where it
    cannot say (or no longer knows the job), the records' word."""
    first = next((i for i, s in enumerate(segments) if str(s["job_id"]) == str(latest.get("job_id"))), None)
    # Its segments: from its job's first on, a PBS job's continuations (new job ids) included.
    mine = [] if first is None else segments[first:]
    if mine and mine[-1]["outcome"] in FINAL_OUTCOMES:
        return mine[-1]["outcome"]
    active = _active(latest)
    if active:
        return "running" if mine and mine[-1]["ended_at"] is None else "pending"
    if not mine:  # it ended before its first segment (see its log), or is queued where none can ask
        return "not started" if active is False else "submitted"
    return mine[-1]["outcome"]  # "running or lost", or how it stopped (preempted, time_limit, ...)


def _active(latest: dict[str, Any]) -> Optional[bool]:
    """True while the scheduler holds the job queued or running, False once it does not, None
    where it cannot be asked (no scheduler command on this machine) or there is none to ask."""
    try:
        scheduler = get_scheduler(str(latest.get("scheduler")))
        found = scheduler.state(str(latest.get("job_id")))  # a local job: while its processes live
    except JobgenError:
        return None
    return bool(found) and found.state.upper() in scheduler.active_states


def format_table(found: list[dict[str, Any]], filtered: bool = False) -> str:
    if not found:
        if filtered:
            return "no run matches (jobgen runs without a pattern or --state lists them all)"
        return f"no runs yet: each `jobgen submit` is recorded in {index_path()}"
    header = ("name", "state", "submitted", "step", "loss", "run directory")
    rows = [
        (
            run["name"], run["state"], _local_time(run.get("submitted_at")),
            "-" if run["step"] is None else f"{int(run['step'])}" + ("" if run["total_steps"] is None else f"/{int(run['total_steps'])}"),
            "-" if run["last_loss"] is None else f"{run['last_loss']:.4f}",
            run["run_dir"],
        )
        for run in found
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows])


def _local_time(stamp: Any) -> str:
    """A record's UTC time (2026-01-01T09:30:00Z) as this machine's local time, to the minute."""
    try:
        seconds = calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:  # an index entry from before jobgen recorded the time there, or none
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(seconds))
