"""This machine as N simulated nodes: the same per-node script, each node a local process."""

from __future__ import annotations

from jobgen.schedulers.base import Scheduler


class Local(Scheduler):
    name = "local"
    template = "local.sh.j2"
    launchers = ("local",)
