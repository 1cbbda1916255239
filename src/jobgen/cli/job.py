"""`jobgen render|validate|submit|schema`: a job file in, a script or a submission out."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from jobgen.cli.options import (
    check_files,
    checked_scheduler_option,
    config_argument,
    resolve,
    scheduler_for,
    scheduler_option,
    set_option,
    site_option,
    template_dir_option,
)


@click.command()
@config_argument
@scheduler_option
@site_option
@set_option
@template_dir_option
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the script here (mode 0644) instead of printing it.")
def render(config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...], output: Optional[Path]) -> None:
    """Print the batch script for CONFIG: review it, then submit it with sbatch or qsub."""
    from jobgen.script.render import render as render_script
    from jobgen.schedulers import get_scheduler

    resolved = resolve(config, site, overrides)
    scheduler = scheduler_for(scheduler, resolved)
    for warning in get_scheduler(scheduler).warnings(resolved.job):
        click.echo(f"jobgen: warning: {warning}", err=True)
    script = render_script(resolved, scheduler, template_dirs)
    if output is None:
        click.echo(script, nl=False)
        return
    from jobgen.files import write_atomic

    write_atomic(output, script)
    click.echo(f"jobgen: wrote {output}", err=True)


@click.command()
@config_argument
@checked_scheduler_option
@site_option
@set_option
@template_dir_option
def validate(config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...]) -> None:
    """Check CONFIG, the files it names and the template overrides, and show the derived values (world size, global batch).

    With a scheduler (--scheduler, or the site profile's), also run the checks render runs
    before its templates: the launcher, the container and the extra directives.
    """
    resolved = resolve(config, site, overrides)
    job = resolved.job
    check_files(job)
    scheduler = scheduler or resolved.site.scheduler
    if scheduler:
        from jobgen.schedulers import get_scheduler
        from jobgen.script.checks import check_for_scheduler

        chosen = get_scheduler(scheduler)
        check_for_scheduler(job, chosen)
        for warning in chosen.warnings(job):
            click.echo(f"jobgen: warning: {warning}", err=True)
    from jobgen.script.template_search import override_folders

    folders = override_folders(template_dirs, resolved.site.template_dir)
    if folders:  # Jinja is imported only with overrides to check
        from jobgen.script.render import check_templates

        check_templates(folders)
    checked = f"checked for {scheduler}" if scheduler else "not checked against a scheduler (give --scheduler)"
    click.echo(
        f"{config}: ok: {job.resources.nodes} node(s) x {job.procs_per_node} process(es) = world size "
        f"{'-'.join(str(w) for w in sorted({min(job.world_sizes), max(job.world_sizes)}))} ({job.backend}); "
        f"global batch {job.global_batch}; {planned_steps(job)}; {job.training.method}, "
        f"ZeRO-{job.training.zero_stage}, {job.training.precision}; {checked}"
    )


def planned_steps(job) -> str:
    """The run's optimizer steps (and warmup), as the trainer will count them: `3 epochs x 40 steps
    = 120 steps, warmup 4`. Packed rows are only known once tokenized."""
    import math
    import os

    from jobgen.job.conversations import check_conversations
    from jobgen.job.preflight import CHECK_WHOLE_BYTES, working_directory

    t = job.training
    if t.max_steps is not None:
        total, how = t.max_steps, f"{t.max_steps} steps (max_steps)"
    else:
        path = os.path.join(working_directory(job), t.data)
        if t.packing or not os.path.isfile(path) or os.path.getsize(path) > CHECK_WHOLE_BYTES:
            return f"{t.epochs} epoch(s) (steps known once the data is tokenized)"
        per_epoch = math.ceil(check_conversations(path, t.data_format).good / job.global_batch)
        total, how = per_epoch * t.epochs, f"{t.epochs} epoch(s) x {per_epoch} steps = {per_epoch * t.epochs} steps"
    warmup = t.warmup_of(total)
    return how + (f", warmup {warmup}" if warmup else "")


@click.command()
def schema() -> None:
    """Print the JSON Schema of the job file, for editors and linters."""
    from jobgen.job.models import Job

    click.echo(json.dumps(Job.model_json_schema(), indent=2))


@click.command()
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
    from jobgen.rundir import submission

    resolved = resolve(config, site, overrides)
    scheduler = scheduler_for(scheduler, resolved)
    check_files(resolved.job)
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
        from jobgen.rundir.status import foreground_exit_status

        sys.exit(foreground_exit_status(planned.run))
