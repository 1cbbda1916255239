"""`jobgen runs|status|logs|cancel|plot`: runs read back from their run directories and the scheduler."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError

target_argument = click.argument("target", metavar="RUN_DIR|JOB_ID|SWEEP", default=".")


def _sweep_folder(target: str) -> Optional[str]:
    """The sweep's folder when `target` is one, or its job array's id (Slurm); else None."""
    from jobgen.rundir.sweep import find_sweep

    return find_sweep(target)


@click.command()
@click.argument("pattern", required=False)
@click.option("--state", "states", multiple=True, metavar="STATE",
              help="Only runs in this state (completed, failed, running, pending, preempted, gone, ...); repeat for several.")
@click.option("-n", "--limit", type=click.IntRange(min=1), metavar="N", help="The newest N runs only.")
@click.option("--prune", is_flag=True,
              help="Remove the index's entries of run directories that are gone; run directories are never touched.")
@click.option("--yes", is_flag=True, help="With --prune: do not ask (without a terminal, --prune needs it).")
@click.option("--json", "as_json", is_flag=True, help="One JSON array, for scripts.")
def runs(pattern: Optional[str], states: tuple[str, ...], limit: Optional[int], prune: bool, yes: bool, as_json: bool) -> None:
    """Every run you submitted, newest first: name, state, when submitted, step, last loss, run directory
    (also: jobgen list). PATTERN, a glob, keeps the runs whose name matches, e.g. jobgen runs 'llama*' --state failed.

    \b
    The name shown is one `jobgen status|logs|cancel|plot NAME` takes (the run directory where two share it).
    Each `jobgen submit` is recorded in $XDG_STATE_HOME/jobgen/index.jsonl (~/.local/state/jobgen);
    a run directory removed since is shown as gone, and `jobgen runs --prune` drops it from that record.
    """
    from jobgen.rundir.index import format_table, runs as find_runs

    if prune:
        if pattern or states or limit or as_json:
            raise JobgenError("--prune takes no PATTERN, --state, --limit or --json: it removes every gone run's entry")
        return _prune(yes)
    found = find_runs(pattern, states, limit)
    click.echo(json.dumps(found, indent=2) if as_json else format_table(found, filtered=bool(pattern or states)))


def _prune(yes: bool) -> None:
    from jobgen.rundir.index import gone_run_dirs, prune
    from jobgen.rundir.run import index_path

    gone = gone_run_dirs()
    if not gone:
        click.echo(f"jobgen: every run directory in {index_path()} is there: nothing to prune", err=True)
        return
    for run_dir in gone:
        click.echo(f"gone: {run_dir}", err=True)
    # A run directory on a file system that is not mounted here now looks gone too: hence the question.
    if not yes:
        if not sys.stdin.isatty():
            raise JobgenError(f"{len(gone)} run director{'y is' if len(gone) == 1 else 'ies are'} gone: "
                              "give --yes to remove their entries from the index without asking")
        click.confirm(f"Remove these {len(gone)} entries from {index_path()} (the run directories are not touched)?",
                      abort=True, err=True)
    removed = prune(gone)
    click.echo(f"jobgen: removed {len(gone)} gone run director{'y' if len(gone) == 1 else 'ies'} ({removed} line(s)) "
               f"from {index_path()}", err=True)


@click.command()
@target_argument
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
def status(target: str, as_json: bool) -> None:
    """Where the job stands: the scheduler's state now, every segment so far (why one failed), the
    last loss, the final model or adapter, and the goodput (a probe: its result).

    \b
    A sweep's folder (jobgen submit --sweep) or its job array's id gives a table of its points: values, job, state,
    step, last loss, goodput, e.g. jobgen status runs/NAME; a point's folder, that point alone.
    """
    if sweep := _sweep_folder(target):
        from jobgen.rundir.sweep import collect as collect_sweep, format_table as sweep_table

        report = collect_sweep(sweep)
        click.echo(json.dumps(report, indent=2) if as_json else sweep_table(report))
        return
    from jobgen.rundir.status import collect, format_table

    report = collect(target)
    click.echo(json.dumps(report, indent=2) if as_json else format_table(report))


@click.command()
@target_argument
def cancel(target: str) -> None:
    """Cancel the job TARGET names (scancel, qdel; a local job is asked as Ctrl-C asks it: every
    rank checkpoints, then stops). A job id cancels that job; a run directory its latest submission.

    A sweep's folder (or its job array's id) cancels every point still queued or running (on Slurm
    each task of the array, ARRAYID_K), e.g. jobgen cancel runs/NAME; a point's folder or
    ARRAYID_K, that point alone. A job that has already ended is said so, and is no error (exit 0).
    """
    from jobgen.rundir.run import find_target

    if sweep := _sweep_folder(target):
        return _cancel_sweep(sweep)
    run, named = find_target(target)
    latest = run.latest()
    entry = next(s for s in reversed(run.submissions()) if s.get("job_id") == named) if named else latest
    if _cancel_if_active(entry):
        click.echo(f"jobgen: cancelled job {entry['job_id']}", err=True)
        return
    # A requeued run goes on under a new job id (PBS, Torque): the earlier one is over.
    later = f"; the run went on as job {latest['job_id']} (jobgen cancel {run.path})" if latest is not entry else ""
    click.echo(f"jobgen: job {entry['job_id']} has already ended: nothing to cancel{later}", err=True)


def _cancel_if_active(entry: dict) -> bool:
    """Cancels the job of submission `entry` if its scheduler holds it queued or running; False
    when it has ended. Where the scheduler cannot be asked, its cancel command says."""
    from jobgen.schedulers import get_scheduler

    scheduler = get_scheduler(entry["scheduler"])
    try:
        found = scheduler.state(entry["job_id"])
    except JobgenError:  # cannot be asked: the cancel command says what it finds
        scheduler.cancel(entry["job_id"])
        return True
    if found is None or found.state.upper() not in scheduler.active_states:
        return False
    scheduler.cancel(entry["job_id"])
    return True


def _cancel_sweep(target: str) -> None:
    from jobgen.rundir.sweep import point_dirs

    cancelled, ended = [], []
    for _, run in point_dirs(target):
        if not run.submissions():
            continue
        latest = run.latest()
        (cancelled if _cancel_if_active(latest) else ended).append(latest["job_id"])
    click.echo(f"jobgen: cancelled {len(cancelled)} point(s): {' '.join(cancelled) or '-'}"
               + (f"; already ended: {' '.join(ended)}" if ended else ""), err=True)


@click.command()
@target_argument
@click.option("--node", type=int, metavar="K", help="The log of node K (0 is the master) instead of the batch log.")
@click.option("--rank", type=int, metavar="R", help="Everything rank R printed (the node logs show rank 0's only).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, with the training's progress, until the job ends.")
@click.option("--batch", "batch_only", is_flag=True, help="The batch log alone, without node 0's last lines.")
def logs(target: str, node: Optional[int], rank: Optional[int], follow: bool, batch_only: bool) -> None:
    """Print the job's batch log followed by the last lines of node 0's (the training's progress:
    step, loss, tokens/s; or why it failed), or one node's or one rank's log whole.

    \b
    All are in RUN_DIR/logs, written as the job runs on every scheduler and launcher:
    JOBID.out (the batch script), JOBID-nodeK.out (torchrun and rank 0),
    JOBID-ranks/0-999/JOBID-rankR.out (--rank R finds it).
    A sweep's folder prints every point's, each under a `==> POINT (JOBID) <==` line, e.g.
    jobgen logs runs/NAME --node 0; a point's folder (or ARRAYID_K on Slurm), that point's.
    """
    from jobgen.rundir.logs import log_path

    if node is not None and rank is not None:
        raise JobgenError("give --node or --rank, not both")
    if batch_only and (node is not None or rank is not None):
        raise JobgenError("--batch is the batch log alone: give it without --node or --rank")
    if sweep := _sweep_folder(target):
        if follow:
            raise JobgenError(f"-f follows one run: give a point's folder, e.g. jobgen logs -f {sweep.rstrip('/')}/POINT_NAME")
        return _sweep_logs(sweep, node, rank)
    if follow:  # with the trainer's progress: one updating line on a terminal (jobgen.rundir.progress)
        from jobgen.rundir.progress import follow_log

        return follow_log(target, node, rank, sys.stdout)
    path = log_path(target, node, rank)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise JobgenError(f"no log yet at {path}: the job may still be pending") from None
    click.echo(text, nl=False)
    if node is None and rank is None and not batch_only:
        _node_0_tail(target, path, text)


NODE_0_LINES = 20  # enough for the last few logged steps, or a traceback's end


def _node_0_tail(target: str, batch_log: Path, batch_text: str) -> None:
    """After the batch log: the last lines of node 0's log of the same job, where the trainer's
    rank 0 logs each step (its loss) and a failure's traceback; the batch log has neither."""
    from jobgen.rundir.logs import log_path

    try:
        path = log_path(target, 0, None)
        lines = path.read_text(errors="replace").splitlines()
    except (JobgenError, FileNotFoundError):
        return  # no node has started yet (pending, or the script stopped before its nodes)
    if path.parent != batch_log.parent or not lines:
        return
    shown = lines[-NODE_0_LINES:]
    whole = "" if len(shown) == len(lines) else f"its last {len(shown)} of {len(lines)} lines; "
    if batch_text and not batch_text.endswith("\n"):
        click.echo()
    click.echo(f"==> node 0: {path} ({whole}jobgen logs --node 0 prints it whole) <==")
    click.echo("\n".join(shown))


def _sweep_logs(target: str, node: Optional[int], rank: Optional[int]) -> None:
    from jobgen.rundir.logs import log_path, newest_job_id
    from jobgen.rundir.sweep import point_dirs

    for point, run in point_dirs(target):
        try:
            job_id = newest_job_id(run, None)  # the job whose log log_path reads
            text = log_path(str(run.path), node, rank).read_text(errors="replace")
        except (JobgenError, FileNotFoundError):
            text, job_id = "(no log yet: the point may still be pending)\n", point.get("job_id") or "-"
        click.echo(f"==> {point.get('name')} ({job_id}) <==")
        click.echo(text, nl=not text.endswith("\n"))


@click.command()
@target_argument
@click.option("-o", "--output", type=click.Path(path_type=Path), help="The PNG to write (default RUN_DIR/plot.png).")
@click.option("--data", "data_file", type=click.Path(path_type=Path), help="Also write the plotted data here, as JSON.")
def plot(target: str, output: Optional[Path], data_file: Optional[Path]) -> None:
    """Draw the run: loss and tokens/s over the steps with each segment's start marked, and under
    them the segments (how each ended) with the goodput. Needs matplotlib: pip install 'jobgen[plot]'.

    A sweep's folder draws every point's loss curve in one picture (default SWEEP/plot.png),
    e.g. jobgen plot runs/NAME.
    """
    from jobgen.files import write_output
    from jobgen.rundir.plot import plot as draw_run, plot_sweep

    sweep = _sweep_folder(target)
    path, data = plot_sweep(sweep, output) if sweep else draw_run(target, output)
    if data_file is not None:
        write_output(data_file, json.dumps(data, indent=2) + "\n")
    click.echo(f"jobgen: wrote {path}", err=True)
