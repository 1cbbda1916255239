"""Rank, world, device and the few collectives the trainer needs, from torchrun's environment.

CUDA available: backend nccl, device cuda:LOCAL_RANK. Otherwise: gloo and the CPU. Everything else
in the trainer is the same code on both. The process group gets a timeout
(`JOBGEN_PG_TIMEOUT_MINUTES`, default 30) so a rank that dies cannot leave the others waiting
forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from jobgen.train.errors import UserError

DEFAULT_TIMEOUT_MINUTES = 30.0


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


def pg_timeout() -> timedelta:
    raw = os.environ.get("JOBGEN_PG_TIMEOUT_MINUTES", str(DEFAULT_TIMEOUT_MINUTES))
    try:
        minutes = float(raw)
        if minutes <= 0:
            raise ValueError
    except ValueError:
        raise UserError(f"JOBGEN_PG_TIMEOUT_MINUTES is {raw!r}; expected a positive number of minutes") from None
    return timedelta(minutes=minutes)


class Distributed:
    """An initialized process group (also for a single process without torchrun)."""

    def __init__(self, info: RankInfo) -> None:
        import torch
        import torch.distributed as dist

        self.rank, self.local_rank, self.world_size = info.rank, info.local_rank, info.world_size
        self.cuda = torch.cuda.is_available()
        self.backend = "nccl" if self.cuda else "gloo"
        if self.cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", str(self.rank))
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        os.environ.setdefault("WORLD_SIZE", str(self.world_size))
        import deepspeed

        # deepspeed.comm wraps torch.distributed; initializing through it keeps both views the same.
        deepspeed.init_distributed(dist_backend=self.backend, timeout=pg_timeout(), auto_mpi_discovery=False)
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
