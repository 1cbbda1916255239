"""Which log `jobgen logs` reads. The batch script and each node write their own into RUN_DIR/logs
on every scheduler and launcher, named by the job id the script ran as: JOBID.out, JOBID-nodeK.out,
JOBID-ranks/0-999/JOBID-rankR.out. A run directory holds every job submitted into it (and a PBS job's continuations,
each under a new id), so a target names the job as well as the directory: a job id names that job,
a run directory its newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from jobgen.errors import JobgenError
from jobgen.rundir import files as runfiles
from jobgen.rundir.run import RunDir, find_target


def log_path(target: str, node: Optional[int], rank: Optional[int] = None) -> Path:
    """The batch log of the job `target` names, or its node K's or rank R's. A job id names
    exactly that job's log, a run directory the newest job's."""
    run, named = find_target(target)
    return _log_of(run, named or newest_job_id(run, None), node, rank)


def current_log_path(target: str, node: Optional[int], rank: Optional[int] = None) -> Path:
    """What `jobgen logs -f` shows now: the log of the newest job of what `target` names (a
    PBS continuation of the named job, once it has started, is that job going on)."""
    run, named = find_target(target)
    return _log_of(run, newest_job_id(run, named), node, rank)


def events_of(run: RunDir, named: Optional[str], events: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """The segment records (`events`, else the run's) of the job `named` and of its
    continuations, until another submission's job starts; every record when it is None."""
    events = run.segments() if events is None else events
    if named is None:
        return events
    # A continuation a job submitted of itself (continuation_of) goes on with that job.
    submitted = {str(entry.get("job_id")) for entry in run.submissions() if not entry.get("continuation_of")}
    mine, inside = [], False
    for event in events:
        job_id = str(event.get("job_id"))
        if job_id == named:
            inside = True
        elif job_id in submitted:
            inside = False  # another submission's job, in the same run directory
        if inside:
            mine.append(event)
    return mine


def newest_job_id(run: RunDir, named: Optional[str]) -> str:
    """The job id the newest segment of `named` (or of the run) ran as; before any segment, the
    named job, the latest submission, or for a script submitted by hand its newest batch log."""
    starts = [event for event in events_of(run, named) if event.get("event") == "start"]
    if starts:
        return str(starts[-1]["job_id"])
    if named is not None:
        return named
    if run.submissions():
        return str(run.latest()["job_id"])
    return _newest_batch_log_job_id(run)  # submitted by hand and stopped before its first segment


def _log_of(run: RunDir, job_id: str, node: Optional[int], rank: Optional[int]) -> Path:
    if rank is not None:
        path = run.path / runfiles.rank_log(job_id, rank)
        flat = run.path / runfiles.LOGS / f"{job_id}-rank{rank}.out"  # as jobgen wrote it before the rank folders
        path = flat if not path.exists() and flat.exists() else path
    else:
        path = run.path / (runfiles.node_log(job_id, node) if node is not None else runfiles.batch_log(job_id))
    if not path.exists():  # a log that is there is shown, whatever the job file says now
        _refuse_out_of_range(run, job_id, node, rank)
    return path


def _refuse_out_of_range(run: RunDir, job_id: str, node: Optional[int], rank: Optional[int]) -> None:
    """A node or rank the job does not have will never write a log: say which it has, from the
    resolved job (the run directory's job.yaml: that of its latest submission)."""
    job = run.settings()
    resources, launch = job.get("resources") or {}, job.get("launch") or {}
    nodes = resources.get("nodes") if isinstance(resources, dict) else None
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        return  # no job file to go by: the caller says the log is not there yet
    if node is not None and not 0 <= node < nodes:
        raise JobgenError(f"job {job_id} has {_numbered('node', nodes)} (resources.nodes): there is no node {node}")
    per_node = (launch.get("procs_per_node") if isinstance(launch, dict) else None) or resources.get("gpus_per_node")
    if rank is not None and isinstance(per_node, int) and per_node > 0 and not 0 <= rank < nodes * per_node:
        raise JobgenError(
            f"job {job_id} has {_numbered('rank', nodes * per_node)} (world size {nodes * per_node}: {nodes} node(s) "
            f"x {per_node} process(es)): there is no rank {rank}"
        )


def _numbered(word: str, count: int) -> str:
    return f"{word}s 0-{count - 1}" if count > 1 else f"only {word} 0"


def _newest_batch_log_job_id(run: RunDir) -> str:
    found = [(p, runfiles.batch_log_job_id(p.name)) for p in run.logs.glob("*")]
    found = [(p, job_id) for p, job_id in found if job_id]
    if not found:
        raise JobgenError(f"{run.path} has no log yet")
    return max(found, key=lambda item: item[0].stat().st_mtime)[1]
