"""`jobgen submit`: render, lay out the run directory, hand the script to the scheduler, record it.

Rendering stays a pure function (jobgen.script.render); this module only adds files and one call to the
scheduler. Every scheduler submits the rendered script itself, so --dry-run shows exactly what
would be submitted, and RUN_DIR/submission.txt is that script.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from jobgen.job.layers import ResolvedJob
from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.script.render import job_yaml, render
from jobgen.rundir.progress import watch_process
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


def submit(resolved: ResolvedJob, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> tuple[str, Plan]:
    scheduler = get_scheduler(scheduler_name)
    planned = plan(resolved, scheduler_name, template_dirs)
    refuse_if_active(planned.run)
    planned.run.logs.mkdir(parents=True, exist_ok=True)
    write_atomic(planned.run.job_file, job_yaml(resolved.job))
    write_atomic(planned.script_path, planned.script)
    write_atomic(planned.run.submission_text, planned.script)
    job_id = scheduler.submit(resolved.job, planned.script_path, planned.run.path)
    planned.run.record_submission(job_id, scheduler.name, script=str(planned.script_path))
    if scheduler.runs_in_foreground:  # its output and the training's progress, until it ends
        watch_process(scheduler.process, planned.run.path, sys.stderr)
    return job_id, planned


def refuse_if_active(run: RunDir) -> None:
    """Two jobs training into one run directory would overwrite each other's checkpoints."""
    submissions = run.submissions()
    if not submissions:
        return
    last = submissions[-1]
    try:
        scheduler = get_scheduler(last["scheduler"])
        if scheduler.runs_in_foreground:
            return  # its `jobgen submit` returned, so it has ended
        state = scheduler.state(last["job_id"])
    except JobgenError:
        return  # the scheduler cannot be asked from here; nothing to protect against
    if state and state.state.upper() in scheduler.active_states:
        raise JobgenError(
            f"job {last['job_id']} of run directory {run.path} is still {state.state}: "
            f"cancel it (jobgen cancel {last['job_id']}) or set a different run_dir"
        )
