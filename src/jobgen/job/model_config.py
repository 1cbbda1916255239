"""What a model's config.json says about whether the job can load it, told without torch.

`jobgen validate` (jobgen.job.preflight) and the trainer, before anything distributed, read the
config of `training.model`: a local folder's, or a hub name's at the job's revision in the
Hugging Face cache the nodes use (jobgen.job.hub_cache; a hub name not in it is left to the
nodes). check_model_config refuses, one line each, naming the field:
- no `model_type` and no code of its own (`auto_map`): nothing tells transformers what to build;
- a `model_type` that the installed transformers does not know, without `auto_map`;
- code of its own (`auto_map`, for a model type transformers lacks) without
  `training.trust_remote_code: true`, and code files that `auto_map` names but the folder lacks;
- a pre-quantized checkpoint (`quantization_config.quant_method`): only `method: qlora` trains
  it, as LoRA adapters on the checkpoint's own quantization (never bitsandbytes on top of GPTQ),
  and only where the packages that load it are installed (PREQUANTIZED);
- a `training.max_length` above the positions the model has (max_position_embeddings, scaled by
  its RoPE scaling's factor).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

from jobgen.errors import UserError
from jobgen.job.hub_cache import DEFAULT_REVISION, HubCache, environment_cache, look_up
from jobgen.job.model_reference import HUB_NAME

# quant_method: (its name for people, the packages transformers needs to load it). peft trains
# LoRA adapters on each of these (its GPTQ, AWQ and bitsandbytes layers).
PREQUANTIZED = {
    "gptq": ("GPTQ", ("optimum", "gptqmodel")),
    "awq": ("AWQ", ("gptqmodel",)),
    "bitsandbytes": ("bitsandbytes", ("bitsandbytes",)),
}
_CONFIG_ENTRY = re.compile(r"""["']([\w.-]+)["']\s*[:,]\s*["'](\w+Config)["']""")


@dataclass(frozen=True)
class ModelConfig:
    """A config.json found for `training.model`: where, and what it holds."""

    path: str
    data: dict

    @property
    def quant_method(self) -> Optional[str]:
        quantization = self.data.get("quantization_config")
        return quantization.get("quant_method") if isinstance(quantization, dict) else None

    @property
    def max_positions(self) -> Optional[int]:
        """The longest row the model takes: max_position_embeddings (of text_config in a model
        that nests its language model), times a RoPE scaling's factor over the length it scales
        (Llama 3.1 writes the scaled length, Qwen's YaRN the original); None where it says neither."""
        data = self.data if "max_position_embeddings" in self.data else self.data.get("text_config")
        if not isinstance(data, dict) or not _whole(data.get("max_position_embeddings")):
            return None
        positions = data["max_position_embeddings"]
        scaling = data.get("rope_scaling")
        if isinstance(scaling, dict) and isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 1:
            original = scaling.get("original_max_position_embeddings")
            scaled = int(scaling["factor"] * (original if _whole(original) else positions))
            positions = max(positions, scaled)
        return positions

    def code_files(self) -> list[str]:
        """The model's own Python files that `auto_map` names (module.Class -> module.py)."""
        auto_map = self.data.get("auto_map")
        if not isinstance(auto_map, dict):
            return []
        files = set()
        for value in auto_map.values():
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "." in reference:
                    module = reference.split("--")[-1].rsplit(".", 1)[0]
                    files.add(module.replace(".", "/") + ".py")
        return sorted(files)


def find_model_config(model: str, revision: str = DEFAULT_REVISION, cache: Optional[HubCache] = None) -> Optional[ModelConfig]:
    """config.json of a local model folder, or of a hub name's snapshot at `revision` in `cache`
    (jobgen.job.hub_cache; by default the cache this process would use, as on a node); None where
    there is none to read here. Raises UserError for one that is not a JSON object."""
    if os.path.isdir(model):
        path: Optional[str] = os.path.join(model, "config.json")
    elif HUB_NAME.match(model):
        cached = look_up(model, revision, cache or environment_cache())
        path = os.path.join(cached.snapshot, "config.json") if cached.snapshot else None
    else:
        return None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise UserError(f"training.model: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"training.model: {path} must hold a JSON object")
    return ModelConfig(path, data)


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def native_model_types() -> Optional[set[str]]:
    """The model types the installed transformers builds without a model's own code, read from
    its auto-config source (importing it would import torch); None where that cannot be told."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    folder = os.path.join(os.path.dirname(spec.origin), "models", "auto")
    types: set[str] = set()
    for name in ("auto_mappings.py", "configuration_auto.py"):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as handle:
                types.update(match.group(1) for match in _CONFIG_ENTRY.finditer(handle.read()))
        except OSError:
            continue
    return types if "llama" in types else None  # a layout this reading does not know: no verdict


def check_model_config(config: ModelConfig, model: str, method: str, trust_remote_code: bool,
                       native: Optional[set[str]] = None, max_length: Optional[int] = None) -> list[str]:
    """The problems (one line each) that would stop `model` from loading for `method`, or from
    taking `max_length` tokens (training.max_length) in one row."""
    data, where = config.data, config.path
    model_type = data.get("model_type")
    has_code = bool(data.get("auto_map"))
    natively = native is not None and isinstance(model_type, str) and model_type in native
    problems = []
    if not isinstance(model_type, str) and not has_code:
        problems.append(f"training.model: {where} has no 'model_type', so transformers cannot tell which model to build")
    elif native is not None and not natively and not has_code:
        problems.append(
            f"training.model: {where}: model_type {model_type!r} is not known to the transformers installed here "
            "and the model has no code of its own ('auto_map'); upgrade transformers"
        )
    elif has_code and not natively:
        files = config.code_files()
        if not trust_remote_code:
            problems.append(
                f"training.model: {model} runs its own code ({', '.join(files) or 'auto_map'} in config.json's "
                "'auto_map'); set training.trust_remote_code: true to run it on every node, or use a model "
                "transformers supports"
            )
        folder = os.path.dirname(where)
        if os.path.isdir(model):  # a hub snapshot in the cache may fetch its code files later
            missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
            if missing:
                problems.append(f"training.model: {where}: 'auto_map' names {', '.join(missing)}, not in {folder}")
    problems += _check_quantization(config, model, method)
    positions = config.max_positions
    if max_length is not None and positions is not None and max_length > positions:
        problems.append(
            f"training.max_length {max_length} is above the {positions} positions {model} has "
            f"({positions_source(config)} in {where}): rows that long index past its position table or "
            f"run on positions it never trained; lower training.max_length to {positions} or less"
        )
    return problems


def positions_source(config: ModelConfig) -> str:
    data = config.data if "max_position_embeddings" in config.data else config.data.get("text_config", {})
    scaled = isinstance(data.get("rope_scaling"), dict) and data["rope_scaling"].get("factor")
    return "max_position_embeddings" + (" x rope_scaling.factor" if scaled else "")


def _check_quantization(config: ModelConfig, model: str, method: str) -> list[str]:
    quant = config.quant_method
    if quant is None:
        return []
    if quant not in PREQUANTIZED:
        known = ", ".join(PREQUANTIZED)
        return [f"training.model: {model} is quantized with {quant!r} (quantization_config.quant_method), which jobgen "
                f"cannot train adapters on; use a checkpoint that is not quantized, or one quantized with {known}"]
    name, packages = PREQUANTIZED[quant]
    if method != "qlora":
        return [f"training.model: {model} is a pre-quantized {name} checkpoint (quantization_config.quant_method), "
                f"which method {method} cannot train; set training.method: qlora to train LoRA adapters on its "
                f"{name} weights, or use the model's unquantized checkpoint"]
    missing = [package for package in packages if importlib.util.find_spec(package) is None]
    if missing:
        return [f"training.model: {model} is a pre-quantized {name} checkpoint; training adapters on it needs "
                f"{' and '.join(missing)}, not installed here: pip install {' '.join(missing)}"]
    return []


def model_config_problems(model: str, method: str, trust_remote_code: bool, revision: str = DEFAULT_REVISION,
                          cache: Optional[HubCache] = None, max_length: Optional[int] = None) -> list[str]:
    """check_model_config on `model`'s config where this machine has one; [] where it has none."""
    config = find_model_config(model, revision, cache)
    if config is None:
        return []
    return check_model_config(config, model, method, trust_remote_code, native_model_types(), max_length)


def has_chat_template(model: str, revision: str = DEFAULT_REVISION, cache: Optional[HubCache] = None) -> Optional[bool]:
    """Whether `model`'s tokenizer (a local folder, or a hub name's snapshot in this machine's
    cache) carries a chat template, as transformers loads one: tokenizer_config.json's
    `chat_template`, chat_template.jinja or additional_chat_templates/ (and a processor's
    chat_template.json). None where its tokenizer_config.json is not here to tell."""
    config = find_model_config(model, revision, cache)
    if config is None:
        return None
    folder = os.path.dirname(config.path)
    if any(os.path.exists(os.path.join(folder, name))
           for name in ("chat_template.jinja", "additional_chat_templates", "chat_template.json")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as handle:
            tokenizer_config = json.load(handle)
    except (OSError, ValueError):
        return None
    return bool(isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template"))


def code_files_of(model: str, revision: str = DEFAULT_REVISION) -> list[str]:
    config = find_model_config(model, revision)
    return config.code_files() if config else []

