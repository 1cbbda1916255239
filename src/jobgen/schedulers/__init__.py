"""One module per scheduler; add a scheduler by adding a short module and a template."""

from __future__ import annotations

from jobgen.errors import JobgenError
from jobgen.schedulers.base import Scheduler
from jobgen.schedulers.local import Local
from jobgen.schedulers.pbs import PbsPro
from jobgen.schedulers.slurm import Slurm
from jobgen.schedulers.torque import Torque

SCHEDULERS: dict[str, type[Scheduler]] = {"slurm": Slurm, "pbs": PbsPro, "torque": Torque, "local": Local}


def get_scheduler(name: str) -> Scheduler:
    try:
        return SCHEDULERS[name]()
    except KeyError:
        raise JobgenError(f"unknown scheduler '{name}'; accepted: {', '.join(SCHEDULERS)}") from None
