"""Tokenizing a whole data set fast: the same tokens and labels as ChatTokenizer, in flat arrays.

ChatTokenizer (jobgen.train.data) calls the tokenizer once per role header and turn, per
conversation, and keeps Python lists: fine for a test, 178 s and 3.65 GB for 100,000
conversations. Here the turn texts of a chunk of conversations go to the fast tokenizer's batch
path in one call (the role headers and markers are encoded once), and the chunk becomes numpy
arrays: tokens (int32), learned (uint8, 1 where the label is the token, 0 where it is -100),
lengths and label counts. Chunks run in worker processes, one per CPU this process may use.

`encode_all` is what jobgen.train.store calls to fill a store; its output equals ChatTokenizer's,
conversation by conversation (tests/train/test_store.py checks it on the tiny tokenizer).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from jobgen.job.conversations import DEFAULT_SYSTEM_PROMPT, Conversation
from jobgen.train.chat_template import CHATML
from jobgen.train.data import ChatTokenizer

ROLES = ("system", "user", "assistant")


@dataclass
class Chunk:
    """One chunk of conversations encoded: flat arrays, in the order of the conversations."""

    tokens: Any  # int32, every conversation's tokens one after the other
    learned: Any  # uint8: 1 where the label is the token, 0 where it is -100
    lengths: Any  # int32 per conversation, after the cut to max_length
    label_counts: Any  # int32 per conversation: learned labels after its first token


class BatchChatEncoder:
    """ChatTokenizer's layout, with every turn text of a chunk encoded in one batch call. Another
    chat layout (any `chat(conversation) -> (input_ids, labels)`) is called conversation by
    conversation, still in the worker processes."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat
        # ChatML only: a model's own template is rendered conversation by conversation (a subclass
        # may lay turns out otherwise too).
        self.batched = type(chat) is ChatTokenizer and chat.chat_template == CHATML
        if self.batched:
            self.headers = {role: chat._encode(role + "\n") for role in ROLES}
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
        import numpy as np

        if not self.batched:
            return self._encode_each(conversations)
        for conversation in conversations:  # ChatML writes no tools: refused as ChatTokenizer refuses them
            self.chat.refuse_tools_in_chatml(conversation)
        texts = [text for c in conversations
                 for text in (DEFAULT_SYSTEM_PROMPT if c.system is None else c.system, *(text for _, text in c.turns))]
        encoded = iter(self._encode_texts(texts))
        start, end, newline = self.chat.im_start, self.chat.im_end, self.chat.newline
        tokens: list[int] = []
        learned: list[int] = []
        lengths: list[int] = []
        counts: list[int] = []
        for conversation in conversations:
            ids: list[int] = []
            mask: list[int] = []
            for position, role in enumerate(("system", *(role for role, _ in conversation.turns))):
                header, content = self.headers[role], next(encoded)
                ids += start + header + content + end + newline
                # The marker, content, end and newline are learned, the role name is not; nor is a
                # weight-0 answer (turns follow the system turn).
                if role == "assistant" and position - 1 not in conversation.unlearned:
                    mask += [1] * len(start) + [0] * len(header) + [1] * (len(content) + len(end) + len(newline))
                else:
                    mask += [0] * (len(start) + len(header) + len(content) + len(end) + len(newline))
            del ids[self.max_length:], mask[self.max_length:]
            tokens += ids
            learned += mask
            lengths.append(len(ids))
            counts.append(sum(mask) - (mask[0] if mask else 0))
        return Chunk(np.array(tokens, dtype=np.int32), np.array(learned, dtype=np.uint8),
                     np.array(lengths, dtype=np.int32), np.array(counts, dtype=np.int32))


    def _encode_each(self, conversations: Sequence[Conversation]) -> Chunk:
        import numpy as np

        pairs = [self.chat(c) for c in conversations]
        tokens = np.array([t for ids, _ in pairs for t in ids], dtype=np.int32)
        labels = np.array([l for _, labels in pairs for l in labels], dtype=np.int64)
        learned = (labels != -100).astype(np.uint8)
        if not np.array_equal(labels[learned == 1], tokens[learned == 1]):
            raise ValueError("a chat layout whose labels are not the input ids cannot be stored as a mask")
        counts = [sum(1 for l in labels[1:] if l != -100) for _, labels in pairs]
        return Chunk(tokens, learned, np.array([len(ids) for ids, _ in pairs], dtype=np.int32), np.array(counts, dtype=np.int32))


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
