"""The non-chat formats as tokens: `text` (continued pre-training) and `pretokenized` records.

A chat record is laid out by ChatTokenizer (jobgen.train.data); these are not, and land in the
same store (tokens and a learned mask), by jobgen.train.encode.SampleEncoder:

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

from typing import Any

from jobgen.errors import UserError
from jobgen.job.conversations import Conversation, Sample, TextSample, TokenSample

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
