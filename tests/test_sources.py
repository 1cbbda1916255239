"""Where the records come from: a list of files, Parquet, a `datasets` save_to_disk folder, and the
text and pretokenized formats, read as the trainer and `jobgen validate` read them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pyarrow as pa  # the train extra's: Parquet and datasets folders are read with it
import pyarrow.parquet
import yaml

from jobgen.errors import UserError
from jobgen.job.conversations import MAX_PROBLEMS, TextSample, TokenSample, check_conversations, load_conversations, read_samples
from jobgen.job.sources import count_records, read_chunks
from tests.helpers import jobgen


SHAREGPT = [{"id": f"s{i}", "conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": "Hello."}]}
            for i in range(5)]
OPENAI = [{"id": f"o{i}", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "weight": 1}]}
          for i in range(3)]
TEXTS = [{"id": f"t{i}", "text": f"Plain text number {i}."} for i in range(4)]
TOKENS = [{"id": "p0", "input_ids": [5, 6, 7]}, {"id": "p1", "input_ids": [5, 6, 7], "labels": [-100, 6, 7]}]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def table_of(records: list):
    """Every record with every column (null where it lacks one), as datasets' from_list makes it."""
    columns = list(dict.fromkeys(key for record in records for key in record))
    return pa.Table.from_pylist([{key: record.get(key) for key in columns} for record in records])


def write_parquet(path: Path, records: list, row_group_size: int = 2) -> Path:
    pyarrow.parquet.write_table(table_of(records), str(path), row_group_size=row_group_size)
    return path


def write_saved_dataset(folder: Path, records: list, shards: int = 2) -> Path:
    """The layout `datasets.Dataset.save_to_disk` writes: data-0000K-of-0000N.arrow (Arrow IPC
    streams, as its ArrowWriter writes them), dataset_info.json and state.json naming the shards."""
    folder.mkdir()
    table = table_of(records)
    names = []
    size = -(-len(records) // shards)
    for shard in range(shards):
        name = f"data-{shard:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(shard * size, size), max_chunksize=2)
        names.append(name)
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}, "homepage": "", "license": ""}))
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": name} for name in names], "_fingerprint": "0123456789abcdef", "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train",
    }, indent=2, sort_keys=True))
    return folder


def test_parquet_and_a_saved_dataset_read_as_their_jsonl_twin(tmp_path: Path) -> None:
    twin = load_conversations(str(write_jsonl(tmp_path / "d.jsonl", OPENAI)))
    # A column shared by every record: a record without `weight` has it as null, read as absent.
    mixed = OPENAI[:1] + [{"id": "o1", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}] + OPENAI[2:]
    assert load_conversations(str(write_parquet(tmp_path / "d.parquet", mixed))) == twin
    assert load_conversations(str(write_saved_dataset(tmp_path / "saved", mixed))) == twin
    assert count_records(str(tmp_path / "saved")) == count_records(str(tmp_path / "d.parquet")) == count_records(str(tmp_path / "d.jsonl")) == 3


def test_a_list_of_files_reads_in_order_each_in_its_own_format(tmp_path: Path) -> None:
    files = [str(write_jsonl(tmp_path / "chat.jsonl", SHAREGPT)), str(write_parquet(tmp_path / "text.parquet", TEXTS)),
             str(write_saved_dataset(tmp_path / "tokens", TOKENS, shards=1))]
    samples = load_conversations(files)
    assert [s.id for s in samples] == [r["id"] for r in SHAREGPT + TEXTS + TOKENS]
    assert samples[5] == TextSample("t0", "Plain text number 0.")
    assert samples[-1] == TokenSample("p1", (5, 6, 7), (-100, 6, 7))
    assert samples[-2] == TokenSample("p0", (5, 6, 7), None)


def test_records_come_a_chunk_at_a_time(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", SHAREGPT * 5)
    assert [len(chunk) for chunk in read_chunks(str(path), size=10)] == [10, 10, 5]
    assert [len(chunk) for chunk in read_samples(str(path))] == [25]
    saved = write_saved_dataset(tmp_path / "saved", SHAREGPT * 5)
    assert sum(len(chunk) for chunk in read_chunks(str(saved), size=4)) == 25


def test_the_format_is_detected_past_the_first_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jobgen.job.sources as sources

    path = write_jsonl(tmp_path / "late.jsonl", [{"id": "x", "prompt": "?"}] * 3 + TEXTS)
    monkeypatch.setattr(sources, "CHUNK_RECORDS", 2)  # the format is told by the second chunk
    lines = check_conversations(str(path)).problems
    assert lines[0] == (f"{path}: record 0 (id 'x'): missing field 'text' (the file is text, detected from record 3 "
                        "(id 't0')); it fits no format; it has 'id', 'prompt'")
    assert len(lines) == 3


@pytest.mark.parametrize("record,problem", [
    ({"id": "a", "text": 3}, "record 0 (id 'a'): 'text' must be a string, got int"),
    ({"id": "a", "text": ""}, "record 0 (id 'a'): 'text' is empty, so nothing to learn from it"),
    ({"id": "a", "input_ids": [1, "2"]}, "record 0 (id 'a'): input_ids[1] is '2'; expected a token id (an integer of at least 0)"),
    ({"id": "a", "input_ids": []}, "record 0 (id 'a'): 'input_ids' is empty"),
    ({"id": "a", "input_ids": [1, 2], "labels": [1]}, "record 0 (id 'a'): 'labels' has 1 entries and 'input_ids' 2; give one label per input id"),
    ({"id": "a", "input_ids": [1, 2, 3], "labels": [-100, 3, 3]},
     "record 0 (id 'a'): labels[1] is 3, but input_ids[1] is 2; a label is -100 (not learned) or the input id itself "
     "(the model shifts labels; do not shift them)"),
    ({"id": "a", "input_ids": [1, 2], "labels": [-100, -100]}, "record 0 (id 'a'): every label is -100, so nothing to learn from it"),
])
def test_a_bad_text_or_pretokenized_record_is_one_line(tmp_path: Path, record: dict, problem: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [record])
    assert check_conversations(str(path)).problems == [f"{path}: {problem}"]
    with pytest.raises(UserError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        load_conversations(str(path))


def test_files_that_cannot_be_read_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    with pytest.raises(UserError, match=r"is a folder without state.json; give a .json, .jsonl or .parquet file"):
        load_conversations(str(tmp_path / "bare"))
    # A hub dataset as `hf download --repo-type dataset` leaves it: its files are named.
    hub = tmp_path / "alpaca"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("# alpaca")
    for name in ("train-00000-of-00001.parquet", "test-00000-of-00001.parquet"):
        (hub / "data" / name).write_text("")
    with pytest.raises(UserError) as refused:
        load_conversations(str(hub))
    assert str(refused.value).endswith(f"or a folder written by datasets' save_to_disk; it holds '{hub}/data/test-00000-of-00001.parquet', "
                                       f"'{hub}/data/train-00000-of-00001.parquet': list those of the split to use")
    (tmp_path / "dict").mkdir()
    (tmp_path / "dict" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(UserError, match=r"holds a DatasetDict \(dataset_dict.json\); give one split's folder"):
        load_conversations(str(tmp_path / "dict"))
    (tmp_path / "broken.parquet").write_text("not parquet")
    with pytest.raises(UserError, match=r"broken.parquet: not a readable Parquet file"):
        load_conversations(str(tmp_path / "broken.parquet"))
    with pytest.raises(UserError, match=r"training.data: file '.*missing.jsonl' does not exist"):
        load_conversations([str(write_jsonl(tmp_path / "ok.jsonl", SHAREGPT)), str(tmp_path / "missing.jsonl")])


def test_validate_lists_the_bad_records_of_every_file_up_to_the_count(tmp_path: Path) -> None:
    bad_chat = SHAREGPT[:1] + [{"id": f"c{i}", "conversations": []} for i in range(MAX_PROBLEMS - 2)]
    write_jsonl(tmp_path / "chat.jsonl", bad_chat)
    write_parquet(tmp_path / "text.parquet", TEXTS[:1] + [{"id": f"t{i}", "text": ""} for i in range(5)])
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "lists", "resources": {"nodes": 1, "gpus_per_node": 0}, "launch": {"procs_per_node": 1},
        "training": {"model": "org/name", "data": ["chat.jsonl", "text.parquet"]},
    }))
    result = jobgen("validate", "job.yaml", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("jobgen: error: ")]
    assert result.returncode == 2 and len(errors) == MAX_PROBLEMS + 1, result.stderr
    assert errors[0] == f"jobgen: error: {tmp_path / 'chat.jsonl'}: record 1 (id 'c0'): 'conversations' is empty"
    assert errors[MAX_PROBLEMS - 2] == (f"jobgen: error: {tmp_path / 'text.parquet'}: record 1 (id 't0'): 'text' is empty, "
                                        "so nothing to learn from it")
    assert errors[-1] == f"jobgen: error: training.data: 3 more bad records ({MAX_PROBLEMS + 3} in all; the first {MAX_PROBLEMS} are above)"
