"""One module per scheduler; add a scheduler by adding a short module and a template.

The bundled schedulers are listed here; installed packages add more through the
`jobgen.schedulers` entry-point group (jobgen.plugins). A bundled name always means the bundled
scheduler: a plug-in cannot replace one.

May import jobgen.job (a scheduler reads the job's resources); nothing above. `commands.py` runs a
scheduler's own commands and turns their refusals into one line.
"""

from __future__ import annotations

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import Scheduler

# Imported on first use: a render for one scheduler loads only that module (cold start counts).
BUNDLED: dict[str, str] = {
    "slurm": "jobgen.schedulers.slurm:Slurm",
    "pbs": "jobgen.schedulers.pbs:PbsPro",
    "torque": "jobgen.schedulers.torque:Torque",
    "local": "jobgen.schedulers.local:Local",
}


def scheduler_names() -> list[str]:
    """Every scheduler `--scheduler` accepts: the bundled ones, then installed plug-ins by name."""
    from jobgen.plugins import installed_schedulers

    return [*BUNDLED, *sorted(set(installed_schedulers()) - set(BUNDLED))]


def get_scheduler(name: str) -> Scheduler:
    """The scheduler called `name`; an installed plug-in is looked up only for a name not bundled."""
    from jobgen.plugins import SCHEDULER_GROUP, installed_schedulers, load_entry_point

    target = BUNDLED.get(name) or installed_schedulers().get(name)
    if target is None:
        accepted = ", ".join(scheduler_names())
        raise JobgenError(f"unknown scheduler '{name}'; accepted: {accepted} (plug-ins add more: pip install one)")
    cls = load_entry_point(SCHEDULER_GROUP, name, target)
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise JobgenError(f"scheduler '{name}' ({target}) is not a subclass of jobgen.schedulers.base.Scheduler")
    if getattr(cls, "name", None) != name:
        raise JobgenError(
            f"scheduler '{name}' ({target}) calls itself '{getattr(cls, 'name', None)}': its class attribute "
            f"name must be '{name}', the entry point's name, so that status and cancel find it again"
        )
    return cls()


def refuse_unknown_directives(job: Job, scheduler: Scheduler) -> None:
    """Another scheduler's extra directives are left out (one job file may serve several); a line
    no scheduler reads is a typo (`#SBTACH`), refused rather than dropped."""
    lines = [line for line in job.extra_directives if not scheduler.is_own_directive(line)]
    if not lines:
        return  # the usual case: no scheduler but the chosen one is loaded
    known = directive_prefixes()
    for line in lines:
        if line.split(maxsplit=1)[0] not in known:
            accepted = ", ".join(f"{prefix} ({' or '.join(names)})" for prefix, names in known.items())
            raise JobgenError(f"extra_directives: '{line}' is no scheduler's directive; accepted prefixes: {accepted}")


def directive_prefixes() -> dict[str, list[str]]:
    """Directive prefix -> the schedulers that read it, every scheduler loaded: for the rare
    extra directive that is not the chosen scheduler's."""
    prefixes: dict[str, list[str]] = {}
    for name in scheduler_names():
        scheduler = get_scheduler(name)
        if scheduler.directive_prefix:
            prefixes.setdefault(scheduler.directive_prefix, []).append(name)
    return prefixes
