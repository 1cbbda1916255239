"""Loading the causal LM and its tokenizer, and turning it into what the method trains.

full: every parameter trains. lora: a peft LoRA adapter on `training.lora.target_modules`.
qlora: the base model loaded in 4-bit NF4 by bitsandbytes, `prepare_model_for_kbit_training`,
then the same LoRA adapter; a checkpoint saved quantized (GPTQ, AWQ) loads with its own
quantization instead, and the adapter trains on its quantized layers. Except under ZeRO-3 (which partitions while loading), `device_map`
loads the weights straight onto this rank's device: without it every rank first builds the whole
model in host memory (16 GB per rank for an 8B model in bf16, 128 GB on an 8-GPU node).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any, Callable, Optional

from jobgen.job import hub_cache
from jobgen.job.hub_api import check_downloadable
from jobgen.job.models import Training
from jobgen.errors import UserError

log = logging.getLogger("jobgen.train")


def keep_bitsandbytes_out(method: str) -> None:
    """Unless the job is qlora, this process imports bitsandbytes never again, as if it were not
    installed; call it before anything imports peft. peft imports bitsandbytes whenever it is
    installed (`import peft` runs `peft.helpers`), and that import logs on every rank, e.g. "Failed
    to load CPU gemm_4bit_forward from kernels-community" on a CPU with AVX-512 BF16: a warning
    about kernels that only a 4-bit model uses, and seconds of start-up. A qlora job imports it
    and shows whatever it says. A process runs one job, so this holds for the process."""
    if method != "qlora" and "bitsandbytes" not in sys.modules:
        # A None entry makes `import bitsandbytes` raise ImportError, and find_spec say it is absent.
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


def import_deepspeed() -> Any:
    """deepspeed, imported without mlflow. DeepSpeed's autotuner, which jobgen never runs, imports
    mlflow when it is installed, on every `import deepspeed`: about 2.5 of the 12.6 CPU-seconds
    of a LoRA rank's imports on the test machine (BENCHMARKS.md). mlflow stays importable for the
    job's own tracker, which imports it when it needs it."""
    if "mlflow" in sys.modules or "deepspeed" in sys.modules:
        import deepspeed
    else:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError meanwhile
        try:
            import deepspeed
        finally:
            del sys.modules["mlflow"]
    import_muon_compiled_when_used()
    return deepspeed


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_compiled_when_used() -> None:
    """DeepSpeed's Muon optimizer module, imported with its kernels compiled at their first call
    rather than at import. DeepSpeed 0.19 imports that module in every ZeRO engine's set-up
    (its optimizer check) and ZeRO-1/2 gradient reduction, whatever the optimizer, and the module
    decorates its kernels with torch.compile, which imports torch._inductor: about a CPU-second of
    every rank's start-up, at every restart (BENCHMARKS.md), for an optimizer few jobs use. A job
    whose DeepSpeed config names Muon compiles the same kernels on their first call. A DeepSpeed
    without that module, or without `compiler.compile`, is left as it is."""
    if MUON_MODULE in sys.modules:
        return
    try:
        from deepspeed.runtime import compiler
    except ImportError:
        return
    at_import = getattr(compiler, "compile", None)
    if at_import is None:
        return

    compiler.compile = lambda: functools.partial(compiled_at_first_call, at_import)
    try:
        from deepspeed.runtime.zero.muon import original_muon  # noqa: F401
    except ImportError:
        pass  # a DeepSpeed without Muon
    finally:
        compiler.compile = at_import


def compiled_at_first_call(compile_decorator: Callable[[], Any], function: Any) -> Any:
    """`function`, compiled by `compile_decorator()` (DeepSpeed's `compiler.compile`) when first called."""
    compiled = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = compile_decorator()(function)
        return compiled(*args, **kwargs)

    return call


def torch_dtype(precision: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def use_hub_cache(model: str, revision: str) -> Optional[hub_cache.CachedModel]:
    """Before anything reads huggingface_hub's settings, for a hub model: staged in this node's
    cache, the model loads with the hub offline (HF_HUB_OFFLINE=1, unless the job or the user set
    it), so a missing file is one line instead of a download on every node, or a hang on a node
    without internet; UserError when the staged snapshot lacks a file training needs. None for a
    local folder."""
    if os.path.isdir(model):
        return None
    cached = hub_cache.look_up(model, revision, hub_cache.environment_cache())
    if not cached.staged and _offline():
        raise UserError(cached.problem(offline=_offline()))
    if not cached.staged:
        # Asked once, so a node that cannot reach the hub says so at once, not after a minute of retries.
        check_downloadable(cached, f"stage it into the nodes' cache with {hub_cache.FIX.removeprefix('run ')}")
        log.info("training.model %s is not in this node's cache (%s): each node downloads it from the hub",
                 cached.at(), cached.cache.chosen_by)
        return cached
    if cached.missing:
        raise UserError(cached.problem())
    go_offline()
    log.info("training.model %s: commit %s from the cache (%s); HF_HUB_OFFLINE=%s", cached.at(), cached.commit,
             cached.cache.chosen_by, os.environ.get("HF_HUB_OFFLINE", ""))
    return cached


def go_offline() -> None:
    """HF_HUB_OFFLINE=1 for what this process loads from the cache, unless the job or the user set
    it: a staged model loads without asking the hub for each file."""
    if not hub_cache.user_set_offline(os.environ):
        os.environ["HF_HUB_OFFLINE"] = "1"
        constants = sys.modules.get("huggingface_hub.constants")
        if constants is not None:  # read at its import: set it there too
            constants.HF_HUB_OFFLINE = True


def load_tokenizer(model: str, revision: str = hub_cache.DEFAULT_REVISION, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a bad reference
        raise UserError(_load_error("a tokenizer from", model, revision, exc)) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


# transformers reads the ZeRO-3 config through a weak reference; this keeps it alive for the run.
_zero3_config: Any = None


def load_model(training: Training, precision: str, device: Any, ds_config: dict | None = None) -> Any:
    """The model the method trains. With ZeRO-3 (full and lora), `ds_config` makes from_pretrained
    partition the weights while loading (deepspeed.zero.Init), so no rank holds the whole model."""
    global _zero3_config
    from transformers import AutoModelForCausalLM

    from jobgen.train.memory import check_fits_on_gpu

    check_fits_on_gpu(training, precision, device)

    _zero3_config = None
    if ds_config is not None and training.zero_stage == 3 and training.method != "qlora":
        from transformers.integrations import HfDeepSpeedConfig

        _zero3_config = HfDeepSpeedConfig(ds_config)
    dtype = torch_dtype(precision)
    kwargs: dict = {"dtype": dtype, "trust_remote_code": training.trust_remote_code}
    own_quantization = prequantized(training) if training.method == "qlora" else None
    if training.method == "qlora" and own_quantization is None:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    if _zero3_config is None:
        kwargs["device_map"] = {"": device}
    if training.attention != "auto":
        kwargs["attn_implementation"] = training.attention
    try:
        model = AutoModelForCausalLM.from_pretrained(training.model, revision=training.model_revision, **kwargs)
    except Exception as exc:
        raise UserError(_load_error("", training.model, training.model_revision, exc)) from None
    model.config.use_cache = False  # the cache is useless in training and conflicts with checkpointing
    if training.liger_kernel:
        _apply_liger(model, training.model)
    if training.method == "qlora":
        from peft import prepare_model_for_kbit_training

        if own_quantization is not None:
            # A GPTQ or AWQ checkpoint trains its adapters on its own quantized layers.
            log.info("qlora: LoRA adapters on the checkpoint's own %s quantization", own_quantization)
        else:
            import bitsandbytes

            quantized = sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in model.modules())
            if quantized == 0:
                raise RuntimeError(f"{training.model}: bitsandbytes quantized no layer to 4 bits")
            log.info("qlora: %d linear layers in 4-bit NF4", quantized)
            _copy_out_of_weight_files(model, bitsandbytes.nn.Params4bit)

        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=training.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    elif training.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if training.method in ("lora", "qlora"):
        model = _add_lora(model, training)
    return model


def _apply_liger(model: Any, name: str) -> None:
    """Liger's RMSNorm, SwiGLU and RoPE kernels in the loaded model's modules, before LoRA wraps its
    linear layers. Not its fused cross-entropy: jobgen computes the loss from the logits itself
    (trainer._token_loss_sum, chunked), so the loss and its resume stay the same code on every device."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise UserError(f"training.liger_kernel: the liger-kernel package is not importable on this node "
                        f"({_first_line(exc)}): pip install liger-kernel, or set liger_kernel false") from None
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise UserError(f"training.liger_kernel: Liger has no kernels for {name!r} (model_type {model_type!r}); "
                        f"it knows {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}: set liger_kernel false")
    _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    log.info("training.liger_kernel: Liger's RMSNorm, SwiGLU and RoPE kernels in %s (%s)", name, model_type)


def prequantized(training: Training) -> str | None:
    """The quant_method of a checkpoint saved quantized (GPTQ, AWQ, bitsandbytes), else None: such
    a model loads with its own quantization, never with bitsandbytes on top."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(training.model, trust_remote_code=training.trust_remote_code)
    except Exception as exc:
        raise UserError(f"training.model: could not read the config of {training.model!r}: {_first_line(exc)}") from None
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", None)
    return None if method is None else str(getattr(method, "value", method))


def _copy_out_of_weight_files(model: Any, quantized: type) -> None:
    """Gives the CPU tensors that are not quantized (embeddings, norms, lm_head) memory of their own.

    On the CPU, from_pretrained leaves them as views of the mapped safetensors file, and that
    mapping then keeps every page quantization read resident: the whole unquantized model, in the
    rank's memory, for the whole run (305 MB of a 76 M-parameter fp32 model, 6x its NF4 weights).
    Their copies are small; the mapping goes with its last view. On a GPU nothing is on the CPU.
    """
    import gc

    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.device.type == "cpu" and not isinstance(param, quantized):
                param.data = param.data.clone()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device.type == "cpu":
                module._buffers[name] = buffer.clone()
    gc.collect()


def _add_lora(model: Any, training: Training) -> Any:
    from peft import LoraConfig, get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [m for m in training.lora.target_modules if m not in present]
    if missing:
        raise UserError(
            f"training.lora.target_modules: {missing} not found in {training.model!r}; "
            f"its linear layers include {sorted(_linear_names(model))}"
        )
    missing = [m for m in training.lora.modules_to_save if m not in present]
    if missing:
        raise UserError(
            f"training.lora.modules_to_save: {missing} not found in {training.model!r}; "
            f"its modules include {sorted(present - {''})[:40]}"
        )
    config = LoraConfig(
        r=training.lora.r,
        lora_alpha=training.lora.alpha,
        lora_dropout=training.lora.dropout,
        target_modules=list(training.lora.target_modules),
        modules_to_save=list(training.lora.modules_to_save) or None,
        bias=training.lora.bias,
        task_type="CAUSAL_LM",
    )
    # peft would upcast bf16/fp16 adapters to fp32. DeepSpeed casts them back to the training
    # dtype under ZeRO-2 but not under ZeRO-3 (a model partitioned while loading is not cast), so
    # the two stages would train in different numerics and memory. Adapters in the base weights'
    # dtype under both; DeepSpeed's optimizer keeps the fp32 master copy either way.
    return get_peft_model(model, config, autocast_adapter_dtype=False)


def _linear_names(model: Any) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _load_error(what: str, model: str, revision: str, exc: BaseException) -> str:
    """One line; with the hub offline, it names the cache and the fix (the library's offline error
    says only that a file is not cached)."""
    offline = _offline()
    if os.path.isdir(model) or not offline:
        return f"training.model: could not load {what}{' ' if what else ''}{model!r}: {_first_line(exc)}"
    cached = hub_cache.look_up(model, revision, hub_cache.environment_cache())
    return (f"training.model: could not load {what}{' ' if what else ''}{cached.at()} with the hub offline (HF_HUB_OFFLINE={offline}) "
            f"from the cache the nodes use ({cached.cache.chosen_by}): {_first_line(exc)}; {hub_cache.FIX}")


def _offline() -> str:
    """HF_HUB_OFFLINE's value where it switches the hub off (huggingface_hub.constants' rule), else ''."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value if value.upper() in {"1", "ON", "YES", "TRUE"} else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
