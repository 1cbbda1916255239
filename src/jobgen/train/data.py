"""Conversations: chat-template tokenization and the per-rank batch order.

Reading and checking the file is jobgen.job.conversations' (the login node's checks use it too).

Layout (the reference Qwen fine-tune's): `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per turn, with a
system turn first ("You are a helpful assistant." unless the item gives one). Labels are -100
everywhere except on assistant turns, where `<|im_start|>`, the content, `<|im_end|>` and the
newline after it are learned (the role name is not). Sequences are cut to `max_length`.

Order: `torch.utils.data.DistributedSampler` over the global world size (shuffled with the job's
seed, `set_epoch(epoch)` every epoch, padded by repetition so every rank gets the same count),
cut into micro-batches; with `group_by_length`, each rank's indices are grouped into megabatches
sorted by length, in an order that depends only on seed, epoch and rank. The order is a pure
function of (epoch, batch index), which is what makes exact resume possible.

Packing (`training.packing`): the conversations are packed once into rows of at most
`max_length` tokens (best-fit decreasing, ties broken by the seed), and the same order is then
taken over rows instead of conversations, so a row holds the same conversations every epoch and
every conversation is in exactly one row. Within a row the position ids restart at 0 for each
conversation and no attention mask is passed: transformers reads the boundaries from the
position ids (a block-diagonal causal mask with eager or SDPA attention, the variable-length
kernel with flash_attention_2), so no token attends across a boundary and the loss and its
gradients are those of the conversations trained unpacked.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jobgen.job.conversations import Conversation

IGNORE_INDEX = -100
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatTokenizer:
    """Turns a Conversation into (input_ids, labels) with the layout in the module docstring."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.im_start = self._marker(IM_START)
        self.im_end = self._marker(IM_END)
        self.newline = self._encode("\n")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _marker(self, text: str) -> list[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id and token_id >= 0:
            return [token_id]
        return self._encode(text)  # a tokenizer without chat tokens spells the marker out

    def __call__(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        labels: list[int] = []
        for role, text in (("system", conversation.system),) + conversation.turns:
            header = self._encode(role + "\n")
            content = self._encode(text)
            turn = self.im_start + header + content + self.im_end + self.newline
            ids += turn
            if role == "assistant":
                labels += self.im_start + [IGNORE_INDEX] * len(header) + content + self.im_end + self.newline
            else:
                labels += [IGNORE_INDEX] * len(turn)
        return ids[: self.max_length], labels[: self.max_length]


class TokenizedDataset:
    """Every conversation tokenized once, up front (lengths are needed for grouping anyway)."""

    def __init__(self, conversations: Sequence[Conversation], chat: ChatTokenizer, pad_id: int) -> None:
        self.ids = [c.id for c in conversations]
        encoded = [chat(c) for c in conversations]
        self.input_ids = [e[0] for e in encoded]
        self.labels = [e[1] for e in encoded]
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def tokens(self, indices: Sequence[int]) -> int:
        """Tokens that are not padding in a batch of these samples."""
        return sum(len(self.input_ids[i]) for i in indices)

    def collate(self, indices: Sequence[int]) -> dict:
        """Right-padded tensors: input_ids, attention_mask, labels (-100 on padding)."""
        import torch

        width = max(len(self.input_ids[i]) for i in indices)
        input_ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            n = len(self.input_ids[i])
            input_ids[row, :n] = torch.tensor(self.input_ids[i])
            labels[row, :n] = torch.tensor(self.labels[i])
            attention[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    def collate_packed(self, rows: Sequence[Sequence[int]]) -> dict:
        """Each row the concatenation of its samples, right-padded to the longest row: input_ids,
        labels and position_ids, which restart at 0 for every sample and again for the padding. No
        attention_mask, so transformers isolates the samples (module docstring). The first label of
        each sample is -100: the token before it, another sample's last, must not learn to predict it."""
        import torch

        width = max(sum(len(self.input_ids[i]) for i in row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n = len(self.input_ids[i])
                input_ids[r, start:start + n] = torch.tensor(self.input_ids[i])
                labels[r, start + 1:start + n] = torch.tensor(self.labels[i][1:])
                positions[r, start:start + n] = torch.arange(n)
                start += n
            positions[r, start:] = torch.arange(width - start)
        return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


def pack_rows(lengths: Sequence[int], capacity: int, seed: int, world_size: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most `capacity` tokens, a pure function of the
    arguments. Best-fit decreasing: longest first, each into the fullest row it still fits, which
    leaves rows nearly full. Rows holding several samples are then split until the row count is a
    multiple of `world_size`, so the sampler needs no repeated row and every sample is trained on
    once per epoch (unless every row is a single sample)."""
    import random

    shuffled = list(range(len(lengths)))
    random.Random(seed).shuffle(shuffled)  # which equal-length samples share a row
    tie = {index: position for position, index in enumerate(shuffled)}
    rows: list[list[int]] = []
    free = _FreeSpace(capacity)  # rows by their free tokens
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], tie[i])):
        need = max(1, lengths[index])
        space = free.smallest_at_least(need)
        if space is None:
            rows.append([index])
            free.add(capacity - need, len(rows) - 1)
        else:
            row = free.pop(space)
            rows[row].append(index)
            free.add(space - need, row)
    while len(rows) % world_size:
        row = max(range(len(rows)), key=lambda r: (len(rows[r]), -r))
        if len(rows[row]) < 2:
            break
        rows.append([rows[row].pop()])
    return rows


class _FreeSpace:
    """Rows by free tokens (0..capacity), with the smallest free space >= n found in O(log capacity)."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << (capacity + 1).bit_length()
        self.count = [0] * (2 * self.size)  # a segment tree of how many rows have each free space
        self.rows: dict[int, list[int]] = {}

    def add(self, space: int, row: int) -> None:
        self.rows.setdefault(space, []).append(row)
        self._update(space, 1)

    def pop(self, space: int) -> int:
        self._update(space, -1)
        return self.rows[space].pop()

    def _update(self, space: int, delta: int) -> None:
        node = space + self.size
        while node:
            self.count[node] += delta
            node //= 2

    def smallest_at_least(self, need: int) -> Optional[int]:
        node, lo, hi = 1, 0, self.size
        return self._find(node, lo, hi, need)

    def _find(self, node: int, lo: int, hi: int, need: int) -> Optional[int]:
        if hi <= need or not self.count[node]:
            return None
        if hi - lo == 1:
            return lo
        mid = (lo + hi) // 2
        found = self._find(2 * node, lo, mid, need)
        return found if found is not None else self._find(2 * node + 1, mid, hi, need)


class BatchOrder:
    """Micro-batches of sample indices for one rank, as a pure function of (epoch, batch index)."""

    MEGABATCH = 50  # micro-batches per length-sorted group, as in transformers' LengthGroupedSampler

    def __init__(
        self,
        num_samples: int,
        world_size: int,
        rank: int,
        batch_size: int,
        seed: int,
        lengths: Optional[Sequence[int]] = None,
    ) -> None:
        self.num_samples, self.world_size, self.rank = num_samples, world_size, rank
        self.batch_size, self.seed = batch_size, seed
        self.lengths = lengths  # None: no length grouping
        self.per_rank = -(-num_samples // world_size)  # DistributedSampler pads to this
        self.batches_per_epoch = -(-self.per_rank // batch_size)
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._cached and self._cached[0] == epoch:
            return self._cached[1]
        import torch
        from torch.utils.data import DistributedSampler

        sampler = DistributedSampler(
            range(self.num_samples), num_replicas=self.world_size, rank=self.rank, shuffle=True, seed=self.seed
        )
        sampler.set_epoch(epoch)
        indices = list(sampler)
        if self.lengths is not None:
            indices = self._group_by_length(indices, epoch, torch)
        batches = [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        self._cached = (epoch, batches)
        return batches

    def _group_by_length(self, indices: list[int], epoch: int, torch: Any) -> list[int]:
        size = self.MEGABATCH * self.batch_size
        groups = [indices[i : i + size] for i in range(0, len(indices), size)]
        groups = [sorted(g, key=lambda i: -self.lengths[i]) for g in groups]
        # Shuffle micro-batches (not samples) so that long batches do not always come first; the
        # same permutation on every rank keeps similar lengths in step across ranks.
        batches = [g[i : i + self.batch_size] for g in groups for i in range(0, len(g), self.batch_size)]
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(batches), generator=generator).tolist()
        return [i for b in order for i in batches[b]]

    def batch(self, epoch: int, index: int) -> list[int]:
        return self.epoch_batches(epoch)[index]


class MicroBatches:
    """One rank's micro-batch at (epoch, index): the samples in it and their tensors. The order is
    a BatchOrder over samples, or over packed rows when `rows` is given."""

    def __init__(self, dataset: TokenizedDataset, order: BatchOrder, rows: Optional[list[list[int]]] = None) -> None:
        self.dataset, self.order, self.rows = dataset, order, rows

    @classmethod
    def build(cls, dataset: TokenizedDataset, world_size: int, rank: int, batch_size: int, seed: int,
              group_by_length: bool, packing_capacity: Optional[int]) -> "MicroBatches":
        lengths = dataset.lengths
        rows = None
        if packing_capacity is not None:
            rows = pack_rows(lengths, packing_capacity, seed, world_size)
            lengths = [sum(lengths[i] for i in row) for row in rows]
        order = BatchOrder(len(lengths), world_size, rank, batch_size, seed, lengths if group_by_length else None)
        return cls(dataset, order, rows)

    @property
    def batches_per_epoch(self) -> int:
        return self.order.batches_per_epoch

    def samples(self, epoch: int, index: int) -> list[int]:
        units = self.order.batch(epoch, index)
        return units if self.rows is None else [i for u in units for i in self.rows[u]]

    def collate(self, epoch: int, index: int) -> dict:
        units = self.order.batch(epoch, index)
        if self.rows is None:
            return self.dataset.collate(units)
        return self.dataset.collate_packed([self.rows[u] for u in units])
