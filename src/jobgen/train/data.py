"""Conversations: chat-template tokenization and the per-rank batch order.

Reading and checking the file is jobgen.job.conversations' (the login node's checks use it too).

ChatTokenizer is the one place a conversation becomes (input_ids, labels), a pure function of the
conversation, the tokenizer, `max_length` and its `chat_template` attribute (what
`training.chat_template` resolved to; jobgen.train.chat_template). Labels are -100 except on what
the model learns to say; sequences are cut to `max_length`.
- A Jinja template (the tokenizer's own, or a file): the ids are apply_chat_template's, and the
  learned tokens are the assistant's part as the template writes it (its content and end-of-turn);
  system and user turns, the role headers and assistant messages of weight 0 are not learned. A conversation whose assistant part
  cannot be found exactly is a UserError naming the model and what to set instead.
  Tools (jobgen.job.conversations): the ids are apply_chat_template(messages, tools=...)'s; the
  assistant's tool calls are learned like its words, the tool results and the tool definitions
  are not. A template that renders a conversation the same with and without its tool calls,
  results or definitions drops them: that is a UserError naming the record, never a silent loss.
- ChatML (the reference Qwen fine-tune's layout): `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n` per
  turn, with a system turn first ("You are a helpful assistant." unless the item gives one); on
  assistant turns `<|im_start|>`, the content, `<|im_end|>` and the newline after it are learned
  (the role name is not). ChatML has no tool syntax: a conversation with tools is a UserError
  naming the record and the template to set instead.

Order: the samples of every optimizer step are a function of (seed, epoch, step) and the global
batch alone, never of the world size, so a run resumed on another number of ranks trains each
step on the same samples (jobgen/train/checkpoint.py carries the rest of the state across). Each
epoch is one permutation of the data (seed + epoch); step k of it takes the next `global_batch`
units of it, and the last step of an epoch takes what is left (every sample once per epoch, none
repeated to fill it). With `group_by_length` the permutation is cut into megabatches of 50 steps,
each sorted by length, and the order of the whole steps is shuffled (seed, epoch), as transformers'
LengthGroupedSampler does per rank. A world size then only splits a step: micro-batch j of the
step (j = accumulation index x world size + rank) is its j-th run of `micro` units, so the ranks'
micro-batches in one accumulation round hold neighbouring lengths. Exact resume on any world
size needs nothing but the step number.

Packing (`training.packing`): the conversations are packed once into rows of at most
`max_length` tokens (best-fit decreasing, ties broken by the seed), and the same order is then
taken over rows instead of conversations, so a row holds the same conversations every epoch and
every conversation is in exactly one row. The packing does not depend on the world size either. Within a row the position ids restart at 0 for each
conversation and no attention mask is passed: transformers reads the boundaries from the
position ids (a block-diagonal causal mask with eager or SDPA attention, the variable-length
kernel with flash_attention_2), so no token attends across a boundary and the loss and its
gradients are those of the conversations trained unpacked.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from jobgen.errors import UserError
from jobgen.job.conversations import DEFAULT_SYSTEM_PROMPT, Conversation, Sample, no_tools_in
from jobgen.job.record_formats import IGNORE_INDEX
from jobgen.train.chat_template import (
    CHATML, NotExact, has_generation_marks, marked_spans, render, rendered_spans, resolve_template,
)

RENDERS_TOOLS = "a Jinja file that renders tools (the model family's own, as Llama 3.1 and Qwen 2.5 publish theirs)"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatTokenizer:
    """Turns a Conversation into (input_ids, labels) with the layout in the module docstring.

    `chat_template` is what the layout resolved to: chat_template.CHATML, or the Jinja text that
    renders every conversation (a cache of the results is valid while it, the tokenizer and
    `max_length` are unchanged). `template_name` says where it came from, for log lines."""

    def __init__(self, tokenizer: Any, max_length: int, chat_template: Optional[str] = None, model: str = "the model") -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.model = model
        self.chat_template, self.template_name = resolve_template(tokenizer, chat_template, model)
        self.generation_marks = self.chat_template != CHATML and has_generation_marks(self.chat_template)
        self.setting = chat_template
        if self.chat_template == CHATML:
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
        ids, labels = self.uncut(conversation)
        return ids[: self.max_length], labels[: self.max_length]

    def uncut(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        """(input_ids, labels) before the cut to max_length."""
        if self.chat_template == CHATML:
            return self._chatml(conversation)
        ids, learned = self._templated(conversation)
        return ids, [token if keep else IGNORE_INDEX for token, keep in zip(ids, learned)]

    def refuse_tools_in_chatml(self, conversation: Conversation) -> None:
        if conversation.uses_tools:
            raise UserError(no_tools_in(self.template_name, f"conversation {conversation.id!r}"))

    def _chatml(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        self.refuse_tools_in_chatml(conversation)
        ids: list[int] = []
        labels: list[int] = []
        system = DEFAULT_SYSTEM_PROMPT if conversation.system is None else conversation.system
        for position, (role, text) in enumerate((("system", system),) + conversation.turns):
            header = self._encode(role + "\n")
            content = self._encode(text)
            turn = self.im_start + header + content + self.im_end + self.newline
            ids += turn
            if role == "assistant" and position - 1 not in conversation.unlearned:  # turns follow the system turn
                labels += self.im_start + [IGNORE_INDEX] * len(header) + content + self.im_end + self.newline
            else:
                labels += [IGNORE_INDEX] * len(turn)
        return ids, labels

    def _templated(self, conversation: Conversation) -> tuple[list[int], list[bool]]:
        messages = conversation.messages()
        first = len(messages) - len(conversation.turns)  # 1 where a system message leads
        skip = {index + first for index in conversation.unlearned}  # weight-0 messages
        tools = conversation.tool_definitions()
        where = f"conversation {conversation.id!r}"
        try:
            if conversation.uses_tools:
                self._check_tools_written(where, messages, tools)
            if self.generation_marks:
                return marked_spans(self.tokenizer, self.chat_template, messages, skip, tools)
            return rendered_spans(self.tokenizer, self.chat_template, messages, skip, tools)
        except UserError:
            raise
        except NotExact as exc:
            raise UserError(
                f"training.chat_template: {where}: the assistant's part cannot be found exactly in "
                f"{self.template_name} ({exc}); set training.chat_template: chatml, or a Jinja file whose assistant "
                "part is marked with {% generation %}"
            ) from None
        except Exception as exc:  # the template's own raise_exception, or a template error
            fix = ("" if self.setting == CHATML else "; set training.chat_template: chatml to train it in ChatML")
            if conversation.uses_tools:  # ChatML has no tools either
                fix = f"; set training.chat_template to {RENDERS_TOOLS}"
            raise UserError(f"training.chat_template: {where}: {self.template_name} refuses it: {_first_line(exc)}{fix}") from None

    def _check_tools_written(self, where: str, messages: list[dict], tools: Optional[list]) -> None:
        """UserError where the template writes the conversation the same without its tool
        definitions, calls or results: it drops them, and the model would learn without them."""
        whole = render(self.tokenizer, self.chat_template, messages, tools=tools)
        without = {
            "tool definitions": (messages, None) if tools else None,
            "tool calls": ([{k: v for k, v in m.items() if k != "tool_calls"} for m in messages], tools)
            if any("tool_calls" in m for m in messages) else None,
            "tool results": ([m for m in messages if m["role"] != "tool"], tools)
            if any(m["role"] == "tool" for m in messages) else None,
        }
        for what, reduced in without.items():
            if reduced is not None and render(self.tokenizer, self.chat_template, reduced[0], tools=reduced[1]) == whole:
                raise UserError(
                    f"training.chat_template: {where} has {what}, and {self.template_name} drops them (it writes the "
                    f"conversation the same without them); set training.chat_template to {RENDERS_TOOLS}"
                )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class TokenDataset:
    """What batching needs of tokenized conversations, however they are held: `ids` (each
    conversation's id), `lengths`, `label_counts` (tokens each sample is trained on: labels after
    the first, as position t predicts t+1 and a packed row masks each sample's first label, which
    the unpacked shift drops too), `pad_id`, and `sample(i)` -> (input_ids, labels)."""

    ids: Sequence[str]
    label_counts: Sequence[int]
    pad_id: int

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def lengths(self) -> list[int]:
        raise NotImplementedError

    def sample(self, index: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def tokens(self, indices: Sequence[int]) -> int:
        """Tokens that are not padding in a batch of these samples."""
        lengths = self.lengths
        return sum(lengths[i] for i in indices)

    def collate(self, indices: Sequence[int]) -> dict:
        """Right-padded tensors: input_ids, attention_mask, labels (-100 on padding)."""
        import torch

        lengths = self.lengths
        width = max(lengths[i] for i in indices)
        input_ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
        attention = torch.zeros((len(indices), width), dtype=torch.long)
        for row, i in enumerate(indices):
            n = lengths[i]
            ids, labelled = self.sample(i)
            input_ids[row, :n] = torch.as_tensor(ids)
            labels[row, :n] = torch.as_tensor(labelled)
            attention[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention, "labels": labels}

    def collate_packed(self, rows: Sequence[Sequence[int]]) -> dict:
        """Each row the concatenation of its samples, right-padded to the longest row: input_ids,
        labels and position_ids, which restart at 0 for every sample and again for the padding. No
        attention_mask, so transformers isolates the samples (module docstring). The first label of
        each sample is -100: the token before it, another sample's last, must not learn to predict it."""
        import torch

        lengths = self.lengths
        width = max(sum(lengths[i] for i in row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for i in row:
                n = lengths[i]
                ids, labelled = self.sample(i)
                input_ids[r, start:start + n] = torch.as_tensor(ids)
                labels[r, start + 1:start + n] = torch.as_tensor(labelled[1:])
                positions[r, start:start + n] = torch.arange(n)
                start += n
            positions[r, start:] = torch.arange(width - start)
        return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


class TokenizedDataset(TokenDataset):
    """Every conversation tokenized in this process, held in lists: the reference the prepared
    store (jobgen.train.store) is checked against, and small data in tests."""

    def __init__(self, conversations: Sequence[Sample], chat: ChatTokenizer, pad_id: int) -> None:
        from jobgen.train.samples import pieces  # any format's samples (a long text is several)

        found = [piece for sample in conversations for piece in pieces(sample, chat)]
        self.ids = [sample_id for sample_id, _, _, _ in found]
        self.input_ids = [ids for _, ids, _, _ in found]
        self.labels = [labels for _, _, labels, _ in found]
        # Samples longer than max_length (the store counts them the same way: tests compare).
        self.cut_lengths = [length for _, _, _, length in found if length > chat.max_length]
        self.label_counts = [sum(1 for label in labels[1:] if label != IGNORE_INDEX) for labels in self.labels]
        self.pad_id = pad_id
        self._lengths = [len(x) for x in self.input_ids]

    @property
    def lengths(self) -> list[int]:
        return self._lengths

    def sample(self, index: int) -> tuple[list[int], list[int]]:
        return self.input_ids[index], self.labels[index]


def pack_rows(lengths: Sequence[int], capacity: int, seed: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most `capacity` tokens, a pure function of the
    arguments (not of the world size, so a resumed run on other ranks packs the same rows).
    Best-fit decreasing: longest first, each into the fullest row it still fits, which leaves
    rows nearly full."""
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
    """The units (conversations, or packed rows) of each optimizer step, as a pure function of
    (seed, epoch, step in the epoch) and the global batch: no world size in it."""

    MEGABATCH = 50  # steps per length-sorted group, as transformers' LengthGroupedSampler groups batches

    def __init__(self, num_units: int, global_batch: int, seed: int, lengths: Optional[Sequence[int]] = None) -> None:
        self.num_units, self.global_batch, self.seed = num_units, global_batch, seed
        self.lengths = lengths  # None: no length grouping
        self.steps_per_epoch = -(-num_units // global_batch)  # the last one may be short
        self._cached: tuple[int, list[list[int]]] | None = None

    def epoch_steps(self, epoch: int) -> list[list[int]]:
        if self._cached and self._cached[0] == epoch:
            return self._cached[1]
        import torch

        generator = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's seeding
        order = torch.randperm(self.num_units, generator=generator).tolist()
        size = self.global_batch
        if self.lengths is None:
            steps = [order[i : i + size] for i in range(0, len(order), size)]
        else:
            steps = self._group_by_length(order, epoch, torch)
        self._cached = (epoch, steps)
        return steps

    def _group_by_length(self, order: list[int], epoch: int, torch: Any) -> list[list[int]]:
        size, mega = self.global_batch, self.MEGABATCH * self.global_batch
        groups = [sorted(order[i : i + mega], key=lambda u: -self.lengths[u]) for i in range(0, len(order), mega)]
        steps = [g[i : i + size] for g in groups for i in range(0, len(g), size)]
        whole = [s for s in steps if len(s) == size]
        short = [s for s in steps if len(s) < size]  # at most one, the end of the last group: kept last
        # Shuffle whole steps so that long ones do not always come first.
        shuffled = torch.randperm(len(whole), generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))
        return [whole[i] for i in shuffled.tolist()] + short

    def step(self, epoch: int, index: int) -> list[int]:
        return self.epoch_steps(epoch)[index]


def split_global_batch(global_batch: int, world_size: int, max_micro: int, procs_per_node: int = 1) -> tuple[int, int]:
    """(micro-batch, accumulation) that split `global_batch` evenly over `world_size` ranks, with
    the largest micro-batch of at most `max_micro` (training.per_device_batch_size, the memory
    bound), so the fewest accumulation rounds. Raises UserError naming the sizes that would work."""
    if global_batch % world_size:
        sizes = [w for w in range(1, global_batch + 1) if global_batch % w == 0]
        nodes = [str(w // procs_per_node) for w in sizes if w % procs_per_node == 0]
        where = (f"resources.nodes {', '.join(nodes)} at {procs_per_node} per node" if nodes
                 else f"none a multiple of {procs_per_node} processes per node")
        raise UserError(
            f"training.global_batch_size: {global_batch} samples per optimizer step cannot be split evenly over "
            f"{world_size} ranks; world sizes that divide it: {', '.join(map(str, sizes))} ({where}), or set "
            f"training.global_batch_size to a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    micro = max(d for d in range(1, min(max_micro, per_rank) + 1) if per_rank % d == 0)
    return micro, per_rank // micro


class MicroBatches:
    """One rank's share of each optimizer step: `accumulation` micro-batches of `micro` units (the
    step's last ones may be short or empty in the last step of an epoch). The units are samples,
    or packed rows when `rows` is given."""

    def __init__(self, dataset: TokenDataset, order: BatchOrder, world_size: int, rank: int, micro: int,
                 accumulation: int, rows: Optional[list[list[int]]] = None) -> None:
        assert micro * accumulation * world_size == order.global_batch
        self.dataset, self.order, self.rows = dataset, order, rows
        self.world_size, self.rank, self.micro, self.accumulation = world_size, rank, micro, accumulation

    @classmethod
    def build(cls, dataset: TokenDataset, global_batch: int, world_size: int, rank: int, micro: int,
              accumulation: int, seed: int, group_by_length: bool, packing_capacity: Optional[int],
              rows: Optional[list[list[int]]] = None) -> "MicroBatches":
        """`rows`: pack_rows' result when the caller has it already (a prepared store keeps it)."""
        lengths = dataset.lengths
        if packing_capacity is None:
            rows = None
        else:
            rows = rows if rows is not None else pack_rows(lengths, packing_capacity, seed)
            lengths = [sum(lengths[i] for i in row) for row in rows]
        order = BatchOrder(len(lengths), global_batch, seed, lengths if group_by_length else None)
        return cls(dataset, order, world_size, rank, micro, accumulation, rows)

    @property
    def num_units(self) -> int:
        return self.order.num_units

    def units(self, epoch: int, index: int, micro: int) -> list[int]:
        """This rank's units in accumulation round `micro` of step `index` of `epoch` (maybe none)."""
        j = micro * self.world_size + self.rank
        return self.order.step(epoch, index)[j * self.micro : (j + 1) * self.micro]

    def samples(self, units: Sequence[int]) -> list[int]:
        return list(units) if self.rows is None else [i for u in units for i in self.rows[u]]

    def step_label_tokens(self, epoch: int, index: int) -> int:
        """Labelled tokens in the whole step, on every rank alike: the loss divides by it, so the
        gradient is the same however the step is split."""
        return sum(self.dataset.label_counts[i] for i in self.samples(self.order.step(epoch, index)))

    def collate(self, units: Sequence[int]) -> dict:
        if self.rows is None:
            return self.dataset.collate(units)
        return self.dataset.collate_packed([self.rows[u] for u in units])
