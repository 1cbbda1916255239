"""The trainable state in a layout that does not depend on the world size, and its load on any.

DeepSpeed's own checkpoint files hold each rank's ZeRO partition: flat fp32 buffers whose cut
points depend on the world size (and on alignment padding), so they load only on the world size
that wrote them. Next to them every rank writes `universal/rank-NNNNN.pt`: for each trainable
parameter it holds a piece of, that piece of the flattened fp32 master weight and of each optimizer
moment (exp_avg, exp_avg_sq), with the piece's offset in the whole parameter, plus the optimizer's
step count and the fp16 loss scaler. As torch.distributed.checkpoint does, the save copies only
what the rank has (no collective, nothing gathered), and the load reshards: each rank of the new
world reads the pieces from every old rank's file (memory-mapped, one parameter at a time),
assembles the parameter and keeps the part its own ZeRO partition owns. DeepSpeed's universal
checkpoint does the same offline (ds_to_universal: per-parameter files of fp32, exp_avg and
exp_avg_sq); this one is written with every checkpoint, so a resize needs no conversion step.

A resume on the world size that wrote the checkpoint still loads DeepSpeed's files, which gives
back the very same partitions bit for bit; this module is only the path across world sizes.
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any

from jobgen.errors import UserError

FORMAT = 1
DIRECTORY = "universal"


def shard_path(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, DIRECTORY, f"rank-{rank:05d}.pt")


def _trainable(engine: Any) -> list:
    """[(name, parameter)] that train, found once per engine: walking the model's modules took
    milliseconds of every peer snapshot's pause, and which parameters train does not change."""
    if engine not in _TRAINABLE:
        _TRAINABLE[engine] = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    return _TRAINABLE[engine]


_TRAINABLE: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _state_keys(engine: Any) -> list[str]:
    """The optimizer's per-element states (exp_avg, exp_avg_sq for Adam): its tensors of one dimension."""
    import torch

    for state in engine.optimizer.optimizer.state.values():
        return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1)
    return []


def local_shard(engine: Any, rank: int) -> dict:
    """This rank's pieces of the trainable state, copied to host memory (training may go on)."""
    import deepspeed.utils as dsu

    keys = _state_keys(engine)
    params: dict = {}
    for name, p in _trainable(engine):
        if hasattr(p, "ds_id"):  # ZeRO-3: this rank owns [rank x part, (rank + 1) x part) of the flat parameter
            part, numel = p.ds_tensor.ds_numel, p.ds_numel
            start = rank * part
            length = max(0, min(part, numel - start))  # the last partition is padded
            if length == 0:
                continue
            pieces = {"fp32": dsu.safe_get_local_fp32_param(p)}
            pieces.update({k: dsu.safe_get_local_optimizer_state(p, k) for k in keys})
            shape = list(p.ds_shape)
        else:  # ZeRO-1/2: a fragment of the parameter, or none of it
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            start, length = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
            pieces = {"fp32": mapping.get_hp_fragment()}
            pieces.update({k: mapping.get_hp_fragment(k) for k in keys})
            shape = list(p.shape)
        entry: dict = {"shape": shape, "start": start}
        for key, value in pieces.items():
            # A compact copy: saving a view would write the whole flat buffer it is cut from.
            entry[key] = value.detach().flatten()[:length].to("cpu", copy=True)
        params[name] = entry
    return {
        "format": FORMAT,
        "params": params,
        "state_keys": keys,
        "optimizer_step": _optimizer_step(engine),
        "loss_scaler": _loss_scaler_state(engine),
    }


def _optimizer_step(engine: Any) -> float:
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            return float(state["step"])
    for group in engine.optimizer.optimizer.param_groups:
        return float(group.get("step", 0))
    return 0.0


def _materialize_states(engine: Any, keys: list[str]) -> None:
    """Before its first step the optimizer has no states (torch's Adam makes them lazily, and
    DeepSpeed's load makes them from its own files): make them as Adam would, zeros and step 0,
    so that the loaded values have somewhere to go, and point ZeRO-1/2's per-parameter views
    (its `_hp_mapping` fragments) at them, as its own checkpoint load does."""
    import torch

    base = engine.optimizer.optimizer
    # ZeRO-3 hands its flat fp32 partitions to the optimizer only for the length of a step.
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None:
        flats = [flat for group in base.param_groups for flat in group["params"]]
    by_storage = {}
    for flat in flats:
        state = base.state[flat]
        if keys and not all(k in state for k in keys):
            state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
            for key in keys:
                state.setdefault(key, torch.zeros_like(flat, memory_format=torch.preserve_format))
        by_storage[flat.untyped_storage().data_ptr()] = flat
    for _, p in _trainable(engine):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None and not hasattr(p, "ds_id"):
            flat = by_storage[mapping.hp_fragment.untyped_storage().data_ptr()]
            mapping.set_optim_state_fragment(flat, base.state[flat])


def _loss_scaler_state(engine: Any) -> dict:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    if scaler is None:
        return {}
    return {k: v for k, v in vars(scaler).items() if isinstance(v, (bool, int, float))}


def _read_shards(checkpoint: str, written_by: int) -> list:
    import torch

    shards = []
    for old in range(written_by):
        path = shard_path(checkpoint, old)
        if not os.path.exists(path):
            # Every rank sees the same files, so every rank raises this same one line.
            raise UserError(f"checkpoint {os.path.basename(checkpoint)} has no {DIRECTORY}/ state of rank {old} (written "
                            f"by an older jobgen): resume it on {written_by} ranks (resources.nodes x launch.procs_per_node)")
        shards.append(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return shards


def _assemble(checkpoint: str, shards: list, name: str, keys: list[str]) -> dict:
    """The whole flattened fp32 weight of parameter `name` (and each of `keys`), from its pieces."""
    import torch

    found = [s["params"][name] for s in shards if name in s["params"]]
    if not found:
        raise RuntimeError(f"{checkpoint} holds no state for parameter {name}")
    numel = math.prod(found[0]["shape"])
    full = {key: torch.zeros(numel, dtype=torch.float32) for key in ["fp32", *keys]}
    covered = 0
    for piece in found:
        length = piece["fp32"].numel()
        for key in full:
            full[key][piece["start"] : piece["start"] + length] = piece[key]
        covered += length
    if covered != numel:
        raise RuntimeError(f"{checkpoint}: the pieces of {name} cover {covered} of its {numel} elements")
    return full


def _place(p: Any, full: dict, keys: list[str], rank: int) -> None:
    """Set this rank's share of parameter `p` from its whole flattened fp32 tensors in `full`."""
    import torch
    import deepspeed.utils as dsu

    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's padded partition
        part = p.ds_tensor.ds_numel
        for key, value in full.items():
            local = torch.zeros(part, dtype=torch.float32)
            mine = value[rank * part : (rank + 1) * part]
            local[: mine.numel()] = mine
            local = local.to(p.ds_tensor.device)
            if key == "fp32":
                dsu.safe_set_local_fp32_param(p, local)
                p.ds_tensor.data.copy_(local.to(p.ds_tensor.dtype))
            else:
                dsu.safe_set_local_optimizer_state(p, local, key)
    else:  # ZeRO-1/2: every rank holds the whole 16-bit parameter and a fragment of the rest
        device = p.device
        if getattr(p, "_hp_mapping", None) is not None:
            dsu.safe_set_full_fp32_param(p, full["fp32"].to(device))
            for key in keys:
                dsu.safe_set_full_optimizer_state(p, full[key].to(device), key)
        p.data.copy_(full["fp32"].view(p.shape).to(device=device, dtype=p.dtype))


def load(engine: Any, checkpoint: str, written_by: int, rank: int, world_size: int) -> None:
    """Collective-free: set this rank's partitions of the fp32 weights, the optimizer moments and
    step, and its 16-bit weights, from the pieces `written_by` ranks left in `checkpoint`."""
    import torch

    shards = _read_shards(checkpoint, written_by)
    keys = shards[0]["state_keys"]
    _materialize_states(engine, keys)
    for name, p in _trainable(engine):
        _place(p, _assemble(checkpoint, shards, name, keys), keys, rank)
    step = shards[0]["optimizer_step"]
    for state in engine.optimizer.optimizer.state.values():
        state["step"] = torch.full_like(state["step"], step)
    for group in engine.optimizer.optimizer.param_groups:
        if "step" in group:  # optimizers that count per group (DeepSpeed's FusedAdam)
            group["step"] = int(step)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in shards[0]["loss_scaler"].items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


def load_weights(engine: Any, checkpoint: str, written_by: int, rank: int) -> None:
    """Collective-free: the trainable weights only (training.init_from), from any world size; the
    optimizer and its step stay as they are."""
    shards = _read_shards(checkpoint, written_by)
    set_weights(engine, {name: _assemble(checkpoint, shards, name, [])["fp32"] for name, _ in _trainable(engine)}, rank)


def set_weights(engine: Any, weights: dict, rank: int) -> None:
    """Set each trainable parameter from `weights` (name: its whole tensor, any float dtype);
    UserError when a tensor has another number of elements (another LoRA shape or model)."""
    for name, p in _trainable(engine):
        value = weights[name].detach().flatten().float()
        numel = math.prod(p.ds_shape) if hasattr(p, "ds_id") else p.numel()
        if value.numel() != numel:
            raise UserError(f"training.init_from: {name} has {value.numel()} weights there and {numel} in this job; "
                            f"give weights of the same model and LoRA settings")
        _place(p, {"fp32": value}, [], rank)
