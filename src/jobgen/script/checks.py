"""What a script for one scheduler needs of the job, checked before any template is read: the
checks `render` runs first and `validate` runs alone (no Jinja is imported for them)."""

from __future__ import annotations

from typing import Optional

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
