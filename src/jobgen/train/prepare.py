"""Step 1 of the trainer (jobgen.train.trainer): what every rank checks, alike, before any process
group exists, so that a user's mistake ends every rank at once with the same one-line message.
The job's paths are resolved against the working directory, the model is pinned to its commit
(jobgen.rundir.model_pin), and the settings a checkpoint keeps are taken (resume_settings).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

from jobgen.errors import UserError
from jobgen.job.hub_cache import environment_cache, look_up
from jobgen.job.model_config import find_model_config, model_config_problems
from jobgen.job.model_reference import check_model_reference
from jobgen.job.models import Job, Training
from jobgen.job.sources import resolve_paths
from jobgen.rundir.files import MODEL_COMMIT
from jobgen.rundir.model_pin import needs_pin, pin_commit, pinned_commit
from jobgen.train.chat_template import CHATML, TOKENIZER
from jobgen.train.distributed import Placement, place
from jobgen.train.dsconfig import build_config, digest, followed_schedule, hidden_size_of, no_hidden_size, without_split
from jobgen.train.modeling import use_hub_cache
from jobgen.train.store import check_data_path
from jobgen.train.trackers import check_installed

log = logging.getLogger("jobgen.train")

# Settings that may change between a checkpoint and its resumption without breaking exact resume.
# max_steps and epochs set the LR schedule's total, which is checked on its own (check_schedule_total).
# per_device_batch_size and gradient_accumulation only split the global batch, which the
# checkpoint keeps (global_batch_size is checked against it on its own, in the trainer's Trainer.run).
RESUME_SAFE_FIELDS = {
    "per_device_batch_size", "gradient_accumulation", "global_batch_size",
    "max_steps", "epochs", "save_interval", "keep_checkpoints", "logging_interval", "tensorboard",
    "report_to",
    "output_dir", "step_seconds_estimate", "async_save", "snapshot_every", "prepared_cache",
    # A file reads as the same conversations whether its format is detected or named (a named
    # format the file is not in is refused; only an item with two formats' fields, which auto
    # refuses, reads differently as each), and checkpoints made before the field still resume.
    "data_format",
    # Checked on its own, by the layout it resolves to (check_chat_template): unset and `tokenizer`
    # are the same layout for a model whose tokenizer has a template.
    "chat_template",
    # Which code builds the model, not what it computes; a checkpoint of either resumes with either.
    "trust_remote_code",
    # What is measured, not what trains (eval_fraction, which takes data from training, is not here).
    "eval_data", "eval_interval", "keep_best",
    # Which kernels compute the same model, not what it computes: a checkpoint resumes with others
    # (exactly only with the same ones, as their roundings differ).
    "attention", "liger_kernel",
    # Read only by a run without a checkpoint of its own (jobgen.train.init_from): a restart resumes
    # from the run's checkpoints, whatever init_from names then.
    "init_from",
}


# Fields added after checkpoints were first written, with the value every earlier run trained
# with: left out of a checkpoint's settings at that value, so those checkpoints still resume.
ADDED_AT = {
    "model_revision": "main", "warmup_ratio": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
    "lora.modules_to_save": [], "lora.bias": "none", "eval_fraction": 0.0,
}


def resume_settings(training: Training) -> dict:
    """The settings a checkpoint must share with the run that resumes it."""
    settings = {k: v for k, v in training.model_dump().items() if k not in RESUME_SAFE_FIELDS}
    for name, value in ADDED_AT.items():
        *parents, key = name.split(".")
        node = settings
        for parent in parents:
            node = node[parent]
        if node.get(key) == value:
            del node[key]
    return settings


def model_hidden_size(model: str, revision: str) -> dict:
    """build_config's keywords for a DeepSpeed config's 'auto' ZeRO bucket sizes: the model's
    hidden_size from its config in this node's cache, or why there is none."""
    config = find_model_config(model, revision)
    size = hidden_size_of(config.data) if config else None
    if size:
        return {"hidden_size": size}
    where = f"this node's cache ({environment_cache().chosen_by})"
    return {"no_hidden_size": no_hidden_size(model, config.path if config else None, where)}


def debug_step_delay() -> float:
    raw = os.environ.get("JOBGEN_DEBUG_STEP_DELAY", "0")
    try:
        value = float(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        raise UserError(f"JOBGEN_DEBUG_STEP_DELAY is {raw!r}; expected seconds >= 0") from None
    return value


@dataclass
class Prepared:
    """Everything checked before the process group starts."""

    job: Job
    training: Training  # model/data resolved against the working directory
    run_dir: str
    output_dir: str
    precision: str
    placement: Placement
    ds_config: dict
    config_digest: str
    resume_fields: dict  # resume_settings of the job's training: what a checkpoint keeps and a resume compares
    step_delay: float


def effective_precision(requested: str, cuda: bool) -> str:
    """The job's precision, on a GPU and on the CPU alike (see the package docstring)."""
    if not cuda and requested != "fp32":
        log.info("training.precision %s on the CPU: it runs, but fp32 is usually faster there", requested)
    return requested


def prepare(job: Job, run_dir: str, world_size: int, local_rank: int = 0) -> Prepared:
    """Validate inputs identically on every rank and place this one; raises UserError."""
    training = job.training
    model_ref = os.path.abspath(training.model) if os.path.exists(training.model) else training.model
    resolved = training.model_copy(update={"model": model_ref, "data": resolve_paths(training.data, os.getcwd())})
    if resolved.chat_template not in (None, CHATML, TOKENIZER):
        resolved = resolved.model_copy(update={"chat_template": os.path.abspath(resolved.chat_template)})
    if resolved.deepspeed_config:
        resolved = resolved.model_copy(update={"deepspeed_config": os.path.abspath(resolved.deepspeed_config)})
    if resolved.prepared_cache:
        resolved = resolved.model_copy(update={"prepared_cache": os.path.abspath(resolved.prepared_cache)})
    if resolved.init_from:
        resolved = resolved.model_copy(update={"init_from": os.path.abspath(resolved.init_from)})
    output_dir = training.output_dir
    if not os.path.isabs(output_dir):
        output_dir = os.path.join(run_dir, output_dir)
    check_model_reference(resolved.model)
    followed = followed_schedule(resolved)  # the DeepSpeed JSON's scheduler, as the Hugging Face Trainer runs it
    if followed:
        resolved = resolved.model_copy(update={"lr_schedule": followed[1]})
    state_fields = resume_settings(resolved)  # the job's revision, not the commit it is pinned to
    # Before anything reads the hub's settings; the model, its tokenizer and the store's key at
    # the run's pinned commit, where a branch names it.
    resolved = resolved.model_copy(update={"model_revision": _pinned_revision(run_dir, resolved)})
    problems = model_config_problems(resolved.model, training.method, training.trust_remote_code, resolved.model_revision,
                                     max_length=training.max_length)
    if problems:
        raise UserError("\n".join(problems))
    # Found here, on every rank, not by rank 0 alone once the others wait in a collective.
    check_installed(training.trackers())
    # The records are read and checked where they are tokenized (the data phase, jobgen.train.store).
    check_data_path(resolved.data)
    # The eval set is in the store too (eval_data's own, or eval_fraction's held-out part).
    if resolved.eval_data:
        resolved = resolved.model_copy(update={"eval_data": resolve_paths(resolved.eval_data, os.getcwd())})
        check_data_path(resolved.eval_data, "training.eval_data")
    placement = place(job.resources.gpus_per_node, local_rank, training.precision)
    precision = effective_precision(training.precision, placement.cuda)
    # Checks the config; jobgen.train.trainer's Trainer.run builds the one that runs once it knows the global batch (a
    # checkpoint's, when resuming) and how this world size splits it.
    ds_config = build_config(resolved, world_size, precision, resolved.deepspeed_config,
                             **model_hidden_size(resolved.model, resolved.model_revision))
    return Prepared(
        job=job,
        training=resolved,
        run_dir=run_dir,
        output_dir=os.path.abspath(output_dir),
        precision=precision,
        placement=placement,
        ds_config=ds_config,
        config_digest=digest({"training": state_fields, "deepspeed": without_split(ds_config)}),
        resume_fields=state_fields,
        step_delay=debug_step_delay(),
    )


def _pinned_revision(run_dir: str, training: Training) -> str:
    """The revision the model loads at (jobgen.rundir.model_pin): the job's, where it is a local
    folder or a commit; else the commit the run is pinned to; else, on the run's first start, the
    commit this node's cache holds, pinned now. Not staged here, the model is downloaded at its
    load and pinned then (jobgen.train.trainer's Trainer._pin_downloaded_model)."""
    model, revision = training.model, training.model_revision
    if not needs_pin(model, revision):
        use_hub_cache(model, revision)
        return revision
    pinned = pinned_commit(run_dir, model, revision)
    cached = use_hub_cache(model, pinned or revision)
    if pinned:
        now = look_up(model, revision, environment_cache()).commit
        moved = f"; {revision} is now {now[:12]} in the cache, which a new run would train on" if now and now != pinned else ""
        log.info("training.model %s: this run is pinned to commit %s, the one it started with (%s)%s",
                 model, pinned, MODEL_COMMIT, moved)
        return pinned
    if cached is None or not cached.staged:
        return revision
    winner = pin_commit(run_dir, model, revision, cached.commit)
    if winner != cached.commit:  # another node pinned first, from its own cache
        use_hub_cache(model, winner)
    return winner
