"""The `jobgen` command. Imports nothing heavy at start-up: no torch on a login node."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from jobgen.cli_templates import template_dir_option, templates
from jobgen.errors import JobgenError
from jobgen.plot_cli import plot
from jobgen.sites_cli import sites
from jobgen.startup import skip_startup_costs


class SchedulerName(click.ParamType):
    """--scheduler: a bundled scheduler or an installed plug-in's. Installed plug-ins are looked
    up only for a name that is not bundled, or for --help: a render does not pay for the scan."""

    name = "scheduler"

    def convert(self, value, param, ctx):
        from jobgen.schedulers import BUNDLED, scheduler_names

        if value in BUNDLED:
            return value
        names = scheduler_names()
        if value not in names:
            self.fail(f"{value!r} is not one of {', '.join(map(repr, names))} (installed plug-ins included)", param, ctx)
        return value

    def get_metavar(self, param, ctx=None) -> str:
        from jobgen.schedulers import scheduler_names

        return f"[{'|'.join(scheduler_names())}]"

    def shell_complete(self, ctx, param, incomplete):
        from click.shell_completion import CompletionItem

        from jobgen.schedulers import scheduler_names

        return [CompletionItem(name) for name in scheduler_names() if name.startswith(incomplete)]


class JobgenGroup(click.Group):
    """Turns a JobgenError anywhere below into one line on stderr and exit status 2."""

    def invoke(self, ctx: click.Context):
        skip_startup_costs()
        try:
            return super().invoke(ctx)
        except JobgenError as error:
            for line in str(error).splitlines():
                click.echo(f"jobgen: error: {line}", err=True)
            sys.exit(2)


config_argument = click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
site_option = click.option(
    "--site", metavar="NAME", help="Site profile: a name on the site path, or a .yaml file; the default is `site:` in "
    "$XDG_CONFIG_HOME/jobgen/config.yaml, and `--site none` uses none (see `jobgen sites list`)."
)
set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override one field, e.g. --set resources.nodes=4 (repeatable)."
)
scheduler_option = click.option(
    "--scheduler", "-s", type=SchedulerName(), help="Which scheduler the script is for; the site profile's by default."
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
    from jobgen.sites import chosen_site

    resolved = resolve_job(config, chosen_site(site), overrides)
    for warning in resolved.warnings:
        click.echo(f"jobgen: warning: {warning}", err=True)
    return resolved


def _scheduler(option: Optional[str], resolved) -> str:
    """--scheduler, else the site profile's."""
    chosen = option or resolved.site.scheduler
    if chosen:
        return chosen
    from jobgen.schedulers import scheduler_names
    from jobgen.sites import user_config_file

    raise JobgenError(
        f"no scheduler: give --scheduler ({'|'.join(scheduler_names())}), or a site profile that sets "
        f"'scheduler:' (--site NAME, or `site: NAME` in {user_config_file()})"
    )


def _check_files(job) -> None:
    """validate and submit, not render: a script may be rendered for a machine this is not."""
    from jobgen.preflight import check_job_files

    for warning in check_job_files(job):
        click.echo(f"jobgen: warning: {warning}", err=True)


@main.command()
@config_argument
@scheduler_option
@site_option
@set_option
@template_dir_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the script here (mode 0644) instead of printing it.")
def render(config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...], output: Optional[Path]) -> None:
    """Print the batch script for CONFIG: review it, then submit it with sbatch or qsub."""
    from jobgen.render import render as render_script
    from jobgen.schedulers import get_scheduler

    resolved = _resolve(config, site, overrides)
    scheduler = _scheduler(scheduler, resolved)
    for warning in get_scheduler(scheduler).warnings(resolved.job):
        click.echo(f"jobgen: warning: {warning}", err=True)
    script = render_script(resolved, scheduler, template_dirs)
    if output is None:
        click.echo(script, nl=False)
        return
    from jobgen.files import write_atomic

    write_atomic(output, script)
    click.echo(f"jobgen: wrote {output}", err=True)


@main.command()
@config_argument
@site_option
@set_option
@template_dir_option
def validate(config: Path, site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...]) -> None:
    """Check CONFIG, the files it names and the template overrides, and show the derived values (world size, global batch)."""
    resolved = _resolve(config, site, overrides)
    job = resolved.job
    _check_files(job)
    from jobgen.template_search import check_override_templates

    check_override_templates(template_dirs, resolved.site.template_dir)
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


@main.command()
@config_argument
@scheduler_option
@site_option
@set_option
@template_dir_option
@click.option("--dry-run", is_flag=True, help="Print exactly what would be submitted; submit nothing, write nothing.")
def submit(config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...], dry_run: bool) -> None:
    """Submit CONFIG and print its job id.

    \b
    Makes the run directory (the job's run_dir, runs/NAME by default) holding the resolved job,
    the exact script and submission text, and a record of every submission. On Slurm the job
    goes through submitit; on PBS and Torque through qsub; `--scheduler local` runs it here, in
    the foreground, with each node a local process. First, as `validate` does, checks the files
    the job names where this machine can see them.
    """
    from jobgen import submit as submission

    resolved = _resolve(config, site, overrides)
    scheduler = _scheduler(scheduler, resolved)
    _check_files(resolved.job)
    if dry_run:
        planned = submission.plan(resolved, scheduler, template_dirs)
        click.echo(f"# run directory: {planned.run.path}", err=True)
        click.echo(f"# ---- {planned.script_path} ----", err=True)
        click.echo(planned.script, nl=False)
        return
    from jobgen.schedulers import get_scheduler

    job_id, planned = submission.submit(resolved, scheduler, template_dirs)
    foreground = get_scheduler(scheduler).runs_in_foreground
    done = f"ran {scheduler} job" if foreground else "submitted job"
    click.echo(f"jobgen: {done} {job_id}; run directory {planned.run.path}", err=True)
    click.echo(job_id)
    if foreground:  # the job has ended: its outcome is the command's
        from jobgen.status import foreground_exit_status

        sys.exit(foreground_exit_status(planned.run))


target_argument = click.argument("target", metavar="RUN_DIR|JOB_ID", default=".")


@main.command()
@target_argument
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def status(target: str, as_json: bool) -> None:
    """Where the job stands: the scheduler's state now, every segment so far, and the goodput."""
    from jobgen.status import collect, format_table

    report = collect(target)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


@main.command()
@target_argument
def cancel(target: str) -> None:
    """Cancel the job's latest submission (scancel or qdel)."""
    from jobgen.rundir import find_run
    from jobgen.schedulers import get_scheduler

    latest = find_run(target).latest()
    get_scheduler(latest["scheduler"]).cancel(latest["job_id"])
    click.echo(f"jobgen: cancelled job {latest['job_id']}", err=True)


@main.command()
@target_argument
@click.option("--node", type=int, metavar="K", help="The log of node K (0 is the master) instead of the batch log.")
@click.option("--rank", type=int, metavar="R", help="Everything rank R printed (the node logs show rank 0's only).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, with the training's progress, until the job ends.")
def logs(target: str, node: Optional[int], rank: Optional[int], follow: bool) -> None:
    """Print the job's batch log, or one node's or one rank's log.

    \b
    All are in RUN_DIR/logs, written as the job runs on every scheduler and launcher:
    JOBID.out (the batch script), JOBID-nodeK.out (torchrun and rank 0), JOBID-rankR.out.
    """
    from jobgen.status import log_path

    if node is not None and rank is not None:
        raise JobgenError("give --node or --rank, not both")
    if follow:  # with the trainer's progress: one updating line on a terminal (jobgen.progress)
        from jobgen.progress import follow_log

        return follow_log(target, node, rank, sys.stdout)
    path = log_path(target, node, rank)
    try:
        click.echo(path.read_text(errors="replace"), nl=False)
    except FileNotFoundError:
        raise JobgenError(f"no log yet at {path}: the job may still be pending") from None


main.add_command(sites)
main.add_command(plot)

main.add_command(templates)

if __name__ == "__main__":
    main()
