"""The DeepSpeed configuration a job runs with.

The bundled `configs/deepspeed/zero2.json` and `zero3.json` (installed as `jobgen/configs/...`)
hold "auto" wherever the job decides: batch sizes, gradient accumulation, precision, learning rate
and weight decay. `training.deepspeed_config` replaces the bundled file; its values must then
either be "auto", be absent, or agree with the job. No config may carry a `scheduler` section:
the job's `lr_schedule` is the one that runs (the reference fine-tune's WarmupLR silently
overrode the user's cosine schedule; we refuse instead).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any

from jobgen.job.models import Training
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


SPLIT_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def build_config(training: Training, world_size: int, precision: str, user_path: str | None,
                 micro: int | None = None, accumulation: int | None = None) -> dict:
    """The resolved config dict for `deepspeed.initialize`; `precision` is what actually runs;
    `micro` x `accumulation` x `world_size` is the global batch (default: the job's fields)."""
    path = user_path or bundled_config_path(training.zero_stage)
    config = copy.deepcopy(_read(path))
    if "scheduler" in config:
        raise UserError(
            f"training.deepspeed_config: {path} has a 'scheduler' section, which would override "
            f"training.lr_schedule ({training.lr_schedule}); remove it and set lr_schedule/warmup_steps in the job"
        )
    micro = micro or training.per_device_batch_size
    accumulation = accumulation or training.gradient_accumulation
    _fill(config, ["train_micro_batch_size_per_gpu"], micro, path)
    _fill(config, ["gradient_accumulation_steps"], accumulation, path)
    _fill(config, ["train_batch_size"], micro * accumulation * world_size, path)
    _fill(config, ["bf16", "enabled"], precision == "bf16", path)
    _fill(config, ["fp16", "enabled"], precision == "fp16", path)
    _fill(config, ["zero_optimization", "stage"], training.zero_stage, path)
    config.setdefault(
        "optimizer", {"type": "AdamW", "params": {"betas": [0.9, 0.999], "eps": 1e-8, "torch_adam": True}}
    )
    _fill(config, ["optimizer", "params", "lr"], training.learning_rate, path)
    _fill(config, ["optimizer", "params", "weight_decay"], training.weight_decay, path)
    leftover = _find_auto(config)
    if leftover:
        raise UserError(f"training.deepspeed_config: {path} has 'auto' at {leftover}, which jobgen does not fill")
    return config


def _fill(config: dict, keys: list[str], value: Any, path: str) -> None:
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    current = node.get(keys[-1], "auto")
    if current == "auto":
        node[keys[-1]] = value
    elif current != value:
        name = ".".join(keys)
        raise UserError(
            f"DeepSpeed config {path}: {name} is {current!r} but the job says {value!r}; "
            f"set it to \"auto\" (or remove it) so the job decides"
        )


def _find_auto(node: Any, prefix: str = "") -> str | None:
    if node == "auto":
        return prefix or "(top level)"
    if isinstance(node, dict):
        for key, value in node.items():
            found = _find_auto(value, f"{prefix}.{key}" if prefix else key)
            if found:
                return found
    return None


def without_split(config: dict) -> dict:
    """`config` less the batch split, which a resume on another world size changes (the global
    batch itself is checked against the checkpoint's)."""
    return {k: v for k, v in config.items() if k not in SPLIT_KEYS}


def digest(payload: Any) -> str:
    """sha256 of the canonical JSON form of `payload`."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
