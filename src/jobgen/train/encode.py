"""Tokenizing a whole data set fast: the same tokens and labels as ChatTokenizer, in flat arrays.

ChatTokenizer (jobgen.train.data) calls the tokenizer once per role header and turn, per
conversation, and keeps Python lists: fine for a test, 178 s and 3.65 GB for 100,000
conversations. Here the turn texts of a chunk of conversations go to the fast tokenizer's batch
path in one call (the role headers and markers are encoded once), and the chunk becomes numpy
arrays: tokens (int32), learned (uint8, 1 where the label is the token, 0 where it is -100),
lengths and label counts. Chunks run in worker processes, one per CPU this process may use; they
come from the reader (jobgen.job.conversations.read_samples) a chunk at a time and go to the
workers through the pool, so neither the preparing process nor a worker holds the data set. A
chunk of text or pretokenized samples goes to SampleEncoder instead.

`encode_all` is what jobgen.train.store calls to fill a store; its output equals ChatTokenizer's,
conversation by conversation (tests/train/test_store.py checks it on the tiny tokenizer). The arrays
are built with numpy from each turn's token count; Python touches each turn, not each token.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from jobgen.job.conversations import DEFAULT_SYSTEM_PROMPT, Conversation, Sample, TextSample
from jobgen.job.record_formats import IGNORE_INDEX
from jobgen.train.chat_template import CHATML
from jobgen.train.data import ChatTokenizer
from jobgen.train.samples import Piece, encode_texts, pieces, text_pieces

ROLES = ("system", "user", "assistant")
ROLE_INDEX = {role: index for index, role in enumerate(ROLES)}


@dataclass
class Chunk:
    """One chunk of conversations encoded: flat arrays, in the order of the conversations."""

    tokens: Any  # int32, every conversation's tokens one after the other
    learned: Any  # uint8: 1 where the label is the token, 0 where it is -100
    lengths: Any  # int32 per conversation, after the cut to max_length
    label_counts: Any  # int32 per conversation: learned labels after its first token
    uncut: Any  # int32 per conversation, before the cut: uncut - lengths tokens were lost
    ids: Optional[list[str]] = None  # the samples' ids (encode_all fills a chat chunk's)


class BatchChatEncoder:
    """ChatTokenizer's layout, with every turn text of a chunk encoded in one batch call. Another
    chat layout (any `chat(conversation) -> (input_ids, labels)`) is called conversation by
    conversation, still in the worker processes."""

    def __init__(self, chat: Any) -> None:
        import numpy as np

        self.chat = chat
        # ChatML only: a model's own template is rendered conversation by conversation (a subclass
        # may lay turns out otherwise too).
        self.batched = type(chat) is ChatTokenizer and chat.chat_template == CHATML
        if self.batched:
            # A turn is start + header[role] + content + suffix; the prefixes and the suffix are
            # encoded once here, each turn's content in the batch call.
            self.prefixes = [np.array(chat.im_start + chat._encode(role + "\n"), dtype=np.int32) for role in ROLES]
            self.suffix = np.array(chat.im_end + chat.newline, dtype=np.int32)
        self.max_length = chat.max_length

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        return encode_texts(self.chat.tokenizer, texts)

    def encode(self, conversations: Sequence[Conversation]) -> Chunk:
        """The chunk's arrays, built with numpy from each turn's token count (Python touches each
        turn once, not each token: per-token lists cost a tenth of the CPU time; BENCHMARKS.md)."""
        import numpy as np

        if not self.batched:
            return self._encode_each(conversations)
        for conversation in conversations:  # ChatML writes no tools: refused as ChatTokenizer refuses them
            self.chat.refuse_tools_in_chatml(conversation)
        texts: list[str] = []
        roles: list[int] = []  # index into ROLES
        learned_turns: list[bool] = []
        turn_counts: list[int] = []
        for c in conversations:
            texts.append(DEFAULT_SYSTEM_PROMPT if c.system is None else c.system)
            roles.append(0)
            learned_turns.append(False)
            for position, (role, text) in enumerate(c.turns):
                texts.append(text)
                roles.append(ROLE_INDEX[role])
                # Turns follow the system turn; a weight-0 answer is not learned.
                learned_turns.append(role == "assistant" and position not in c.unlearned)
            turn_counts.append(len(c.turns) + 1)
        # Repeated texts (system prompts above all) are encoded once.
        unique: dict[str, int] = {}
        which = np.fromiter((unique.setdefault(text, len(unique)) for text in texts), dtype=np.int64, count=len(texts))
        encoded = self._encode_texts(list(unique))
        unique_lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        unique_ids = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32, count=int(unique_lengths.sum()))
        del encoded
        unique_starts = _starts(unique_lengths)

        role = np.array(roles, dtype=np.int64)
        learned_turn = np.array(learned_turns, dtype=bool)
        prefix_lengths = np.array([len(p) for p in self.prefixes], dtype=np.int64)[role]
        content_lengths = unique_lengths[which]
        turn_lengths = prefix_lengths + content_lengths + len(self.suffix)
        turn_starts = _starts(turn_lengths)
        total = int(turn_lengths.sum())
        tokens = np.empty(total, dtype=np.int32)
        content_starts = turn_starts + prefix_lengths
        # Each turn's content, copied from its unique text's ids.
        within = np.arange(int(content_lengths.sum()), dtype=np.int64) - np.repeat(_starts(content_lengths), content_lengths)
        tokens[np.repeat(content_starts, content_lengths) + within] = unique_ids[np.repeat(unique_starts[which], content_lengths) + within]
        for index, prefix in enumerate(self.prefixes):
            tokens[turn_starts[role == index][:, None] + np.arange(len(prefix))] = prefix
        tokens[(content_starts + content_lengths)[:, None] + np.arange(len(self.suffix))] = self.suffix
        # A learned turn: the marker, content, end and newline are learned, the role name is not.
        learned = np.repeat(learned_turn, turn_lengths).astype(np.uint8)
        start = len(self.chat.im_start)
        header = len(self.prefixes[ROLE_INDEX["assistant"]]) - start
        learned[(turn_starts[learned_turn] + start)[:, None] + np.arange(header)] = 0

        # The cut to max_length, conversation by conversation.
        first_turns = _starts(np.array(turn_counts, dtype=np.int64))
        uncut = np.add.reduceat(turn_lengths, first_turns) if len(turn_counts) else np.zeros(0, dtype=np.int64)
        lengths = np.minimum(uncut, self.max_length)
        if (uncut > lengths).any():
            position = np.arange(total, dtype=np.int64) - np.repeat(_starts(uncut), uncut)
            kept = position < np.repeat(lengths, uncut)
            tokens, learned = tokens[kept], learned[kept]
        starts = _starts(lengths)
        learned_before = np.concatenate(([0], np.cumsum(learned, dtype=np.int64)))
        first = learned[np.minimum(starts, max(len(learned) - 1, 0))] if len(learned) else np.zeros(len(starts))
        counts = learned_before[starts + lengths] - learned_before[starts] - np.where(lengths > 0, first, 0)
        return Chunk(tokens, learned, lengths.astype(np.int32), counts.astype(np.int32), uncut.astype(np.int32))

    def _encode_each(self, conversations: Sequence[Conversation]) -> Chunk:
        import numpy as np

        if type(self.chat) is ChatTokenizer:  # its uncut length is known: the cut is counted
            uncut_pairs = [self.chat.uncut(c) for c in conversations]
            uncut = [len(ids) for ids, _ in uncut_pairs]
            pairs = [(ids[: self.max_length], labels[: self.max_length]) for ids, labels in uncut_pairs]
        else:  # any other layout cuts in its own __call__
            pairs = [self.chat(c) for c in conversations]
            uncut = [len(ids) for ids, _ in pairs]
        tokens = np.array([t for ids, _ in pairs for t in ids], dtype=np.int32)
        labels = np.array([l for _, labels in pairs for l in labels], dtype=np.int64)
        learned = (labels != -100).astype(np.uint8)
        if not np.array_equal(labels[learned == 1], tokens[learned == 1]):
            raise ValueError("a chat layout whose labels are not the input ids cannot be stored as a mask")
        counts = [sum(1 for l in labels[1:] if l != -100) for _, labels in pairs]
        return Chunk(tokens, learned, np.array([len(ids) for ids, _ in pairs], dtype=np.int32),
                     np.array(counts, dtype=np.int32), np.array(uncut, dtype=np.int32))


def _starts(lengths: Any) -> Any:
    """Where each of consecutive pieces of these lengths starts."""
    import numpy as np

    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


class SampleEncoder:
    """Text and pretokenized samples (jobgen.train.samples) into a Chunk, the texts of a chunk
    encoded in one batch call."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat

    def encode(self, samples: Sequence[Sample]) -> Any:
        import numpy as np

        texts = [s.text for s in samples if isinstance(s, TextSample)]
        encoded = iter(encode_texts(self.chat.tokenizer, texts) if texts else [])
        found: list[Piece] = []
        for sample in samples:
            if isinstance(sample, TextSample):
                found += text_pieces(sample.id, next(encoded), self.chat)
            else:
                found += pieces(sample, self.chat)
        tokens = np.array([t for _, ids, _, _ in found for t in ids], dtype=np.int32)
        flat_labels = np.array([t for _, _, labels, _ in found for t in labels], dtype=np.int64)
        counts = [sum(1 for label in labels[1:] if label != IGNORE_INDEX) for _, _, labels, _ in found]
        return Chunk(tokens, (flat_labels != IGNORE_INDEX).astype(np.uint8),
                     np.array([len(ids) for _, ids, _, _ in found], dtype=np.int32), np.array(counts, dtype=np.int32),
                     np.array([uncut for _, _, _, uncut in found], dtype=np.int32),
                     ids=[piece_id for piece_id, _, _, _ in found])


# The worker processes' encoders: set before the fork, so that each worker has the loaded
# tokenizer without pickling it; the chunks of samples come to them through the pool.
_WORK: dict[str, Any] = {}
IN_FLIGHT_PER_PROCESS = 2  # chunks read ahead per worker: enough to keep it busy, few enough to stay small


def _start_worker() -> None:
    import signal

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per CPU already; no threads on top
    # The trainer's handlers (a stop request) came with the fork: a worker must end when told to.
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)


def _encode_chunk(samples: Sequence[Sample]) -> Chunk:
    """Samples by the encoder of their kind: chat (Conversation) or not (jobgen.train.samples). A
    chunk is one file's, so of one kind."""
    import numpy as np

    runs = [list(run) for _, run in itertools.groupby(samples, key=lambda s: isinstance(s, Conversation))]
    chunks = []
    for run in runs or [[]]:
        if run and not isinstance(run[0], Conversation):
            chunks.append(_WORK["samples"].encode(run))
        else:
            chunks.append(_WORK["chat"].encode(run))
            chunks[-1].ids = [c.id for c in run]
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(*(np.concatenate([getattr(c, name) for c in chunks]) for name in ("tokens", "learned", "lengths", "label_counts", "uncut")),
                 ids=[i for c in chunks for i in c.ids])


def usable_cpus() -> int:
    """The CPUs this process may run on (a scheduler's binding included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def encode_all(chunks: Iterable[Sequence[Sample]], chat: ChatTokenizer, processes: Optional[int] = None,
               progress: Optional[Callable[[int, int, int], None]] = None, total: int = 0) -> Iterator[Chunk]:
    """The encoded chunks of `chunks` (jobgen.job.conversations.read_samples'), in order, by
    `processes` workers (default: one per usable CPU). Only a few chunks are read ahead, so the
    data set is never held whole. `progress(records_done, total, tokens_done)` after each
    chunk (`total` 0: not known)."""
    processes = processes or usable_cpus()
    _WORK.update(chat=BatchChatEncoder(chat), samples=SampleEncoder(chat))
    done = tokens = 0
    pool, closed = None, False
    try:
        if processes == 1:
            encoded: Iterator[tuple[int, Chunk]] = ((len(c), _encode_chunk(c)) for c in chunks)
        else:
            import multiprocessing

            # fork: the workers inherit the loaded tokenizer; each chunk is pickled to one.
            pool = multiprocessing.get_context("fork").Pool(processes, initializer=_start_worker)
            encoded = _in_order(pool, chunks, processes * IN_FLIGHT_PER_PROCESS)
        for count, chunk in encoded:
            done += count
            tokens += len(chunk.tokens)
            if progress:
                progress(done, total, tokens)
            yield chunk
        if progress and not total:  # the count is known now: the last line says it
            progress(done, done, tokens)
        if pool is not None:
            pool.close()  # every chunk is in: the workers end on their own
            closed = True
    finally:
        _WORK.clear()
        if pool is not None:
            _end_pool(pool, closed)


def _end_pool(pool: Any, closed: bool) -> None:
    """Ends the pool's workers. A closed pool's workers end by themselves, each at the sentinel
    the pool queues for it: wait for them. Pool.terminate() then would SIGTERM a worker while it
    holds the task queue's lock to take its sentinel, and leave the next one blocked on that lock,
    which terminate() then joins for ever (seen in a real job: the preparer hung in Pool.join
    while every rank waited for it). Only a pool left early (an error, a consumer that stopped)
    is terminated."""
    if not closed:
        pool.terminate()
    pool.join()


def _in_order(pool: Any, chunks: Iterable[Sequence[Sample]], most: int) -> Iterator[tuple[int, Chunk]]:
    """The chunks encoded by the pool in their order, at most `most` of them given out at a time.
    (Pool.imap would read the whole input ahead into its task queue.)"""
    waiting: deque = deque()
    for chunk in chunks:
        waiting.append((len(chunk), pool.apply_async(_encode_chunk, (chunk,))))
        if len(waiting) >= most:
            count, result = waiting.popleft()
            yield count, result.get()
    while waiting:
        count, result = waiting.popleft()
        yield count, result.get()


class Progress:
    """A progress line: records done, rate and time left; on a terminal one line updated in
    place, elsewhere (a log) a line every `every` seconds."""

    def __init__(self, write: Callable[[str], None], every: float = 10.0, in_place: bool = False) -> None:
        self.write, self.every, self.in_place = write, every, in_place
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.last < (0.5 if self.in_place else self.every) and (done < total or not total):
            return
        self.last = now
        elapsed = max(now - self.started, 1e-6)
        left = (total - done) * elapsed / max(done, 1)
        rate = f"{tokens / elapsed / 1e6:.2f} M tokens/s"
        if not total:  # a JSON array is counted only once parsed
            self.write(f"tokenized {done} records, {rate}")
            return
        self.write(f"tokenized {done}/{total} records ({100 * done / max(total, 1):.0f}%), {rate}, {left:.0f} s left")
