"""What the `jobgen` commands share: the options for a job file, and turning one into a resolved job.

Imports only click at start-up; everything else when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError


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


# A folder is refused by the reader, in one line naming the YAML files it holds, not by Click's usage text.
config_argument = click.argument("config", type=click.Path(path_type=Path))
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
checked_scheduler_option = click.option(  # validate's: optional even without a site profile's
    "--scheduler", "-s", type=SchedulerName(),
    help="Also run the checks render runs for this scheduler (launcher, container, extra directives); "
    "the site profile's by default, none without one.",
)


template_dir_option = click.option(
    "--template-dir",
    "template_dirs",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="DIR",
    help="A folder of templates looked up first, before $JOBGEN_TEMPLATE_PATH and the site's (repeatable).",
)


def load_job(config: Path, site: Optional[str], overrides: tuple[str, ...], echo_warnings: bool = True,
             scheduler: Optional[str] = None):
    """The job resolved once (jobgen.api.Job): every layer applied, checked against its site
    profile (the profile's scheduler exists, the job keeps within its partition's or queue's
    limits and the site's policy); resolving's warnings printed. A job refused for its node range
    (the batch split over it, the limits) that the scheduler (`scheduler`, --scheduler, else the site
    profile's) cannot run as a range at all is refused for that instead."""
    from jobgen.api import Job

    try:
        job = Job.load(config, site=site, overrides=overrides)
    except JobgenError:
        refuse_a_range_first(config, site, overrides, scheduler)
        raise
    if echo_warnings:
        echo_warnings_of(job.warnings)
    return job


def refuse_a_range_first(config: Path, site: Optional[str], overrides: tuple[str, ...], scheduler: Optional[str]) -> None:
    """resources.nodes MIN-MAX for a scheduler without ranges, refused before the job's own checks
    (the batch split over the range, the limits): fixing those first would be for nothing."""
    from jobgen.job.layers import layered_job
    from jobgen.job.models import node_counts
    from jobgen.job.sites import chosen_site
    from jobgen.schedulers import get_scheduler

    layered, site_profile = layered_job(config, chosen_site(site), overrides)
    resources = layered.get("resources")
    nodes = resources.get("nodes") if isinstance(resources, dict) else None
    name = scheduler or site_profile.scheduler
    counts = node_counts(nodes)
    if name and counts and counts[0] != counts[1]:
        get_scheduler(name).refuse_a_range(f"{counts[0]}-{counts[1]}")


def resolve(config: Path, site: Optional[str], overrides: tuple[str, ...], echo_warnings: bool = True):
    """load_job's resolution as the rendering and submission code take it (a ResolvedJob)."""
    return load_job(config, site, overrides, echo_warnings).resolved


def echo_warnings_of(warnings: list[str]) -> None:
    for warning in warnings:
        click.echo(f"jobgen: warning: {warning}", err=True)


sweep_options = [
    click.option(
        "--sweep", "sweeps", multiple=True, metavar="KEY=V1,V2,...",
        help="Submit one run per value, e.g. --sweep training.learning_rate=1e-4,2e-4; several --sweep "
        "make every combination (a grid), each point in RUN_DIR/POINT (e.g. runs/NAME/learning_rate=1e-4,r=8). "
        "On Slurm the points are one job array.",
    ),
    click.option(
        "--sweep-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.yaml",
        help="A sweep's grid and listed points, e.g. `grid: {training.lora.r: [8, 16]}` and "
        "`points: [{training.learning_rate: 1.0e-4, training.warmup_steps: 10}]`; with --sweep, one grid.",
    ),
    click.option(
        "--max-running", type=click.IntRange(min=1), metavar="N",
        help="At most N points of the sweep run at once (Slurm's --array=0-K%N), e.g. --max-running 2; "
        "a sweep file's max_running by default.",
    ),
]


def with_sweep_options(command):
    for option in reversed(sweep_options):
        command = option(command)
    return command


def resolve_sweep(config: Path, site: Optional[str], overrides: tuple[str, ...], base, sweeps: tuple[str, ...],
                  sweep_file: Optional[Path], max_running: Optional[int]):
    """The sweep (None without --sweep or --sweep-file) and each point's job, checked as
    `resolve` checks one job; a point's mistake names the point."""
    from jobgen.job.layers import layered_job
    from jobgen.job.sites import check_limits, chosen_site
    from jobgen.job.sweep import CONTAINER_SEPARATOR, make_sweep, point_jobs

    separator = CONTAINER_SEPARATOR if base.job.container.image else ","
    sweep = make_sweep(sweeps, sweep_file, max_running, separator)
    if sweep is None:
        return None, []
    layered, site_profile = layered_job(config, chosen_site(site), overrides)
    points = point_jobs(layered, site_profile, sweep, base.job.effective_run_dir, str(config))
    word = "partition"
    if base.site.scheduler:
        from jobgen.schedulers import get_scheduler

        word = get_scheduler(base.site.scheduler).partition_word
    for point, resolved in zip(sweep.points, points):
        check_limits(resolved.job, resolved.site, f"{config}, sweep point {point.name}", word)
    return sweep, points


def scheduler_for(option: Optional[str], resolved) -> str:
    """--scheduler, else the site profile's."""
    chosen = option or resolved.site.scheduler
    if chosen:
        return chosen
    from jobgen.schedulers import scheduler_names
    from jobgen.job.sites import user_config_file

    raise JobgenError(
        f"no scheduler: give --scheduler ({'|'.join(scheduler_names())}), or a site profile that sets "
        f"'scheduler:' (--site NAME, or `site: NAME` in {user_config_file()})"
    )


def check_files(job) -> None:
    """validate and submit, not render: a script may be rendered for a machine this is not."""
    from jobgen.api import files_warnings

    echo_warnings_of(files_warnings(job))
