"""Each new data format trains for real: `jobgen submit --scheduler local` of the tiny model on the
tiny conversations written as OpenAI messages (detected) and as Alpaca records (named in the job),
their text as `text` records in a Parquet file, and their chat tokens as `pretokenized` records in
a `datasets` save_to_disk folder listed with a JSONL file, a few steps each. The reading itself is
tests/test_data_formats.py's and tests/test_sources.py's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobgen.job.conversations import load_conversations
from tests.helpers import free_port

STEPS = 2


def as_openai(item: dict) -> dict:
    roles = {"system": "system", "user": "user", "assistant": "assistant"}
    return {"id": item["id"], "messages": [{"role": roles[turn["from"]], "content": turn["value"]} for turn in item["conversations"]]}


def as_alpaca(item: dict) -> dict:
    """The last round is the instruction and output, the rounds before it LLaMA-Factory's history."""
    turns = item["conversations"]
    record = {"id": item["id"]}
    if turns[0]["from"] == "system":
        record["system"], turns = turns[0]["value"], turns[1:]
    pairs = [[turns[i]["value"], turns[i + 1]["value"]] for i in range(0, len(turns), 2)]
    return {**record, "instruction": pairs[-1][0], "input": "", "output": pairs[-1][1], "history": pairs[:-1]}


def as_text(item: dict) -> dict:
    return {"id": item["id"], "text": "\n".join(turn["value"] for turn in item["conversations"])}


def as_pretokenized(tokenizer):
    from jobgen.job.conversations import Conversation
    from jobgen.train.data import ChatTokenizer

    chat = ChatTokenizer(tokenizer, 64)

    def convert(item: dict) -> dict:
        roles = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}
        turns = tuple((roles[t["from"]], t["value"]) for t in item["conversations"] if t["from"] != "system")
        ids, labels = chat(Conversation(item["id"], None, turns))
        return {"id": item["id"], "input_ids": ids, "labels": labels}
    return convert


RUNS = {"openai-detected": ("auto", as_openai, "openai.jsonl"), "alpaca-named": ("alpaca", as_alpaca, "alpaca.json"),
        "text-parquet": ("auto", as_text, "text.parquet"), "pretokenized-list": ("pretokenized", as_pretokenized, "saved")}


def write_records(folder: Path, name: str, records: list) -> object:
    """The records as the job names them: JSONL, a JSON array, Parquet, or a saved `datasets`
    folder listed with a JSONL file of the last few."""
    from tests.test_sources import write_jsonl, write_parquet, write_saved_dataset

    if name.endswith(".jsonl"):
        write_jsonl(folder / name, records)
    elif name.endswith(".parquet"):
        write_parquet(folder / name, records)
    elif name == "saved":
        write_saved_dataset(folder / name, records[:-8])
        write_jsonl(folder / "rest.jsonl", records[-8:])
        return [name, "rest.jsonl"]
    else:
        (folder / name).write_text(json.dumps(records))
    return name


@pytest.fixture(scope="module")
def runs(tiny: Path, tmp_path_factory) -> dict:
    """Both runs, started together (most of each is start-up, and CI time is short)."""
    from jobgen.train.modeling import load_tokenizer

    items = json.loads((tiny / "data.json").read_text())
    tokenizer = load_tokenizer(str(tiny / "model"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_PG_TIMEOUT_MINUTES": "3"}
    started = {}
    for run, (data_format, convert, name) in RUNS.items():
        folder = tmp_path_factory.mktemp(run)
        convert = convert(tokenizer) if convert is as_pretokenized else convert
        data = write_records(folder, name, [convert(item) for item in items])
        job = {
            "name": run,
            "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
            # Two local jobs started in the same second would derive the same port from their ids.
            "launch": {"procs_per_node": 1, "master_port": free_port()},
            "training": {"model": str(tiny / "model"), "data": data, "data_format": data_format, "method": "lora",
                         "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "max_steps": STEPS,
                         "save_interval": 100, "lora": {"r": 4, "alpha": 8}},
        }
        (folder / "job.yaml").write_text(yaml.safe_dump(job))
        started[run] = (folder, subprocess.Popen(
            [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=folder, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    return {run: (folder, process.communicate(timeout=300)[0], process.returncode) for run, (folder, process) in started.items()}


@pytest.mark.parametrize("run", RUNS)
def test_a_new_format_trains_on_the_local_scheduler(tiny: Path, runs: dict, run: str) -> None:
    folder, output, returncode = runs[run]
    data_format, _, name = RUNS[run]
    if data_format in ("auto", "alpaca") and not name.endswith(".parquet"):
        # The same conversations as the ShareGPT original: the trainer sees no difference.
        assert load_conversations(str(folder / name), data_format) == load_conversations(str(tiny / "data.json"))
    assert returncode == 0, output
    run_dir = folder / "runs" / run
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and m["loss"] > 0 for m in metrics)
    assert json.loads((run_dir / "trainer-exit.json").read_text())["reason"] == "completed"
