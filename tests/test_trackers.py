"""Experiment trackers across a requeue: the local run of tests/local_run.py, stopped with Ctrl-C
at step 2 and resumed, reports to W&B (offline) and MLflow (a file store in its run directory);
each holds one run with every step once, in order, with the trainer's own losses."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import yaml

from tests.local_run import STEPS

WANDB_HEADER = 7  # ":W&B", a 2-byte magic and a version byte
BLOCK = 32768  # the .wandb file is a LevelDB-style log of protobuf records in 32 KiB blocks


def wandb_records(path: Path) -> list:
    """The protobuf records of one offline W&B run file (wandb's own reader is in its Go core)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", WANDB_HEADER
    while offset + 7 <= len(data):
        room = BLOCK - offset % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0 and length == 0:
            offset += room
            continue
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def trainer_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines) if "loss" in record]


def test_one_wandb_run_holds_every_step_once_across_the_stop(stopped_and_resumed_run) -> None:
    run_dir = stopped_and_resumed_run.run_dir
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [folder.name.rsplit("-", 1)[1] for folder in folders] == [run_id, run_id]  # a folder per segment, one run
    history, resumed = [], []
    for folder in folders:
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
            if kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history.append((items["_step"], items["train/loss"]))
        resumed.append(history[-1][0] if history else None)
    assert [step for step, _ in history] == list(range(1, STEPS + 1))
    assert history == trainer_losses(run_dir)
    # The line that says how to upload it, with the folders it names.
    log = "".join(path.read_text() for path in (run_dir / "logs").rglob("*rank0.out"))
    sync = f"wandb sync {run_dir}/wandb/offline-run-*-{run_id}"
    assert log.count(sync) == 2, log


def test_one_mlflow_run_holds_every_step_once_across_the_stop(stopped_and_resumed_run, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = stopped_and_resumed_run.run_dir
    kept = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert kept["tracking_uri"] == f"file:{run_dir}/mlruns"
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when allowed
    client = MlflowClient(tracking_uri=kept["tracking_uri"])
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    assert [run.info.run_id for run in runs] == [kept["run_id"]]
    assert client.get_run(kept["run_id"]).info.status == "FINISHED"
    history = sorted(client.get_metric_history(kept["run_id"], "train/loss"), key=lambda metric: metric.timestamp)
    assert [(metric.step, metric.value) for metric in history] == trainer_losses(run_dir)
    assert [metric.step for metric in history] == list(range(1, STEPS + 1))


def test_an_unknown_tracker_is_one_line_naming_the_choices(tmp_path) -> None:
    job = {"training": {"model": "m", "data": "d.json", "report_to": ["wandb", "comet"]}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-m", "jobgen.cli", "render", "-s", "slurm", "job.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "jobgen: error: job.yaml: 'training.report_to.1' is 'comet': Input should be 'tensorboard', 'wandb' or 'mlflow'"
    ]
