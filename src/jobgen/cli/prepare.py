"""`jobgen prepare JOB.yaml`: tokenize the job's data on this machine, so that its ranks start without it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import click

from jobgen.cli.options import config_argument, resolve, set_option, site_option
from jobgen.errors import JobgenError
from jobgen.job.sources import resolve_paths


@click.command()
@config_argument
@site_option
@set_option
@click.option("--processes", "-j", type=click.IntRange(min=1), help="Tokenizing processes; default: one per CPU this command may use.")
def prepare(config: Path, site: Optional[str], overrides: tuple[str, ...], processes: Optional[int]) -> None:
    """Tokenize CONFIG's data into the store its job reads (training.prepared_cache, else the run
    directory's prepared/), with a progress line. A hub model is first downloaded into the cache the
    job's nodes use (its HF_HOME), so that they run with the hub offline. A job whose store is there skips its data
    preparation; a store already there is kept. Paths are resolved as the job resolves them (data,
    model and prepared_cache against environment.workdir, else this directory; the run directory
    against this directory): run it where you run submit."""
    resolved = resolve(config, site, overrides)
    job = resolved.job
    base = Path(job.environment.workdir or os.getcwd())
    training = job.training_for("jobgen prepare")
    model = str(base / training.model) if (base / training.model).exists() else training.model
    template = training.chat_template
    if template not in (None, "chatml", "tokenizer"):  # a Jinja file, as the trainer resolves it
        template = str((base / template).resolve())
    training = training.model_copy(update={
        "model": model, "data": resolve_paths(training.data, str(base)), "chat_template": template,
        "prepared_cache": str((base / training.prepared_cache).resolve()) if training.prepared_cache else None,
        "eval_data": resolve_paths(training.eval_data, str(base)),
    })
    run_dir = str(Path(job.effective_run_dir).resolve())  # as submit makes it: against this directory
    try:
        from jobgen.job.model_reference import check_model_reference
        from jobgen.train.encode import Progress
        from jobgen.train.modeling import load_tokenizer
        from jobgen.train.store import cut_summary, ensure_eval_store, ensure_store
    except ImportError as error:
        raise JobgenError(f"jobgen prepare tokenizes on this machine and needs the training packages ({error.name} "
                          "is missing): pip install 'jobgen[train]'") from None
    check_model_reference(training.model)
    if not os.path.isdir(training.model):  # a hub name: into the nodes' cache first, its tokenizer read at that commit
        training = training.model_copy(update={"model_revision": _stage(job, run_dir)})
    started = time.monotonic()
    tty = sys.stderr.isatty()
    width = [0]

    def show(text: str) -> None:
        if tty:  # one line, updated in place
            click.echo("\r" + text.ljust(width[0]), err=True, nl=False)
            width[0] = len(text)
        else:
            click.echo(f"jobgen: {text}", err=True)

    def waiting(seconds: float) -> None:
        show(f"another process is preparing this store; waited {seconds:.0f} s")

    def tokenizer() -> Any:
        return load_tokenizer(training.model, training.model_revision, trust_remote_code=training.trust_remote_code)

    dataset, outcome = ensure_store(training, run_dir, tokenizer, True, processes, Progress(show, in_place=tty), waiting)
    if tty and width[0]:
        click.echo(err=True)
    _said(dataset, outcome, training.max_length)
    if training.eval_data:  # a store of its own
        evaluated, outcome = ensure_eval_store(training, run_dir, tokenizer, True, dataset, processes,
                                               Progress(show, in_place=tty), waiting)
        if tty and width[0]:
            click.echo(err=True)
        _said(evaluated, outcome, training.max_length, "training.eval_data: ")
    elif "eval" in dataset.meta:
        held = dataset.meta["eval"]
        cut = cut_summary(held, training.max_length)
        click.echo(f"jobgen: eval_fraction {training.eval_fraction}: {held['conversations']} conversations, "
                   f"{held['tokens']} tokens held out (by seed {training.seed}) in its eval/ part"
                   f"{'; ' + cut if cut else ''}", err=True)
    if training.packing:
        dataset.packed_rows(training.max_length, training.seed, preparer=True)
    click.echo(f"jobgen: the job's ranks will map it; {time.monotonic() - started:.1f} s in all", err=True)


def _stage(job: Any, run_dir: str) -> str:
    """The job's hub model into the cache its nodes use (jobgen.job.hub_stage), at the commit the
    run is pinned to, else at its revision, pinning the commit that came (jobgen.rundir.model_pin);
    returns the revision the run loads."""
    from jobgen.job.hub_stage import stage_model
    from jobgen.rundir.files import MODEL_COMMIT
    from jobgen.rundir.model_pin import needs_pin, pin_commit, pinned_commit

    def say(line: str) -> None:
        click.echo(f"jobgen: {line}", err=True)

    model, revision = job.training.model, job.training.model_revision
    pinned = pinned_commit(run_dir, model, revision) if needs_pin(model, revision) else None
    if pinned:
        say(f"training.model: this run is pinned to commit {pinned}, the one it started with ({run_dir}/{MODEL_COMMIT})")
        job = job.model_copy(update={"training": job.training.model_copy(update={"model_revision": pinned})})
    cached = stage_model(job, progress=say)
    if pinned or cached is None or not needs_pin(model, revision):
        return pinned or revision
    pin_commit(run_dir, model, revision, cached.commit)
    say(f"training.model: commit {cached.commit} pinned for this run ({run_dir}/{MODEL_COMMIT}): "
        f"its starts and restarts load it, wherever {revision} points then")
    return cached.commit


def _said(dataset: Any, outcome: str, max_length: int, field: str = "") -> None:
    """What was prepared, or found, and the conversations cut at max_length."""
    from jobgen.train.store import cut_summary

    meta = dataset.meta
    what = f"{meta['conversations']} conversations, {meta['tokens']} tokens"
    if outcome == "prepared":
        rate = meta["tokens"] / max(meta["seconds"], 1e-6) / 1e6
        click.echo(f"jobgen: {field}prepared {dataset.path} ({what}) in {meta['seconds']:.1f} s with {meta['processes']} "
                   f"processes ({rate:.2f} M tokens/s)", err=True)
    else:
        by = "" if outcome == "found" else " by another process"
        click.echo(f"jobgen: {field}{dataset.path} ({what}) was prepared already{by}; nothing to do", err=True)
    cut = cut_summary(meta, max_length)
    if cut:
        click.echo(f"jobgen: {field}{cut}; raise training.max_length to keep them whole", err=True)
