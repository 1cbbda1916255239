"""Rank, world, device and the few collectives the trainer needs, from torchrun's environment.

The job decides the device, not the host: `resources.gpus_per_node > 0` is nccl on
cuda:LOCAL_RANK, and a host where CUDA is unusable is an error, not a silent CPU run; 0 is gloo on
the CPU with the GPUs hidden, so a CPU job on a GPU host touches no GPU. Everything else in the
trainer is the same code on both. The process group gets the job's timeout
(`launch.collective_timeout_minutes`) so a rank that dies cannot leave the others waiting forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from jobgen.errors import UserError

@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> "RankInfo":
        try:
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            world_size = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError as exc:
            raise UserError(f"RANK/LOCAL_RANK/WORLD_SIZE must be integers ({exc})") from None
        return cls(rank, local_rank, world_size)


@dataclass(frozen=True)
class Placement:
    """Where this rank computes: chosen by `place` before torch touches CUDA or DeepSpeed loads."""

    cuda: bool
    local_rank: int

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    @property
    def device(self) -> Any:
        import torch

        return torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")


def place(gpus_per_node: int, local_rank: int, precision: str) -> Placement:
    """The device the job asked for on this rank, or a UserError that says why it cannot have it.

    Call before anything initialises CUDA: it sets the variables CUDA and DeepSpeed read once.
    """
    if gpus_per_node == 0:
        # Hidden, so that neither torch, DeepSpeed nor bitsandbytes picks a GPU of this host.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["DS_ACCELERATOR"] = "cpu"
        return Placement(cuda=False, local_rank=local_rank)
    # Every batch has another shape: without this the caching allocator fragments and a long run
    # can fail out of memory with gigabytes reserved but unused.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    os.environ["DS_ACCELERATOR"] = "cuda"
    import socket

    import torch

    host = socket.gethostname()
    if not torch.cuda.is_available():
        built = f"torch {torch.__version__}, " + (f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build")
        raise UserError(
            f"resources.gpus_per_node is {gpus_per_node} but CUDA is not usable on {host} ({built}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): install the torch for "
            f"this site's CUDA, or set gpus_per_node: 0 and launch.procs_per_node for a CPU run"
        )
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(
            f"LOCAL_RANK {local_rank} but {host} shows {count} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}): resources.gpus_per_node ({gpus_per_node}) is more than it has"
        )
    torch.cuda.set_device(local_rank)
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"training.precision bf16 needs a GPU with bf16 (compute capability 8.0 or newer); {host} has "
            f"{torch.cuda.get_device_name(local_rank)}: use fp16"
        )
    if precision == "fp32":
        # TF32 matmuls: the speed users of fp32 on Ampere and newer expect, as most trainers default to.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Placement(cuda=True, local_rank=local_rank)


def skip_shared_memory_op(deepspeed: Any) -> None:
    """On the CPU, DeepSpeed's process group JIT-builds a shared-memory C++ op on every start, for
    inference all-reduces only (training reduces through torch.distributed). Its build is one to
    three minutes on a busy 2-CPU node, and torch's extension cache rebuilds it whenever another
    process built it with other flags: marked incompatible, it is never built."""
    compatible = deepspeed.ops.__compatible_ops__
    compatible["deepspeed_shm_comm"] = False


class Distributed:
    """An initialized process group (also for a single process without torchrun) whose every
    collective fails after `timeout_minutes` (the job's launch.collective_timeout_minutes)."""

    def __init__(self, info: RankInfo, placement: Placement, timeout_minutes: float) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.local_rank, self.world_size = info.rank, info.local_rank, info.world_size
        self.cuda, self.backend, self.device = placement.cuda, placement.backend, placement.device
        self.timeout = timedelta(minutes=timeout_minutes)  # also for the groups made later (background saves)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        import deepspeed

        if not self.cuda:
            skip_shared_memory_op(deepspeed)
        # deepspeed.comm wraps torch.distributed; initializing through it keeps both views the same.
        deepspeed.init_distributed(dist_backend=self.backend, timeout=self.timeout, auto_mpi_discovery=False)
        self._dist = dist
        self._torch = torch

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        self._dist.barrier()

    def all_gather_object(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, value)
        return out

    def broadcast_object(self, value: Any) -> Any:
        box = [value]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_floats(self, values: list[float]) -> list[list[float]]:
        """One collective: every rank's `values` (same length everywhere)."""
        torch = self._torch
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        self._dist.all_gather(out, local)
        return [t.tolist() for t in out]

    def raise_together(self, error: BaseException | None) -> None:
        """Collective: if any rank has an error, every rank raises (its own, or a pointer to rank N's)."""
        errors = self.all_gather_object(None if error is None else (isinstance(error, UserError), str(error)))
        if error is not None:
            raise error
        for rank, entry in enumerate(errors):
            if entry is not None:
                is_user_error, message = entry
                raise (UserError if is_user_error else RuntimeError)(f"rank {rank} failed: {message}")

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()
