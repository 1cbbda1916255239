"""Will the model's states fit on one GPU? Asked before loading, so that a job that cannot fit ends
in one line instead of a CUDA out-of-memory error minutes into loading (a full fine-tune of an 8B
model needs about 128 GB per GPU on one GPU: weights, gradients and Adam states, before any
activation).

The estimate counts only what DeepSpeed keeps for the whole run, per rank:
- weights: 2 bytes a parameter in bf16/fp16 (4 in fp32; about 0.56 in 4-bit NF4 with double
  quantization), partitioned across the ranks under ZeRO-3 only;
- gradients of the trainable parameters in the weights' dtype, partitioned under ZeRO-2 and 3;
- Adam: an fp32 master copy (not in fp32 training), momentum and variance, partitioned.
Activations come on top, so a job that passes can still run out of memory; one that fails this
cannot run at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobgen.job.models import Training
from jobgen.errors import UserError

GB = 1e9
NF4_BYTES = 0.5 + 0.06  # 4 bits, plus double-quantized block scales


@dataclass(frozen=True)
class Estimate:
    parameters: int
    trainable: int
    bytes_per_rank: float


def estimate(parameters: int, training: Training, precision: str, world_size: int) -> Estimate:
    width = 4 if precision == "fp32" else 2
    # An adapter is a fraction of a percent of the model: counted as nothing next to the weights.
    trainable = parameters if training.method == "full" else 0
    weight_bytes = parameters * (NF4_BYTES if training.method == "qlora" else width)
    if training.zero_stage == 3:
        weight_bytes /= world_size
    adam_bytes = 8 + (0 if precision == "fp32" else 4)
    states = trainable * (width + adam_bytes) / world_size
    return Estimate(parameters, trainable, weight_bytes + states)


def count_parameters(model: str) -> int:
    """Parameters of the model `model` names, from its config alone: built on the meta device,
    which allocates nothing."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in built.parameters())


def check_fits(training: Training, precision: str, world_size: int, device_bytes: int, parameters: int) -> Estimate:
    """A UserError naming the fixes when the model's states alone exceed the GPU's memory."""
    found = estimate(parameters, training, precision, world_size)
    if found.bytes_per_rank <= device_bytes:
        return found
    fixes = ["more GPUs (resources.nodes, resources.gpus_per_node)"]
    if training.zero_stage == 2:
        fixes.append("training.zero_stage: 3 (partitions the weights too)")
    if training.method == "full":
        fixes.append("training.method: lora or qlora")
    elif training.method == "lora":
        fixes.append("training.method: qlora (4-bit base weights)")
    raise UserError(
        f"training.model: a {training.method} fine-tune of {training.model} ({parameters / 1e9:.2f}B parameters) "
        f"needs about {found.bytes_per_rank / GB:.0f} GB per GPU for its weights"
        f"{', gradients and Adam states' if found.trainable else ''} alone (ZeRO-{training.zero_stage}, {precision}, "
        f"{world_size} GPU{'s' if world_size > 1 else ''}); this GPU has {device_bytes / GB:.0f} GB: use "
        + ", or ".join(fixes)
    )


def check_fits_on_gpu(training: Training, precision: str, device: Any) -> None:
    """On a CUDA rank, before loading; nothing to check on the CPU, where the host's memory is shared."""
    if getattr(device, "type", "cpu") != "cuda":
        return
    import torch
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        parameters = count_parameters(training.model)
    except Exception:  # noqa: BLE001 - an unreadable model is for from_pretrained to name, next
        return
    check_fits(training, precision, world_size, total, parameters)
