"""The DeepSpeed configuration a job runs with.

The bundled `configs/deepspeed/zero2.json` and `zero3.json` (installed as `jobgen/configs/...`)
hold "auto" wherever the job decides: batch sizes, gradient accumulation, precision, learning rate,
weight decay, Adam's betas and epsilon. `training.deepspeed_config` replaces the bundled file, as
Hugging Face users write one (e.g. the Qwen guide's ds_config_zero2.json, unedited): its values
must be "auto" (filled as the Hugging Face Trainer fills them), absent, or agree with the job,
and every one that does not is one line of one error. A `scheduler` section of "auto" values runs
as the Hugging Face Trainer runs it (WarmupLR: constant after the warmup, WarmupDecayLR: linear
decay, WarmupCosineLR: cosine), its params filled from the job; `validate` says so where it
differs from `lr_schedule`. One with values of its own is refused (the reference fine-tune's
WarmupLR silently overrode the user's cosine schedule). An
optimizer DeepSpeed would compile an op for as the job starts is said in one line
(compiled_op_notice), by `validate` and in the start-up log.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any

from jobgen.job.models import Job, Training
from jobgen.errors import UserError

_HERE = os.path.dirname(os.path.abspath(__file__))
# Installed wheel: jobgen/configs/deepspeed; source checkout: <repo>/configs/deepspeed.
BUNDLED_DIRS = (
    os.path.join(_HERE, "..", "configs", "deepspeed"),
    os.path.join(_HERE, "..", "..", "..", "configs", "deepspeed"),
)


def bundled_config_path(stage: int) -> str:
    for directory in BUNDLED_DIRS:
        path = os.path.normpath(os.path.join(directory, f"zero{stage}.json"))
        if os.path.exists(path):
            return path
    raise UserError(f"bundled DeepSpeed config zero{stage}.json not found (looked in {', '.join(BUNDLED_DIRS)})")


def _read(path: str) -> dict:
    if not os.path.exists(path):
        raise UserError(f"training.deepspeed_config: file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except json.JSONDecodeError as exc:
        raise UserError(f"training.deepspeed_config: {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(config, dict):
        raise UserError(f"training.deepspeed_config: {path} must hold a JSON object")
    return config


# transformers' integrations.deepspeed: each 'auto' ZeRO size as a function of hidden_size.
HIDDEN_SIZE_AUTOS = {
    "reduce_bucket_size": lambda hidden: hidden * hidden,
    "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "stage3_param_persistence_threshold": lambda hidden: 10 * hidden,
}
# DeepSpeed's schedulers whose 'auto' params the Hugging Face Trainer fills (warmup, learning
# rate, total steps), and jobgen's lr_schedule of the same shape after the warmup.
FOLLOWED_SCHEDULERS = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
SPLIT_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# What the Hugging Face Trainer fills a "gradient_clipping": "auto" with (its max_grad_norm default).
DEFAULT_GRADIENT_CLIPPING = 1.0
# Optimizers DeepSpeed builds a compiled op for (at start-up, unless built at install): by type, the
# op without and with the optimizer offloaded to the CPU. Adam and AdamW skip it with torch_adam.
COMPILED_OPTIMIZERS = {
    "adam": ("fused_adam", "cpu_adam"), "adamw": ("fused_adam", "cpu_adam"), "lamb": ("fused_lamb", "fused_lamb"),
    "lion": ("fused_lion", "cpu_lion"), "adagrad": (None, "cpu_adagrad"), "onebitadam": ("fused_adam", "fused_adam"),
    "zerooneadam": ("fused_adam", "fused_adam"), "onebitlamb": ("fused_lamb", "fused_lamb"),
}


def build_config(training: Training, world_size: int, precision: str, user_path: str | None,
                 micro: int | None = None, accumulation: int | None = None, hidden_size: int | None = None,
                 no_hidden_size: str = "") -> dict:
    """The resolved config dict for `deepspeed.initialize`; `precision` is what actually runs;
    `micro` x `accumulation` x `world_size` is the global batch (default: the job's fields).
    'auto' is filled as the Hugging Face Trainer fills it (the ZeRO bucket sizes from the model's
    `hidden_size`; `no_hidden_size` says why there is none, where the model's config is not
    here); a value that disagrees with the job, or an 'auto' nothing fills, is one line each of
    one UserError."""
    path = user_path or bundled_config_path(training.zero_stage)
    config = copy.deepcopy(_read(path))
    problems: list[str] = []
    _scheduler(config, training, path, problems)
    micro = micro or training.per_device_batch_size
    accumulation = accumulation or training.gradient_accumulation
    fill = _Filler(config, path, problems)
    fill(["train_micro_batch_size_per_gpu"], micro, "training.per_device_batch_size")
    fill(["gradient_accumulation_steps"], accumulation, "training.gradient_accumulation")
    fill(["train_batch_size"], micro * accumulation * world_size, "training.global_batch_size")
    fill(["bf16", "enabled"], precision == "bf16", "training.precision")
    fill(["fp16", "enabled"], precision == "fp16", "training.precision")
    fill(["zero_optimization", "stage"], training.zero_stage, "training.zero_stage")
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = DEFAULT_GRADIENT_CLIPPING
    config.setdefault("optimizer", {"type": "AdamW", "params": {"torch_adam": True}})
    fill(["optimizer", "params", "lr"], training.learning_rate, "training.learning_rate")
    fill(["optimizer", "params", "weight_decay"], training.weight_decay, "training.weight_decay")
    fill(["optimizer", "params", "betas"], [training.adam_beta1, training.adam_beta2], "training.adam_beta1/adam_beta2")
    fill(["optimizer", "params", "eps"], training.adam_epsilon, "training.adam_epsilon")
    _fill_bucket_sizes(config, path, hidden_size, no_hidden_size, problems)
    problems += [f"training.deepspeed_config: {path} has 'auto' at {where}, which jobgen does not fill; give a value"
                 for where in _find_autos(config)]
    if problems:
        raise UserError("\n".join(problems))
    return config


def _fill_bucket_sizes(config: dict, path: str, hidden_size: int | None, no_hidden_size: str, problems: list[str]) -> None:
    """The ZeRO sizes transformers' integrations.deepspeed fills from the model's hidden_size;
    without one, one line for them all that says why (the model's config not here, usually)."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    autos = [key for key in HIDDEN_SIZE_AUTOS if zero.get(key) == "auto"]
    if autos and not hidden_size:
        where = ", ".join(f"zero_optimization.{key}" for key in autos)
        problems.append(f"training.deepspeed_config: {path} has 'auto' at {where}, which the model's hidden_size fills "
                        f"(as the Hugging Face Trainer does), and {no_hidden_size or 'the model has none'}")
        for key in autos:
            del zero[key]  # said here, not again as an 'auto' nothing fills
        return
    for key in autos:
        zero[key] = HIDDEN_SIZE_AUTOS[key](hidden_size)


def _scheduler(config: dict, training: Training, path: str, problems: list[str]) -> None:
    """A 'scheduler' section of 'auto' values (as the Hugging Face examples write it) is followed,
    as the Hugging Face Trainer follows it (followed_schedule), and left out of the config
    DeepSpeed gets: jobgen runs that shape itself, so a resume restores it exactly. One with values
    of its own, or of a type the Trainer does not fill, is refused (the reference fine-tune's
    WarmupLR of its own values silently replaced the user's cosine schedule)."""
    section = config.get("scheduler")
    if section is None:
        return
    params = section.get("params") if isinstance(section, dict) else None
    del config["scheduler"]  # either way, said once here and not again for its 'auto' values
    kind = section.get("type", "?") if isinstance(section, dict) else "?"
    all_auto = isinstance(params, dict) and all(value == "auto" for value in params.values())
    if all_auto and kind in FOLLOWED_SCHEDULERS:
        return
    if all_auto:
        problems.append(
            f"training.deepspeed_config: {path} has a 'scheduler' of type {kind!r}, which jobgen does not follow; "
            f"use {', '.join(FOLLOWED_SCHEDULERS)} (their 'auto' params filled from the job), or remove it and set "
            "training.lr_schedule"
        )
        return
    problems.append(
        f"training.deepspeed_config: {path} has a 'scheduler' section ({kind}) with values of its own, which would "
        f"override the job's learning_rate and warmup; set its params to \"auto\" (filled from the job, as the "
        "Hugging Face Trainer fills them), or remove it and set lr_schedule and warmup_steps or warmup_ratio in the job"
    )


def followed_schedule(training: Training, base: str = "") -> tuple[str, str] | None:
    """(type, lr_schedule) where training.deepspeed_config (relative to `base`) has a 'scheduler'
    section of 'auto' values that jobgen follows: its shape after the warmup, as the Hugging Face
    Trainer runs it (the job's learning_rate and warmup fill its params; jobgen's warmup is linear,
    where DeepSpeed's default is log). None where there is none (training.lr_schedule runs)."""
    if not training.deepspeed_config:
        return None
    section = _read(os.path.join(base, training.deepspeed_config)).get("scheduler")
    kind = section.get("type") if isinstance(section, dict) else None
    params = section.get("params") if isinstance(section, dict) else None
    if kind not in FOLLOWED_SCHEDULERS or not isinstance(params, dict) or any(v != "auto" for v in params.values()):
        return None
    return kind, FOLLOWED_SCHEDULERS[kind]


def schedule_notice(training: Training, path: str, base: str = "") -> str | None:
    """One line where the DeepSpeed JSON's scheduler runs in place of a different training.lr_schedule."""
    followed = followed_schedule(training, base)
    if followed is None or followed[1] == training.lr_schedule:
        return None
    kind, shape = followed
    after = {"constant": "constant", "linear": "a linear decay to 0", "cosine": "a cosine decay to 0"}[shape]
    return (f"training.deepspeed_config: {path}: its scheduler {kind} runs, as in the Hugging Face Trainer: the job's "
            f"warmup to learning_rate, then {after} (lr_schedule {shape}); training.lr_schedule "
            f"({training.lr_schedule}) is not used: remove the 'scheduler' section for it to decide")


class _Filler:
    """Fills an 'auto' (or absent) value from the job; a value that disagrees is a problem line."""

    def __init__(self, config: dict, path: str, problems: list[str]) -> None:
        self.config, self.path, self.problems = config, path, problems

    def __call__(self, keys: list[str], value: Any, field: str) -> None:
        node = self.config
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        current = node.get(keys[-1], "auto")
        if current == "auto":
            node[keys[-1]] = value
        elif not _same(current, value):
            self.problems.append(
                f"training.deepspeed_config: {self.path}: {'.'.join(keys)} is {current!r} but the job says {value!r} "
                f"({field}); set it to \"auto\" (or remove it) so the job decides, or change {field}"
            )


def _same(current: Any, value: Any) -> bool:
    if isinstance(value, list) and isinstance(current, (list, tuple)):
        return len(current) == len(value) and all(_same(c, v) for c, v in zip(current, value))
    if isinstance(value, float) and isinstance(current, (int, float)) and not isinstance(current, bool):
        return abs(current - value) <= 1e-12 * max(1.0, abs(value))
    return current == value


def _find_autos(node: Any, prefix: str = "") -> list[str]:
    if node == "auto":
        return [prefix or "(top level)"]
    if isinstance(node, dict):
        return [where for key, value in node.items() for where in _find_autos(value, f"{prefix}.{key}" if prefix else key)]
    return []


def compiled_op_notice(config: dict, path: str) -> str | None:
    """One line when DeepSpeed would compile an optimizer op as the job starts, else None."""
    optimizer = config.get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    kind = str(optimizer.get("type", "")).lower()
    params = optimizer.get("params") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    offloaded = isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")
    if kind not in COMPILED_OPTIMIZERS or (kind in ("adam", "adamw") and params.get("torch_adam") is True):
        return None
    op = COMPILED_OPTIMIZERS[kind][1 if offloaded else 0]
    if op is None:
        return None
    fix = ('add "torch_adam": true to its params to use torch\'s own' if kind in ("adam", "adamw")
           else "build it at install (DS_BUILD_OPS=1) to skip that")
    return (f"training.deepspeed_config: {path}: optimizer {optimizer.get('type')} makes DeepSpeed compile its {op} op "
            f"when the job starts (a minute or more, and a CUDA compiler on GPU nodes) unless it was built at install; {fix}")


def check_job_deepspeed(job: Job, base: str) -> list[str]:
    """`validate`'s reading of training.deepspeed_config, relative to `base`: raises UserError with
    every problem (a missing file, each conflict with the job), returns notices (a compiled op)."""
    from jobgen.job.hub_cache import job_cache
    from jobgen.job.model_config import find_model_config
    from jobgen.train.data import split_global_batch

    training = job.training
    if not training.deepspeed_config:
        return []
    path = os.path.join(base, training.deepspeed_config)
    world = min(job.world_sizes)
    try:
        micro, accumulation = split_global_batch(job.global_batch, world, training.per_device_batch_size, job.procs_per_node)
    except UserError:  # said by validate's own batch check
        micro, accumulation = training.per_device_batch_size, training.gradient_accumulation
    cache = job_cache(job.environment.variables)
    model = find_model_config(os.path.join(base, training.model)) or find_model_config(training.model, training.model_revision, cache)
    config = build_config(training, world, training.precision, path, micro, accumulation, hidden_size_of(model.data if model else {}),
                          no_hidden_size(training.model, model.path if model else None, f"the cache the nodes use ({cache.chosen_by})"))
    notices = [compiled_op_notice(config, path), schedule_notice(training, path)]
    return [notice for notice in notices if notice]


def no_hidden_size(model: str, config_path: str | None, cache_words: str) -> str:
    """Why the model's hidden_size is not known where `cache_words` is the hub cache looked in:
    its config.json has none, or (a hub model) is not there to read it from; with the fix."""
    if config_path is not None:
        return f"its config.json ({config_path}) has no hidden_size: give values"
    return (f"{model}'s config.json is not in {cache_words} to read it from: stage the model there with "
            "`jobgen prepare JOB.yaml` (the nodes then fill them from it as the job starts), or give values")


def hidden_size_of(model_config: dict) -> int | None:
    """The model's hidden size, for 'auto' ZeRO bucket sizes (a multimodal config nests it)."""
    for config in (model_config, model_config.get("text_config") or {}):
        if isinstance(config, dict) and isinstance(config.get("hidden_size"), int):
            return config["hidden_size"]
    return None


def without_split(config: dict) -> dict:
    """`config` less the batch split, which a resume on another world size changes (the global
    batch itself is checked against the checkpoint's)."""
    return {k: v for k, v in config.items() if k not in SPLIT_KEYS}


def digest(payload: Any) -> str:
    """sha256 of the canonical JSON form of `payload`."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
