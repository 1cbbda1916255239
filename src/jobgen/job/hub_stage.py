"""Staging a job's hub model into the cache its nodes use, from a machine with internet (the login
node), so that nodes without it load the model with the hub offline (`jobgen prepare` calls this).

A thin layer over `huggingface_hub.snapshot_download`: only what training needs is downloaded
(config, tokenizer, safetensors weights; `.bin` weights only where a model has no safetensors),
at `training.model_revision`, into jobgen.job.hub_cache.job_cache. The cache itself records the
revision: refs/REVISION names the commit, which the nodes resolve offline to the same snapshot.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from jobgen.errors import UserError
from jobgen.job.hub_api import ask_hub, check_downloadable, quiet_retries, unreachable_words
from jobgen.job.hub_cache import COMMIT, CachedModel, job_cache, look_up
from jobgen.job.models import Job

# What training reads: config and generation config, tokenizer files (json, sentencepiece, BPE
# merges, tiktoken), the weight index and weights. Not other formats' weights (onnx, gguf, flax).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.tiktoken", "*.jinja"]
BIN_WEIGHTS = ["pytorch_model*.bin"]
_REACH_FIX = "run `jobgen prepare` on a machine that reaches the hub (or set HF_ENDPOINT to a mirror this one reaches)"


def stage_model(job: Job, progress: Callable[[str], None] = print, tqdm_class: Optional[Any] = None) -> Optional[CachedModel]:
    """Downloads the job's hub model and tokenizer at its revision into the job's cache; returns
    what the cache then holds (complete), or None for a local model folder (nothing to stage).
    `progress` gets one line per stage; `tqdm_class` is passed to snapshot_download for its bars.
    UserError, one line, when the download fails or leaves the model incomplete."""
    from jobgen.job.model_reference import HUB_NAME
    from jobgen.job.preflight import working_directory

    training = job.training_for("jobgen prepare")
    if not HUB_NAME.match(training.model) or os.path.exists(os.path.join(working_directory(job), training.model)):
        progress(f"training.model: {training.model} is a local folder; nothing to stage")
        return None
    cache = job_cache(job.environment.variables)
    cached = look_up(training.model, training.model_revision, cache)
    # A branch may have moved since: download again unless a commit pins it.
    if cached.complete and COMMIT.match(training.model_revision):
        progress(f"training.model: {cached.at()} is already in {cache.path} (commit {cached.commit})")
        return cached
    answer = ask_hub(training.model, training.model_revision)
    if answer.unreachable and cached.complete:  # the branch may have moved; what is here still trains
        progress(f"training.model: {unreachable_words(answer)}; {cached.at()} is in {cache.path} at commit "
                 f"{cached.commit}, as it was staged")
        return cached
    check_downloadable(cached, _REACH_FIX, answer)
    quiet_retries()
    progress(f"training.model: downloading {cached.at()} into {cache.path} ({cache.chosen_by})")
    _download(training.model, training.model_revision, cache.path, MODEL_FILES, tqdm_class)
    cached = look_up(training.model, training.model_revision, cache)
    if cached.staged and any(line.startswith("the weights") for line in cached.missing):
        progress(f"training.model: {cached.at()} has no safetensors weights; downloading its .bin weights")
        _download(training.model, training.model_revision, cache.path, BIN_WEIGHTS, tqdm_class)
        cached = look_up(training.model, training.model_revision, cache)
    if not cached.complete:
        raise UserError(cached.problem())
    pin = "" if COMMIT.match(training.model_revision) else f"; to pin it, set training.model_revision: {cached.commit}"
    progress(f"training.model: {cached.at()} is in {cache.path} at commit {cached.commit}{pin}")
    return cached


def _download(model: str, revision: str, cache_path: str, patterns: list[str], tqdm_class: Optional[Any]) -> None:
    from huggingface_hub import snapshot_download

    kwargs = {"tqdm_class": tqdm_class} if tqdm_class is not None else {}
    try:
        snapshot_download(repo_id=model, revision=revision, cache_dir=cache_path, allow_patterns=patterns, **kwargs)
    except Exception as exc:  # the library raises many types: not found, gated, network
        lines = str(exc).strip().splitlines()
        raise UserError(f"training.model: could not download {model} at revision {revision} into {cache_path}: "
                        f"{lines[0] if lines else type(exc).__name__}") from None
