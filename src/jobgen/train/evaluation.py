"""Evaluation: the token-weighted loss of a held-out set over all ranks, every eval_interval steps.

The eval set is `training.eval_data`, or `training.eval_fraction` of the training data held out
by seed (split_eval: a function of the data and the seed alone, so a resumed run holds out the
same conversations). Rank r evaluates conversations r, r + world, ...; every rank runs the same
number of forward passes (a rank out of conversations runs one with weight 0), as ZeRO-3 gathers
parameters in each. The loss is sum(loss x tokens) / sum(tokens) over all ranks, as in training,
and the perplexity its exp. Evaluation runs without dropout and draws no random numbers, so it
leaves exact resume as it was.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Sequence

from jobgen.job.conversations import Conversation
from jobgen.train.data import TokenizedDataset


def split_eval(conversations: Sequence[Conversation], fraction: float, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """(train, eval): `fraction` of the conversations (at least one, rounded up) held out by `seed`."""
    count = max(1, math.ceil(len(conversations) * fraction))
    if count >= len(conversations):
        from jobgen.errors import UserError

        raise UserError(f"training.eval_fraction: {fraction} of {len(conversations)} conversations leaves none to train on")
    held = set(random.Random(seed).sample(range(len(conversations)), count))
    return ([c for i, c in enumerate(conversations) if i not in held], [c for i, c in enumerate(conversations) if i in held])


class Evaluation:
    def __init__(self, dataset: TokenizedDataset, world_size: int, rank: int, micro: int) -> None:
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
