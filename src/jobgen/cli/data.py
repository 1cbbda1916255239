"""`jobgen data JOB.yaml --show N`: the first N conversations as the model will see them.

What a user checks before spending GPU hours: the exact text of each sample after the chat
template (tool definitions, calls and results as the template writes them; for text and
pretokenized data, as jobgen.train.samples makes it: a long text's pieces, EOS at the end), with
the tokens it learns from marked, from the trainer's own tokenization
(jobgen.train.data.ChatTokenizer). `--json` prints each sample's ids and labels instead, one JSON
object a line. Reads the tokenizer (not the weights), so it needs transformers where it runs.
Without `--json`, a last line gives the whole data set's counts (conversations, tokens, those cut
at max_length) from its prepared store, where `jobgen prepare` or a job has made it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import click

from jobgen.cli.options import config_argument, resolve, set_option, site_option

LEARNED_START, LEARNED_END = "\u27e6", "\u27e7"  # ⟦ ⟧: rare in text, so a marked span is unmistakable


@click.command()
@config_argument
@site_option
@set_option
@click.option("--show", "count", type=click.IntRange(min=1), default=3, show_default=True, help="How many samples to show.")
@click.option("--json", "as_json", is_flag=True, help="Print each sample's input_ids and labels as one JSON object a line.")
def data(config: Path, site: Optional[str], overrides: tuple[str, ...], count: int, as_json: bool) -> None:
    """Show the first samples of CONFIG's data as the model will see them, learned tokens marked."""
    from itertools import islice

    from jobgen.job.conversations import read_samples
    from jobgen.job.model_reference import HUB_NAME
    from jobgen.job.preflight import working_directory
    from jobgen.job.sources import data_paths, resolve_paths
    from jobgen.rundir.model_pin import load_revision
    from jobgen.train.chat_template import CHATML, TOKENIZER
    from jobgen.train.data import IGNORE_INDEX, ChatTokenizer
    from jobgen.train.modeling import load_tokenizer
    from jobgen.train.samples import pieces

    job = resolve(config, site, overrides).job
    training, base = job.training_for("jobgen data"), working_directory(job)  # paths as the nodes resolve them
    local = os.path.join(base, training.model)
    model = local if os.path.exists(local) else training.model  # else a hub name, as the trainer reads it
    template = training.chat_template
    if template not in (None, CHATML, TOKENIZER):
        template = os.path.join(base, template)
    run_dir = os.path.abspath(job.effective_run_dir)
    revision = load_revision(run_dir, model, training.model_revision)  # the run's pinned commit, where it has one
    if model == training.model and HUB_NAME.match(model):
        _reach_hub_model(model, revision)
    tokenizer = load_tokenizer(model, revision, trust_remote_code=training.trust_remote_code)
    chat = ChatTokenizer(tokenizer, training.max_length, template, training.model)
    paths = [os.path.join(base, path) for path in data_paths(training.data)]
    # Read only as far as the samples shown: the first chunk of the first file, usually.
    records = (sample for chunk in read_samples(paths, training.data_format) for sample in chunk)
    samples = list(islice((piece for record in records for piece in pieces(record, chat)), count))
    if not as_json:
        click.echo(f"# {len(samples)} sample(s) in {chat.template_name}; learned tokens are between "
                   f"{LEARNED_START} and {LEARNED_END}")
    for sample_id, ids, labels, length in samples:
        if as_json:
            click.echo(json.dumps({"id": sample_id, "input_ids": ids, "labels": labels}))
            continue
        learned = [label != IGNORE_INDEX for label in labels]
        cut = f" (cut from {length} to max_length)" if length > len(ids) else ""
        click.echo(f"# sample {sample_id!r}: {len(ids)} tokens{cut}, {sum(learned)} learned")
        click.echo(marked_text(chat.tokenizer, ids, learned))
    if not as_json:
        click.echo(_whole_data(training.model_copy(update={
            "model": model, "model_revision": revision, "data": resolve_paths(training.data, base), "chat_template": template,
            "prepared_cache": os.path.join(base, training.prepared_cache) if training.prepared_cache else None,
        }), run_dir))


def _reach_hub_model(model: str, revision: str) -> None:
    """A hub model staged in this machine's cache is read from it with the hub offline; one that is
    not is downloaded, after one short request says the hub gives it (else one line, at once)."""
    from jobgen.job.hub_api import check_downloadable, quiet_retries
    from jobgen.job.hub_cache import environment_cache, look_up
    from jobgen.train.modeling import go_offline

    cached = look_up(model, revision, environment_cache())
    if cached.staged:
        go_offline()
        return
    check_downloadable(cached, "run `jobgen prepare JOB.yaml` where the hub can be reached (HF_ENDPOINT may name a mirror)")
    quiet_retries()


def _whole_data(training, run_dir: str) -> str:
    """The whole data set's counts from its prepared store, where one is (reading it is cheap;
    tokenizing every conversation here would not be)."""
    from jobgen.train.store import cut_summary, find_store

    store = find_store(training, run_dir)
    if store is None:
        return "# the whole data set: not prepared yet; `jobgen prepare` counts the conversations cut at max_length"
    meta = store.meta
    cut = cut_summary(meta, training.max_length) or "none cut at max_length"
    return f"# the whole data set (store {store.path}): {meta['conversations']} conversations, {meta['tokens']} tokens; {cut}"


def marked_text(tokenizer, ids: list[int], learned: list[bool]) -> str:
    """The decoded ids, each run of learned tokens between the markers."""
    parts: list[str] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or learned[end] != learned[start]:
            text = tokenizer.decode(ids[start:end])
            parts.append(f"{LEARNED_START}{text}{LEARNED_END}" if learned[start] else text)
            start = end
    return "".join(parts)
