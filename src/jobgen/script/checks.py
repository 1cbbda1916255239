"""What a script for one scheduler needs of the job, checked before any template is read: the
checks `render` runs first and `validate` runs alone (no Jinja is imported for them)."""

from __future__ import annotations

from typing import Any, Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers import refuse_unknown_directives
from jobgen.schedulers.base import Scheduler
from jobgen.script.containers import check_container


def check_for_scheduler(job: Job, scheduler: Scheduler, array: Optional[tuple[int, Optional[int]]] = None) -> tuple[str, list[str]]:
    """The job's launcher and header lines on `scheduler`; JobgenError for what it refuses: a
    launcher it cannot use, a container that launcher cannot start, a variable the scheduler
    owns, an extra directive that repeats a generated option or that no scheduler reads.
    `array`: (tasks, most running at once) for a sweep's job array."""
    launcher = scheduler.launcher(job)
    check_container(job, scheduler.name, launcher)
    directives = scheduler.directives(job, array)
    refuse_unknown_directives(job, scheduler)
    return launcher, directives


def check_array_points(jobs: list[Job], scheduler: Scheduler) -> None:
    """A job array runs every point of a sweep with one script: the points may differ only in
    what the script does not read, `training` (and their run directories, which the sweep sets)."""
    shared = jobs[0].model_dump(mode="json", exclude={"training", "run_dir"})
    for job in jobs[1:]:
        other = job.model_dump(mode="json", exclude={"training", "run_dir"})
        if other != shared:
            raise JobgenError(
                f"sweep: '{_first_difference(shared, other)}' differs between the points in {jobs[0].effective_run_dir} "
                f"and {job.effective_run_dir}, but a {scheduler.name} job array runs every point with one script: sweep "
                "only training.* keys there (or submit each value of it as a sweep of its own)"
            )


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".")
