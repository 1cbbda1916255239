"""`jobgen submit`: render, lay out the run directory, hand the script to the scheduler, record it.

Rendering stays a pure function (jobgen.script.render); this module only adds files and one call to the
scheduler. Every scheduler submits the rendered script itself, so --dry-run shows exactly what
would be submitted, and RUN_DIR/submission.txt is that script.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from jobgen.job.layers import ResolvedJob
from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.script.render import job_yaml, render
from jobgen.rundir import files as runfiles, resubmission
from jobgen.rundir.progress import StopRequests, watch_process
from jobgen.rundir.run import RunDir
from jobgen.schedulers import get_scheduler


@dataclass(frozen=True)
class Plan:
    run: RunDir
    script_path: Path
    script: str


def run_dir_for(resolved: ResolvedJob) -> RunDir:
    job = resolved.job
    base = Path(job.environment.workdir) if job.environment.workdir else Path.cwd()
    return RunDir((base / job.effective_run_dir).resolve())


def plan(resolved: ResolvedJob, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> Plan:
    run = run_dir_for(resolved)
    return Plan(run=run, script_path=run.script(scheduler_name), script=render(resolved, scheduler_name, template_dirs))


def submit(resolved: ResolvedJob, scheduler_name: str, template_dirs: Sequence[Path] = (),
           stops: Optional[StopRequests] = None) -> tuple[str, Plan]:
    """A job run in the foreground (local) is watched until it ends, a stop asked of jobgen passed
    on to it; `stops`, when given, is a sweep's, kept across its points."""
    scheduler = get_scheduler(scheduler_name)
    planned = plan(resolved, scheduler_name, template_dirs)
    refuse_if_active(planned.run)
    refused = resubmission.refusal(planned.run, resolved.job)
    if refused:
        raise JobgenError(refused)
    planned.run.logs.mkdir(parents=True, exist_ok=True)
    write_atomic(planned.run.job_file, job_yaml(resolved.job))
    write_atomic(planned.script_path, planned.script)
    write_atomic(planned.run.submission_text, planned.script)
    if not scheduler.runs_in_foreground:
        job_id = scheduler.submit(resolved.job, planned.script_path, planned.run.path)
        planned.run.record_submission(job_id, scheduler.name, script=str(planned.script_path))
        return job_id, planned
    with nullcontext(stops) if stops else StopRequests() as watched:  # from before the job starts: no stop is missed
        job_id = scheduler.submit(resolved.job, planned.script_path, planned.run.path)
        planned.run.record_submission(job_id, scheduler.name, script=str(planned.script_path))
        # Its output and progress, until it ends; the job's own program's node 0 output too.
        node_log = planned.run.path / runfiles.node_log(job_id, 0) if resolved.job.own_command else None
        watch_process(scheduler.process, planned.run.path, sys.stderr, watched, node_log)
    return job_id, planned


def refuse_if_active(run: RunDir) -> None:
    """Two jobs training into one run directory would overwrite each other's checkpoints: while
    the latest submission's job is queued or running (by its scheduler's word; a local job's
    processes, so a dead one's record blocks nothing), another submit is refused."""
    submissions = run.submissions()
    if not submissions:
        return
    last = submissions[-1]
    try:
        scheduler = get_scheduler(last["scheduler"])
        state = scheduler.state(last["job_id"])
    except JobgenError:
        return  # the scheduler cannot be asked from here; nothing to protect against
    if state and state.state.upper() in scheduler.active_states:
        job_id = last["job_id"]
        if scheduler.runs_in_foreground:
            stop = f"still running here ({state.reason}): stop it with Ctrl-C where it runs or jobgen cancel {job_id} (it checkpoints first)"
        else:
            stop = f"still {state.state}: cancel it (jobgen cancel {job_id})"
        raise JobgenError(f"job {job_id} of run directory {run.path} is {stop}, wait for it to end, or set a different run_dir")
