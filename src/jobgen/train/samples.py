"""The non-chat formats as tokens: `text` (continued pre-training) and `pretokenized` records.

A chat record is laid out by ChatTokenizer (jobgen.train.data); these are not, and land in the
same store (tokens and a learned mask) by SampleEncoder:

- text: the tokenizer's tokens of the text, then EOS, every one learned. A text longer than
  `max_length` is split into consecutive pieces of `max_length` tokens, each a sample of its own
  (id `ID#K` for the K-th piece after the first), so no text is lost to the cut.
- pretokenized: the ids as given, learned where the label is not -100 (every token where the
  record has no labels); cut to `max_length` as a conversation is. An id outside the tokenizer's
  vocabulary is a UserError naming the record: the embedding lookup would fail on the GPU, hours
  later, with an unhelpful device assert.

`pieces(sample, chat)` is the one place this happens; `jobgen data --show`, the eval set
(TokenizedDataset) and the store's encoder all call it.
"""

from __future__ import annotations

from typing import Any, Sequence

from jobgen.errors import UserError
from jobgen.job.conversations import IGNORE_INDEX, Conversation, Sample, TextSample, TokenSample

# (id, input_ids, labels, length before the cut)
Piece = tuple[str, list[int], list[int], int]


def pieces(sample: Sample, chat: Any) -> list[Piece]:
    """`sample` as the model sees it: one piece, or a long text's several."""
    if isinstance(sample, Conversation):
        ids, labels = chat.uncut(sample)
        return [(sample.id, ids[: chat.max_length], labels[: chat.max_length], len(ids))]
    if isinstance(sample, TextSample):
        return text_pieces(sample.id, encode_texts(chat.tokenizer, [sample.text])[0], chat)
    return [token_piece(sample, chat)]


def text_pieces(sample_id: str, ids: list[int], chat: Any) -> list[Piece]:
    ids = ids + [end_of_text(chat.tokenizer)]
    size = chat.max_length
    return [(sample_id if start == 0 else f"{sample_id}#{start // size}", ids[start:start + size],
             ids[start:start + size], len(ids[start:start + size])) for start in range(0, len(ids), size)]


def token_piece(sample: TokenSample, chat: Any) -> Piece:
    vocabulary = len(chat.tokenizer)
    largest = max(sample.input_ids)
    if largest >= vocabulary:
        position = sample.input_ids.index(largest)
        raise UserError(f"{sample.source}: input_ids[{position}] is {largest}, but the tokenizer of {chat.model} has "
                        f"{vocabulary} tokens (ids 0 to {vocabulary - 1}); was the data tokenized with another tokenizer?")
    ids = list(sample.input_ids)
    labels = list(sample.labels) if sample.labels is not None else ids
    return sample.id, ids[: chat.max_length], labels[: chat.max_length], len(ids)


def end_of_text(tokenizer: Any) -> int:
    if tokenizer.eos_token_id is None:
        raise UserError("training.data_format text: the tokenizer has no EOS token to end each text with; give one "
                        "in its tokenizer_config.json (eos_token)")
    return tokenizer.eos_token_id


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The texts' ids without special tokens, in one batch call of a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its own loop
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    # The Rust batch call, as the fast tokenizer's __call__ makes it (no truncation, no padding).
    backend.no_truncation()
    backend.no_padding()
    return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]


class SampleEncoder:
    """Text and pretokenized samples into a store chunk (jobgen.train.encode.Chunk), the texts of
    a chunk encoded in one batch call."""

    def __init__(self, chat: Any) -> None:
        self.chat = chat

    def encode(self, samples: Sequence[Sample]) -> Any:
        import numpy as np

        from jobgen.train.encode import Chunk

        texts = [s.text for s in samples if isinstance(s, TextSample)]
        encoded = iter(encode_texts(self.chat.tokenizer, texts) if texts else [])
        found: list[Piece] = []
        for sample in samples:
            if isinstance(sample, TextSample):
                found += text_pieces(sample.id, next(encoded), self.chat)
            else:
                found += pieces(sample, self.chat)
        tokens = np.array([t for _, ids, _, _ in found for t in ids], dtype=np.int32)
        labels = np.array([t for _, _, labels, _ in found for t in labels], dtype=np.int64)
        counts = [sum(1 for label in labels[1:] if label != IGNORE_INDEX) for _, _, labels, _ in found]
        return Chunk(tokens, (labels != IGNORE_INDEX).astype(np.uint8), np.array([len(ids) for _, ids, _, _ in found], dtype=np.int32),
                     np.array(counts, dtype=np.int32), ids=[piece_id for piece_id, _, _, _ in found])
