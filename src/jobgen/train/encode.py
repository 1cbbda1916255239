"""Tokenizing a whole data set fast: the same tokens and labels as ChatTokenizer, in flat arrays.

ChatTokenizer (jobgen.train.data) calls the tokenizer once per role header and turn, per
conversation, and keeps Python lists: fine for a test, 178 s and 3.65 GB for 100,000
conversations. Here the turn texts of a chunk of conversations go to the fast tokenizer's batch
path in one call (the role headers and markers are encoded once), and the chunk becomes numpy
arrays: tokens (int32), learned (uint8, 1 where the label is the token, 0 where it is -100),
lengths and label counts. Chunks run in worker processes, one per CPU this process may use.

`encode_all` is what jobgen.train.store calls to fill a store; its output equals ChatTokenizer's,
conversation by conversation (tests/train/test_store.py checks it on the tiny tokenizer). The arrays
are built with numpy from each turn's token count; Python touches each turn, not each token.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from jobgen.job.conversations import DEFAULT_SYSTEM_PROMPT, Conversation
from jobgen.train.chat_template import CHATML
from jobgen.train.data import ChatTokenizer

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

    def select(self, keep: Any) -> "Chunk":
        """The conversations where the boolean array `keep` is true, in order."""
        import numpy as np

        tokens_kept = np.repeat(keep, self.lengths)
        return Chunk(self.tokens[tokens_kept], self.learned[tokens_kept], self.lengths[keep],
                     self.label_counts[keep], self.uncut[keep])


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
        tokenizer = self.chat.tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: its own loop
            return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        # The Rust batch call, as the fast tokenizer's __call__ makes it (no truncation, no padding).
        backend.no_truncation()
        backend.no_padding()
        return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, conversations: Sequence[Conversation]) -> Chunk:
        """The chunk's arrays, built with numpy from each turn's token count (Python touches each
        turn once, not each token: per-token lists cost a tenth of the CPU time; BENCHMARKS.md)."""
        import numpy as np

        if not self.batched:
            return self._encode_each(conversations)
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


# The worker processes' share of the work: set before the fork, so that each worker reads the
# conversations from its copy-on-write memory instead of having them pickled to it.
_WORK: dict[str, Any] = {}


def _start_worker() -> None:
    import signal

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per CPU already; no threads on top
    # The trainer's handlers (a stop request) came with the fork: a worker must end when told to.
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)


def _encode_range(bounds: tuple[int, int]) -> Chunk:
    return _WORK["encoder"].encode(_WORK["conversations"][bounds[0]:bounds[1]])


def usable_cpus() -> int:
    """The CPUs this process may run on (a scheduler's binding included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def encode_all(conversations: Sequence[Conversation], chat: ChatTokenizer, processes: Optional[int] = None,
               progress: Optional[Callable[[int, int, int], None]] = None) -> Iterator[Chunk]:
    """The chunks of the whole data set, in order, encoded by `processes` workers (default: one
    per usable CPU). `progress(conversations_done, conversations, tokens_done)` after each chunk."""
    processes = processes or usable_cpus()
    encoder = BatchChatEncoder(chat)
    size = max(64, min(2000, len(conversations) // (processes * 8) or 1))
    ranges = [(i, min(i + size, len(conversations))) for i in range(0, len(conversations), size)]
    done = tokens = 0
    if processes == 1 or len(ranges) == 1:
        chunks: Iterator[Chunk] = (encoder.encode(conversations[a:b]) for a, b in ranges)
        pool = None
    else:
        import multiprocessing

        _WORK.update(encoder=encoder, conversations=conversations)
        # fork: the workers inherit the parsed conversations and the loaded tokenizer.
        pool = multiprocessing.get_context("fork").Pool(processes, initializer=_start_worker)
        chunks = pool.imap(_encode_range, ranges)
    try:
        for (a, b), chunk in zip(ranges, chunks):
            done += b - a
            tokens += len(chunk.tokens)
            if progress:
                progress(done, len(conversations), tokens)
            yield chunk
        if pool is not None:
            pool.close()  # every chunk is in: the workers end on their own
    finally:
        _WORK.clear()
        if pool is not None:
            pool.terminate()
            pool.join()


class Progress:
    """A progress line: conversations done, rate and time left; on a terminal one line updated in
    place, elsewhere (a log) a line every `every` seconds."""

    def __init__(self, write: Callable[[str], None], every: float = 10.0, in_place: bool = False) -> None:
        self.write, self.every, self.in_place = write, every, in_place
        self.started = self.last = time.monotonic()

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.monotonic()
        if now - self.last < (0.5 if self.in_place else self.every) and done < total:
            return
        self.last = now
        elapsed = max(now - self.started, 1e-6)
        left = (total - done) * elapsed / max(done, 1)
        self.write(f"tokenized {done}/{total} conversations ({100 * done / max(total, 1):.0f}%), "
                   f"{tokens / elapsed / 1e6:.2f} M tokens/s, {left:.0f} s left")
