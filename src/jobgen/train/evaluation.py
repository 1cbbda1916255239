"""Evaluation: the token-weighted loss of a held-out set over all ranks, every eval_interval steps.

The eval set is `training.eval_data`, or `training.eval_fraction` of the training data held out
by seed. Both are in the prepared store (jobgen.train.store), tokenized once by its preparer and
mapped by every rank: no rank reads a data file. The split is a decision per record, on its index
in the data and the seed alone (`held_out`): it needs neither the whole data set nor its size, so
it works on a stream of records, and a resumed run, on any number of ranks, holds out the same
conversations. Each record is held out with chance `fraction`, so the held-out count is about,
not exactly, fraction x records.

Rank r evaluates conversations r, r + world, ...; every rank runs the same number of forward
passes (a rank out of conversations runs one with weight 0), as ZeRO-3 gathers parameters in
each. The loss is sum(loss x tokens) / sum(tokens) over all ranks, as in training, and the
perplexity its exp. Evaluation runs without dropout and draws no random numbers, so it leaves
exact resume as it was.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jobgen.train.data import TokenDataset

_MASK64 = (1 << 64) - 1


def held_out_mask(first: int, count: int, fraction: float, seed: int) -> Any:
    """Whether records first, ..., first + count - 1 are held out: a boolean numpy array.
    A record is held out when a hash of (seed, index) (splitmix64, twice) falls below `fraction`."""
    import numpy as np

    indices = np.arange(first, first + count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))[0]
        mixed = _splitmix64(indices ^ key)
    return (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53)) < fraction


def held_out(index: int, fraction: float, seed: int) -> bool:
    """Whether the record at `index` of the data (0-based, over every file in order) is held out."""
    return bool(held_out_mask(index, 1, fraction, seed)[0])


def _splitmix64(values: Any) -> Any:
    """splitmix64's finalizer on a uint64 array (wrapping: the caller ignores numpy's overflow)."""
    import numpy as np

    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


class Evaluation:
    def __init__(self, dataset: TokenDataset, world_size: int, rank: int, micro: int) -> None:
        self.dataset = dataset
        self.mine = list(range(rank, len(dataset), world_size))
        self.micro = micro
        self.rounds = math.ceil(math.ceil(len(dataset) / world_size) / micro)

    def run(self, engine: Any, dist: Any, loss_sum: Callable[[Any, dict], Any], on_round: Callable[[int], None]) -> dict:
        """Collective: {"eval_loss", "eval_perplexity", "eval_tokens"} over every rank. `on_round`
        is called before each forward pass (the trainer's heartbeat: an eval is progress)."""
        import torch

        engine.eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            for round_ in range(self.rounds):
                on_round(round_)
                indices = self.mine[round_ * self.micro:(round_ + 1) * self.micro]
                cpu_batch = self.dataset.collate(indices or [0])
                batch = {k: v.to(dist.device) for k, v in cpu_batch.items()}
                value = float(loss_sum(engine, batch))
                if indices:
                    total += value
                    tokens += int((cpu_batch["labels"][:, 1:] != -100).sum())
        engine.train()
        rows = dist.all_gather_floats([total, float(tokens)])
        summed, counted = sum(row[0] for row in rows), sum(row[1] for row in rows)
        loss = summed / max(counted, 1.0)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0)), "eval_tokens": int(counted)}
