"""One module per scheduler; add a scheduler by adding a short module and a template."""

from __future__ import annotations

import importlib

from jobgen.errors import JobgenError
from jobgen.schedulers.base import Scheduler

# Imported on first use: a render for one scheduler loads only that module (cold start counts).
SCHEDULERS: dict[str, str] = {
    "slurm": "jobgen.schedulers.slurm:Slurm",
    "pbs": "jobgen.schedulers.pbs:PbsPro",
    "torque": "jobgen.schedulers.torque:Torque",
    "local": "jobgen.schedulers.local:Local",
}


def get_scheduler(name: str) -> Scheduler:
    try:
        module, _, cls = SCHEDULERS[name].partition(":")
    except KeyError:
        raise JobgenError(f"unknown scheduler '{name}'; accepted: {', '.join(SCHEDULERS)}") from None
    return getattr(importlib.import_module(module), cls)()
