"""training.init_from: a new run that starts from another run's weights, and nothing else of it.

The source is a jobgen checkpoint folder (OUTPUT_DIR/checkpoints/step-NNNNNN of another run: its
universal/ pieces hold every trainable parameter in fp32, on any world size) or, for lora and
qlora, an adapter folder as peft saves it (OUTPUT_DIR/final: adapter_config.json and
adapter_model.safetensors). The new run keeps its own step count (0), optimizer (fresh), LR
schedule and seed. A full model folder is what training.model already takes, so it is refused
here with that fix.

`check()` reads only small files (no torch) and runs where the job is checked: `jobgen validate`
and `submit` when the folder is visible there, and every rank before its process group. `load()`
sets the weights into the DeepSpeed engine, after its initialisation and only on a run that has no
checkpoint of its own: a restart resumes from the run's own checkpoints, never from init_from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from jobgen.errors import UserError
from jobgen.job.models import Training

FIELD = "training.init_from"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The checkpoint's files this module reads; the rest of its layout is jobgen.train.checkpoint's.
COMPLETE, MANIFEST, TRAINER_STATE = "COMPLETE", "manifest.json", "trainer_state.json"
# What must match for the weights to fit this job's trainable parameters, one by one.
LORA_SHAPE = ("r", "target_modules", "modules_to_save", "bias")


@dataclass(frozen=True)
class Source:
    kind: str  # "checkpoint" or "adapter"
    path: str


def check(training: Training, path: str) -> Source:
    """The source `path` (absolute) names, if its weights fit `training`; else UserError naming the
    field, the value and the fix. `training.model` is compared as given (resolve it first)."""
    if not os.path.isdir(path):
        raise UserError(f"{FIELD}: {path!r} is not a folder; give another run's checkpoint (OUTPUT_DIR/checkpoints/"
                        f"step-NNNNNN) or, for lora and qlora, its adapter folder (OUTPUT_DIR/final)")
    if os.path.exists(os.path.join(path, ADAPTER_CONFIG)):
        _check_adapter(training, path)
        return Source("adapter", path)
    if os.path.exists(os.path.join(path, MANIFEST)) or os.path.exists(os.path.join(path, TRAINER_STATE)) \
            or os.path.basename(path).startswith((".tmp-", "step-")):
        _check_checkpoint(training, path)
        return Source("checkpoint", path)
    if os.path.exists(os.path.join(path, "config.json")):
        fix = (f"set training.model: {path} instead (a full model folder is where a full fine-tune starts)"
               if training.method == "full" else
               f"set training.model: {path} to train adapters on it, or give an adapter folder (adapter_config.json)")
        raise UserError(f"{FIELD}: {path!r} is a full model folder, not a jobgen checkpoint or adapter; {fix}")
    raise UserError(f"{FIELD}: {path!r} holds neither a jobgen checkpoint (manifest.json, COMPLETE) nor an adapter "
                    f"({ADAPTER_CONFIG}); give OUTPUT_DIR/checkpoints/step-NNNNNN or OUTPUT_DIR/final of another run")


def _check_checkpoint(training: Training, path: str) -> None:
    if not os.path.exists(os.path.join(path, COMPLETE)):
        newest = _newest_complete(os.path.dirname(path))
        raise UserError(f"{FIELD}: {path!r} is an incomplete checkpoint (no COMPLETE: its save was cut short); "
                        f"give a complete one{f', e.g. {newest}' if newest else ''}")
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
            files = json.load(handle)["files"]
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as handle:
            trained = json.load(handle)["training"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{FIELD}: checkpoint {path!r} has no readable {MANIFEST} and {TRAINER_STATE} ({exc}); "
                        f"give another checkpoint of that run") from None
    for name, entry in sorted(files.items()):  # sizes here; every file's sha256 once the ranks can share it (load)
        full = os.path.join(path, name)
        if not os.path.isfile(full) or os.path.getsize(full) != entry.get("size"):
            raise UserError(f"{FIELD}: checkpoint {path!r} does not match its manifest ({name} is missing or of "
                            f"another size); give another checkpoint of that run")
    if trained.get("method") != training.method:
        raise UserError(f"{FIELD}: checkpoint {path!r} was trained with method {trained.get('method')}, this job is "
                        f"{training.method}; set training.method: {trained.get('method')}, or init from a "
                        f"{training.method} run")
    if trained.get("model") != training.model:
        raise UserError(f"{FIELD}: checkpoint {path!r} was trained on {trained.get('model')!r}, this job on "
                        f"{training.model!r}; set training.model: {trained.get('model')}, or init from a run on it")
    if training.method != "full":
        lora = {**{"modules_to_save": [], "bias": "none"}, **trained.get("lora", {})}  # checkpoints before those fields
        _same_lora_shape(training, path, {k: lora.get(k) for k in LORA_SHAPE})


def _check_adapter(training: Training, path: str) -> None:
    if training.method == "full":
        raise UserError(f"{FIELD}: {path!r} is a LoRA adapter and this job's method is full; set training.method: "
                        f"lora (or qlora) to train on from it, or give a full run's checkpoint")
    try:
        with open(os.path.join(path, ADAPTER_CONFIG), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UserError(f"{FIELD}: {path!r}: {ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not os.path.exists(os.path.join(path, ADAPTER_WEIGHTS)):
        raise UserError(f"{FIELD}: adapter {path!r} has no {ADAPTER_WEIGHTS}; give a folder peft saved with "
                        f"safetensors (jobgen's OUTPUT_DIR/final)")
    base = config.get("base_model_name_or_path")
    if base and base != training.model:
        raise UserError(f"{FIELD}: adapter {path!r} was trained on {base!r}, this job on {training.model!r}; set "
                        f"training.model: {base}, or give an adapter of that model")
    _same_lora_shape(training, path, {"r": config.get("r"), "target_modules": config.get("target_modules"),
                                      "modules_to_save": config.get("modules_to_save") or [],
                                      "bias": config.get("bias", "none")})


def _same_lora_shape(training: Training, path: str, theirs: dict) -> None:
    ours = {"r": training.lora.r, "target_modules": list(training.lora.target_modules),
            "modules_to_save": list(training.lora.modules_to_save), "bias": training.lora.bias}
    for key in LORA_SHAPE:
        a, b = theirs.get(key), ours[key]
        if isinstance(b, list):  # peft writes target_modules as a set's list, in any order
            a, b = sorted(a or []), sorted(b)
        if a != b:
            raise UserError(f"{FIELD}: {path!r} has LoRA {key} {a}, this job {b}; set training.lora.{key}: {a} "
                            f"to train on from it")


def _newest_complete(folder: str) -> Optional[str]:
    try:
        names = sorted(n for n in os.listdir(folder) if n.startswith("step-") and os.path.exists(os.path.join(folder, n, COMPLETE)))
    except OSError:
        return None
    return os.path.join(folder, names[-1]) if names else None


def load(engine: Any, source: Source, rank: int) -> None:
    """Set every trainable parameter of `engine` (its fp32 master and its training-dtype copy, on
    any ZeRO stage) from `source`; optimizer, schedule and step stay the new run's."""
    from jobgen.train import reshard

    if source.kind == "checkpoint":
        with open(os.path.join(source.path, MANIFEST), encoding="utf-8") as handle:
            written_by = int(json.load(handle)["world_size"])
        reshard.load_weights(engine, source.path, written_by, rank)
        return
    reshard.set_weights(engine, _adapter_weights(engine, source.path), rank)


def _adapter_weights(engine: Any, path: str) -> dict:
    """The adapter's tensors by this engine's parameter names: peft saves them without the adapter's
    name (lora_A.default.weight as lora_A.weight, lm_head.modules_to_save.default.weight as lm_head.weight)."""
    from safetensors.torch import load_file

    saved = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    wanted = {name: name.replace("modules_to_save.", "").replace(".default", "")
              for name, p in engine.module.named_parameters() if p.requires_grad}
    missing = sorted(name for name, key in wanted.items() if key not in saved)
    if missing:
        raise UserError(f"{FIELD}: adapter {path!r} has no weights for {len(missing)} of this job's {len(wanted)} "
                        f"trainable parameters (e.g. {missing[0]}); give an adapter of the same LoRA settings")
    return {name: saved[key] for name, key in wanted.items()}


def check_job(job: Any, base: str) -> list[str]:
    """`jobgen validate` and `submit`: check() where this machine sees the folder (warnings for
    what it cannot see), unless the run already has a checkpoint of its own to resume from.
    `base` is the working directory the nodes resolve relative paths against."""
    from jobgen.job.preflight import _where_missing

    training = job.training
    if training is None or not training.init_from:
        return []
    run_dir = os.path.join(base, job.effective_run_dir)
    if _newest_complete(os.path.join(run_dir, training.output_dir, "checkpoints")):
        return []
    path = os.path.abspath(os.path.join(base, training.init_from))
    error, warning = _where_missing(FIELD, path, "folder")
    if error:
        raise UserError(error)
    if warning:
        return [warning]
    model = os.path.join(base, training.model)
    check(training.model_copy(update={"model": os.path.abspath(model) if os.path.exists(model) else training.model}), path)
    return []
