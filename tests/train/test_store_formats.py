"""Every format lands in the same store: text (split at max_length, EOS learned), pretokenized
(the ids and labels given), and a list of files of several formats; `jobgen data` shows them."""

from __future__ import annotations

import json

import pytest
import yaml

from jobgen.errors import UserError
from jobgen.job.conversations import load_conversations
from jobgen.job.models import Training
from jobgen.train.data import ChatTokenizer, TokenizedDataset
from jobgen.train.modeling import load_tokenizer
from jobgen.train.store import ensure_store
from tests.helpers import jobgen
from tests.test_sources import write_jsonl, write_parquet, write_saved_dataset

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny / "model"))


@pytest.fixture(scope="module")
def conversations(tiny):
    return load_conversations(str(tiny / "data.json"))


def _store(tiny, tmp_path, tokenizer, data, processes=2, **fields):
    training = Training(model=str(tiny / "model"), data=data, max_length=MAX_LENGTH, **fields)
    stored, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=processes)
    assert outcome == "prepared"
    return stored


def _samples(stored) -> list[tuple[list[int], list[int]]]:
    return [tuple(array.tolist() for array in stored.sample(i)) for i in range(len(stored))]


def test_pretokenized_records_of_the_chat_tokens_make_the_chat_store(tiny, tmp_path, tokenizer, conversations):
    chat = ChatTokenizer(tokenizer, 10_000)  # uncut: the store cuts them as it cuts conversations
    records = [{"id": c.id, "input_ids": ids, "labels": labels} for c in conversations for ids, labels in [chat(c)]]
    folder = write_saved_dataset(tmp_path / "saved", records)
    stored = _store(tiny, tmp_path / "a", tokenizer, str(folder))
    reference = _store(tiny, tmp_path / "b", tokenizer, str(tiny / "data.json"))
    assert _samples(stored) == _samples(reference)
    assert stored.ids == reference.ids and stored.label_counts == reference.label_counts
    # Without labels, every token is learned.
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"id": "p", "input_ids": records[0]["input_ids"][:20]}])
    [(ids, labels)] = _samples(_store(tiny, tmp_path / "c", tokenizer, str(plain)))
    assert ids == labels == records[0]["input_ids"][:20]


def test_an_id_outside_the_vocabulary_is_one_line_naming_the_record(tiny, tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"id": "ok", "input_ids": [1, 2]}, {"id": "far", "input_ids": [3, len(tokenizer)]}])
    with pytest.raises(UserError) as raised:
        _store(tiny, tmp_path, tokenizer, str(path), processes=2)  # raised in a worker, said in the preparer
    assert str(raised.value) == (
        f"{path}: record 1 (id 'far'): input_ids[1] is {len(tokenizer)}, but the tokenizer of {tiny / 'model'} has "
        f"{len(tokenizer)} tokens (ids 0 to {len(tokenizer) - 1}); was the data tokenized with another tokenizer?")


def test_a_long_text_is_split_into_max_length_pieces_all_learned(tiny, tmp_path, tokenizer, conversations):
    long_text = " ".join(text for c in conversations[:6] for _, text in c.turns)
    texts = [{"id": "short", "text": "A short text."}, {"id": "long", "text": long_text}]
    stored = _store(tiny, tmp_path, tokenizer, str(write_parquet(tmp_path / "texts.parquet", texts)))
    whole = tokenizer(long_text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(whole) > 3 * MAX_LENGTH
    pieces = [whole[i:i + MAX_LENGTH] for i in range(0, len(whole), MAX_LENGTH)]
    short = tokenizer("A short text.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert _samples(stored) == [(short, short)] + [(piece, piece) for piece in pieces]
    assert stored.ids == ["short", "long"] + [f"long#{k}" for k in range(1, len(pieces))]
    assert stored.label_counts == [len(short) - 1] + [len(piece) - 1 for piece in pieces]
    # The eval path (TokenizedDataset) makes the same pieces.
    chat = ChatTokenizer(tokenizer, MAX_LENGTH)
    reference = TokenizedDataset(load_conversations(str(tmp_path / "texts.parquet")), chat, tokenizer.pad_token_id)
    assert list(zip(reference.input_ids, reference.labels)) == _samples(stored) and reference.cut_lengths == []


def test_a_list_of_files_of_several_formats_is_one_store_in_order(tiny, tmp_path, tokenizer, conversations):
    chat_file = tiny / "data.json"
    texts = write_jsonl(tmp_path / "texts.jsonl", [{"id": f"t{i}", "text": f"Text {i}."} for i in range(30)])
    stored = _store(tiny, tmp_path / "a", tokenizer, [str(chat_file), str(texts)])
    first = _store(tiny, tmp_path / "b", tokenizer, str(chat_file))
    second = _store(tiny, tmp_path / "c", tokenizer, str(texts))
    assert _samples(stored) == _samples(first) + _samples(second)
    assert stored.ids == first.ids + second.ids
    # A held-out fraction splits the files' records together (chunks of both formats at once).
    held = _store(tiny, tmp_path / "d", tokenizer, [str(chat_file), str(texts)], eval_fraction=0.5)
    assert 0 < len(held) < len(stored)


def test_data_show_prints_text_and_pretokenized_samples(tiny, tmp_path, tokenizer):
    ids = tokenizer("Hello there.", add_special_tokens=False)["input_ids"]
    write_jsonl(tmp_path / "tokens.jsonl", [{"id": "p", "input_ids": ids, "labels": [-100] * 2 + ids[2:]}])
    write_jsonl(tmp_path / "texts.jsonl", [{"id": "t", "text": "word " * 100}])
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "show", "launch": {"procs_per_node": 1},
                                   "training": {"model": str(tiny / "model"), "data": ["tokens.jsonl", "texts.jsonl"],
                                                "max_length": MAX_LENGTH}}))
    result = jobgen("data", str(job), "--show", "3", "--site", "none", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == f"# sample 'p': {len(ids)} tokens, {len(ids) - 2} learned"
    assert lines[2] == tokenizer.decode(ids[:2]) + "⟦" + tokenizer.decode(ids[2:]) + "⟧"
    assert lines[3] == f"# sample 't': {MAX_LENGTH} tokens, {MAX_LENGTH} learned"
    assert [line.split(":")[0] for line in lines if line.startswith("# sample")] == ["# sample 'p'", "# sample 't'", "# sample 't#1'"]
    shown = jobgen("data", str(job), "--show", "2", "--json", "--site", "none", cwd=tmp_path)
    second = json.loads(shown.stdout.splitlines()[1])
    assert second["id"] == "t" and second["labels"] == second["input_ids"] and len(second["input_ids"]) == MAX_LENGTH
