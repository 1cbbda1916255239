"""`jobgen render|validate|submit|schema`: a job file in, a script or a submission out."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError
from jobgen.cli.options import (
    check_files,
    checked_scheduler_option,
    config_argument,
    echo_warnings_of,
    load_job,
    resolve_sweep,
    scheduler_for,
    scheduler_option,
    set_option,
    site_option,
    template_dir_option,
    with_sweep_options,
)


@click.command()
@config_argument
@scheduler_option
@site_option
@set_option
@template_dir_option
@with_sweep_options
@click.option("-o", "--output", type=click.Path(path_type=Path), help="Write the script here instead of printing it: a file is replaced whole (mode 0644), a device or FIFO written to, a symlink's target written.")
def render(
    config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...],
    sweeps: tuple[str, ...], sweep_file: Optional[Path], max_running: Optional[int], output: Optional[Path],
) -> None:
    """Print the batch script for CONFIG: review it, then submit it with sbatch or qsub.

    With --sweep or --sweep-file, a sweep's job array script (Slurm), e.g.
    jobgen render -s slurm job.yaml --sweep training.lora.r=8,16 -o sweep.sbatch; it makes each
    point's run directory itself. `jobgen submit --sweep` also records the sweep for `jobgen status`.
    """
    from jobgen.script.render import render_array
    from jobgen.schedulers import get_scheduler

    job = load_job(config, site, overrides, scheduler=scheduler)
    resolved = job.resolved
    scheduler = scheduler_for(scheduler, resolved)
    sweep, points = resolve_sweep(config, site, overrides, resolved, sweeps, sweep_file, max_running)
    chosen = get_scheduler(scheduler)
    if sweep is not None and not chosen.job_arrays:
        raise JobgenError(
            f"{scheduler} runs a sweep as one job per point, not one script: render a point with --set "
            f"(e.g. --set {sweep.keys[0]}=...), or submit the sweep with jobgen submit --sweep"
        )
    echo_warnings_of(job.render_warnings(scheduler))
    if sweep is not None:
        script = render_array(points, sweep.max_running, scheduler, template_dirs)
    else:
        script = job.render(scheduler, template_dirs=template_dirs)
    if output is None:
        click.echo(script, nl=False)
        return
    from jobgen.files import write_output

    write_output(output, script)
    click.echo(f"jobgen: wrote {output}", err=True)


@click.command()
@config_argument
@checked_scheduler_option
@site_option
@set_option
@template_dir_option
@with_sweep_options
def validate(
    config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...],
    sweeps: tuple[str, ...], sweep_file: Optional[Path], max_running: Optional[int],
) -> None:
    """Check CONFIG, the files it names and the template overrides, and show the derived values (world size, global batch).

    With a scheduler (--scheduler, or the site profile's), also run the checks render runs
    before its templates: the launcher, the container and the extra directives. With --sweep or
    --sweep-file, check every point's job too, e.g. jobgen validate job.yaml --sweep training.lora.r=8,16.
    """
    job = load_job(config, site, overrides, scheduler=scheduler)
    resolved = job.resolved
    echo_warnings_of(job.check_files())
    sweep, points = resolve_sweep(config, site, overrides, resolved, sweeps, sweep_file, max_running)
    _check_point_files(resolved, points)
    scheduler = scheduler or resolved.site.scheduler
    if scheduler:
        warnings = job.check_scheduler(scheduler)
        if sweep is not None:
            from jobgen.schedulers import get_scheduler

            chosen = get_scheduler(scheduler)
            if chosen.job_arrays:
                from jobgen.script.checks import check_array_points, check_for_scheduler

                check_for_scheduler(points[0].job, chosen, (len(points), sweep.max_running))
                check_array_points([point.job for point in points], chosen)
        echo_warnings_of(warnings)
    job.check_templates(template_dirs)
    checked = f"checked for {scheduler}" if scheduler else "not checked against a scheduler (give --scheduler)"
    click.echo(f"{config}: ok: {job.describe()}; {checked}")
    click.echo(job.describe_requeue())
    if sweep is not None:
        click.echo(f"sweep: {len(points)} points ok: {', '.join(point.name for point in sweep.points)}")


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
@with_sweep_options
@click.option("--dry-run", is_flag=True, help="Print exactly what would be submitted; submit nothing, write nothing.")
@click.option("--resume-from", "resume_from", metavar="CHECKPOINT",
              help="Resume the run from this checkpoint of its own (step-000300, or 300) rather than its newest: "
                   "the later checkpoints are moved to OUTPUT_DIR/checkpoints-set-aside/, never resumed from.")
def submit(
    config: Path, scheduler: Optional[str], site: Optional[str], overrides: tuple[str, ...], template_dirs: tuple[Path, ...],
    sweeps: tuple[str, ...], sweep_file: Optional[Path], max_running: Optional[int], dry_run: bool,
    resume_from: Optional[str] = None,
) -> None:
    """Submit CONFIG and print its job id.

    \b
    Makes the run directory (the job's run_dir, runs/NAME by default) holding the resolved job,
    the exact script and submission text, and a record of every submission. On Slurm the job
    goes through submitit; on PBS and Torque through qsub; `--scheduler local` runs it here, in
    the foreground, with each node a local process. First, as `validate` does, checks the files
    the job names where this machine can see them.

    \b
    A sweep (--sweep, --sweep-file) submits one run per point into RUN_DIR/POINT, e.g.
      jobgen submit job.yaml --sweep training.learning_rate=1e-4,2e-4 --sweep training.lora.r=8,16 --max-running 2
    prints one job id per point: on Slurm one job array (task K is point K, job id ARRAYID_K),
    on PBS and Torque one job per point, locally one point after another. `jobgen status RUN_DIR`
    then shows every point; `jobgen status|logs|cancel RUN_DIR/POINT` one.
    """
    job = load_job(config, site, overrides, scheduler=scheduler)
    resolved = job.resolved
    scheduler = scheduler_for(scheduler, resolved)
    echo_warnings_of(job.check_files())
    sweep, points = resolve_sweep(config, site, overrides, resolved, sweeps, sweep_file, max_running)
    _check_point_files(resolved, points)
    if sweep is not None:
        if resume_from:
            raise click.UsageError("--resume-from resumes one run; give it a point's own job, not --sweep")
        return _submit_sweep(resolved, points, sweep, scheduler, template_dirs, dry_run)
    resuming = _set_aside_after(resolved, resume_from, dry_run) if resume_from else None
    if dry_run:
        planned = job.plan(scheduler, template_dirs=template_dirs)
        click.echo(f"# run directory: {planned.run.path}", err=True)
        click.echo(f"# ---- {planned.script_path} ----", err=True)
        click.echo(planned.script, nl=False)
        if resuming:  # said again under the script, where the terminal leaves the reader
            click.echo(f"jobgen: dry run, nothing moved or submitted: {resuming.removeprefix('jobgen: ')}", err=True)
        return
    from jobgen.schedulers import get_scheduler

    run = job.submit(scheduler, template_dirs=template_dirs, check_files=False)  # checked above
    foreground = get_scheduler(scheduler).runs_in_foreground
    done = f"ran {scheduler} job" if foreground else "submitted job"
    click.echo(f"jobgen: {done} {run.job_id}; run directory {run.run_dir}", err=True)
    click.echo(run.job_id)
    if foreground:  # the job has ended: its outcome is the command's
        from jobgen.rundir.run import RunDir
        from jobgen.rundir.status import foreground_exit_status, node_said

        said = node_said(RunDir(run.run_dir), run.job_id)
        if said:  # a node that ended before its program started said why in its own log only
            click.echo(f"jobgen: {said}", err=True)
        sys.exit(foreground_exit_status(RunDir(run.run_dir)))


def _set_aside_after(resolved, choice: str, dry_run: bool) -> str:
    """--resume-from: the checkpoints after the chosen one out of the trainer's sight (jobgen.rundir.rewind),
    once no job of the run is queued or running. The line it printed."""
    from jobgen.rundir import rewind, submission
    from jobgen.rundir.metrics import output_dir

    run = submission.run_dir_for(resolved)
    submission.refuse_if_active(run)
    if resolved.job.training is None:
        return _set_aside_own_after(resolved, run.path, choice, dry_run)
    output = output_dir(run.path, {"training": {"output_dir": resolved.job.training.output_dir}})
    step = rewind.chosen_step(output, choice)
    moved = rewind.set_aside_after(output, step, dry_run)
    where = f"moved to {moved[0].parent}" if moved and not dry_run else "would be set aside" if moved else "none to set aside"
    said = f"jobgen: resuming from step-{step:06d}; later checkpoints ({', '.join(p.name for p in moved) or 'none'}): {where}"
    click.echo(said, err=True)
    return said


def _set_aside_own_after(resolved, run_dir: Path, choice: str, dry_run: bool) -> str:
    """--resume-from for the job's own program: its checkpoints are what launch.checkpoints matches
    under the working directory, and the batch script resumes from the newest complete one, so the
    later ones are moved out of the pattern's reach."""
    from jobgen.job.preflight import working_directory
    from jobgen.rundir import rewind

    launch = resolved.job.launch
    workdir = Path(working_directory(resolved.job))
    step = rewind.own_chosen_step(workdir, launch.checkpoints, launch.checkpoint_complete_file, choice, run_dir)
    moved = rewind.set_aside_own_after(workdir, launch.checkpoints, step, dry_run)
    where = f"moved to {moved[0].parent}" if moved and not dry_run else "would be set aside" if moved else "none to set aside"
    said = (f"jobgen: resuming from step {step} (launch.checkpoints); later checkpoints "
            f"({', '.join(p.name for p in moved) or 'none'}): {where}")
    click.echo(said, err=True)
    return said


def _check_point_files(base, points) -> None:
    """The files of points that sweep them (training.data, training.model and its revision), once per new set."""
    def files(training) -> tuple:
        if training is None:  # a program of the job's own: no files of jobgen's
            return ()
        data = training.data if isinstance(training.data, str) else tuple(training.data)
        return data, training.model, training.model_revision, training.data_format

    checked = {files(base.job.training)}
    for resolved in points:
        if files(resolved.job.training) not in checked:
            checked.add(files(resolved.job.training))
            check_files(resolved.job)


def _submit_sweep(resolved, points, sweep, scheduler: str, template_dirs: tuple[Path, ...], dry_run: bool) -> None:
    from jobgen.rundir import sweep as sweeps
    from jobgen.schedulers import get_scheduler

    planned = sweeps.plan(resolved, points, sweep, scheduler, template_dirs)
    if dry_run:
        click.echo(f"# sweep folder: {planned.path} ({len(planned.points)} points)", err=True)
        for point, _, run in planned.points:
            click.echo(f"# point {point.index}: {point.describe()} -> {run.path}", err=True)
        for path, script in planned.scripts(scheduler, template_dirs):
            click.echo(f"# ---- {path} ----", err=True)
            click.echo(script, nl=False)
        return
    submitted = sweeps.submit(planned, scheduler, template_dirs)
    foreground = get_scheduler(scheduler).runs_in_foreground
    how = f"job array {submitted[0][1].rsplit('_', 1)[0]}" if planned.array_script is not None else f"{len(submitted)} jobs"
    click.echo(f"jobgen: {'ran' if foreground else 'submitted'} a sweep of {len(submitted)} points as {how}; "
               f"`jobgen status {planned.path}` shows them", err=True)
    for point, job_id in submitted:
        click.echo(f"{job_id}\t{point.name}")
    if foreground:
        from jobgen.rundir.status import foreground_exit_status

        sys.exit(max(foreground_exit_status(run) for _, _, run in planned.points))
