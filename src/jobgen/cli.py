"""The `jobgen` command. Imports nothing heavy at start-up: no torch on a login node."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError

SCHEDULER_CHOICES = ["slurm", "pbs", "torque", "local"]


class JobgenGroup(click.Group):
    """Turns a JobgenError anywhere below into one line on stderr and exit status 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except JobgenError as error:
            for line in str(error).splitlines():
                click.echo(f"jobgen: error: {line}", err=True)
            sys.exit(2)


config_argument = click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
site_option = click.option("--site", metavar="NAME", help="Site profile: a name on the site path, or a .yaml file.")
set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override one field, e.g. --set resources.nodes=4 (repeatable)."
)
scheduler_option = click.option(
    "--scheduler", "-s", type=click.Choice(SCHEDULER_CHOICES), required=True, help="Which scheduler the script is for."
)


@click.group(cls=JobgenGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="jobgen")
def main() -> None:
    """Render, submit and follow multi-node fine-tuning jobs on Slurm, PBS Pro and Torque.

    \b
    Layers, lowest first: bundled defaults < site profile (--site) < job file < --set.
    Start with:  jobgen render --scheduler slurm configs/examples/llama-lora-2node.yaml
    """


def _resolve(config: Path, site: Optional[str], overrides: tuple[str, ...]):
    from jobgen.config import resolve_job

    resolved = resolve_job(config, site, overrides)
    for warning in resolved.warnings:
        click.echo(f"jobgen: warning: {warning}", err=True)
    return resolved


@main.command()
@config_argument
@scheduler_option
@site_option
@set_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the script here (mode 0644) instead of printing it.")
def render(config: Path, scheduler: str, site: Optional[str], overrides: tuple[str, ...], output: Optional[Path]) -> None:
    """Print the batch script for CONFIG: review it, then submit it with sbatch or qsub."""
    from jobgen.render import render as render_script
    from jobgen.schedulers import get_scheduler

    resolved = _resolve(config, site, overrides)
    for warning in get_scheduler(scheduler).warnings(resolved.job):
        click.echo(f"jobgen: warning: {warning}", err=True)
    script = render_script(resolved, scheduler)
    if output is None:
        click.echo(script, nl=False)
        return
    write_script(output, script)
    click.echo(f"jobgen: wrote {output}", err=True)


def write_script(path: Path, text: str) -> None:
    """Write atomically with mode 0644: never group- or world-writable on a shared system."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None


@main.command()
@config_argument
@site_option
@set_option
def validate(config: Path, site: Optional[str], overrides: tuple[str, ...]) -> None:
    """Check CONFIG and show the derived values (world size, global batch)."""
    job = _resolve(config, site, overrides).job
    click.echo(
        f"{config}: ok: {job.resources.nodes} node(s) x {job.procs_per_node} process(es) = world size "
        f"{job.world_size} ({job.backend}); global batch {job.global_batch}; {job.training.method}, "
        f"ZeRO-{job.training.zero_stage}, {job.training.precision}"
    )


@main.command()
def schema() -> None:
    """Print the JSON Schema of the job file, for editors and linters."""
    from jobgen.models import Job

    click.echo(json.dumps(Job.model_json_schema(), indent=2))


if __name__ == "__main__":
    main()
