"""Experiment trackers across a requeue: the local run of tests/local_run.py, stopped with Ctrl-C
at step 2 and resumed, reports to W&B (offline) and MLflow (a file store in its run directory);
each holds one run with every step once, in order, with the trainer's own losses. And a job's own
program, stopped and resumed, continues one run of each from the environment jobgen gives it."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
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


def wandb_history(run_dir: Path, run_id: str) -> list[dict]:
    """Every history row of the run's offline folders (one per segment, oldest first), as logged."""
    rows = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        assert folder.name.endswith(f"-{run_id}")  # one run, a folder per segment
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def trainer_losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
    return [(record["step"], record["loss"]) for record in map(json.loads, lines) if "loss" in record]


def test_one_wandb_run_holds_every_step_once_across_the_stop(stopped_and_resumed_run) -> None:
    run_dir = stopped_and_resumed_run.run_dir
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # a folder per segment, one run id
    history = [(row["_step"], row["train/loss"]) for row in wandb_history(run_dir, run_id)]
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


# The job's own program, reporting as a Hugging Face Trainer's callbacks do: wandb.init() and
# mlflow.start_run() with nothing but the environment jobgen-torchrun gives it. A step a 0.3 s,
# a checkpoint folder each (complete at once); on its stop signal it ends at the step it is at.
TRACKED_SCRIPT = r'''
import json, os, signal, sys, time
import mlflow, wandb
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
resume = sys.argv[sys.argv.index("--resume") + 1] if "--resume" in sys.argv else None
start = json.load(open(os.path.join(resume, "trainer_state.json")))["global_step"] if resume else 0
with open("environments.jsonl", "a") as out:
    out.write(json.dumps({k: os.environ.get(k) for k in ("WANDB_RUN_ID", "WANDB_RESUME", "WANDB_DIR", "WANDB_MODE",
                                                         "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")}) + "\n")
run = wandb.init(project="own", settings=wandb.Settings(silent=True))
mlflow.start_run()
for step in range(start + 1, 7):
    time.sleep(0.3)
    run.log({"loss": 1.0 / step}, step=step)
    mlflow.log_metric("loss", 1.0 / step, step=step)
    os.makedirs(f"out/checkpoint-{step}", exist_ok=True)
    json.dump({"global_step": step}, open(f"out/checkpoint-{step}/trainer_state.json", "w"))
    if stop:
        break
run.finish()
mlflow.end_run()
'''


def test_the_own_program_continues_one_tracker_run_from_the_environment(tmp_path, monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    (tmp_path / "train.py").write_text(TRACKED_SCRIPT)
    job = {"name": "own", "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 1, "command": ["python", "train.py"], "report_to": ["wandb", "mlflow"],
                      "resume_argument": "--resume {checkpoint}", "checkpoints": "out/checkpoint-*"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    for name in ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        env.pop(name, None)
    submit = [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"]
    run_dir = tmp_path / "runs" / "own"
    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    deadline = time.time() + 120
    while not (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").exists():
        assert time.time() < deadline and first.poll() is None, first.stdout.read() if first.poll() is not None else "no step 2"
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGINT)  # the batch shell alone, as a time limit's warning reaches it
    first.communicate(timeout=120)
    second = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr

    kept = json.loads((run_dir / "trackers.json").read_text())
    environments = [json.loads(line) for line in (tmp_path / "environments.jsonl").read_text().splitlines()]
    assert environments == 2 * [{
        "WANDB_RUN_ID": kept["wandb"], "WANDB_RESUME": "allow", "WANDB_DIR": str(run_dir), "WANDB_MODE": "offline",
        "MLFLOW_RUN_ID": kept["mlflow"]["run_id"], "MLFLOW_TRACKING_URI": f"file:{run_dir}/mlruns",
    }]
    assert [row["_step"] for row in wandb_history(run_dir, kept["wandb"])] == list(range(1, 7))
    logs = "".join(path.read_text() for path in (run_dir / "logs").rglob("*.out"))
    assert f"wandb sync {run_dir}/wandb/offline-run-*-{kept['wandb']}" in logs
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=kept["mlflow"]["tracking_uri"])
    runs = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])]
    assert [run.info.run_id for run in runs] == [kept["mlflow"]["run_id"]]
    history = sorted(client.get_metric_history(kept["mlflow"]["run_id"], "loss"), key=lambda metric: metric.timestamp)
    assert [metric.step for metric in history] == list(range(1, 7))


# The points of a sweep start at once and share one tracking URI: each asks whether the
# experiment exists, and all but the first to create it are answered that it already does. Here
# the store is MLflow's own SQL store (what a tracking server keeps its experiments in, with the
# same unique name), on one SQLite file; each round a new experiment, the points released together.
SWEEP_POINT = r'''
import os, sys, time
from jobgen.train.trackers import mlflow_run
uri, start, rounds, folder = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for name in ["warm-up"] + [f"round-{round}" for round in range(rounds)]:
    os.makedirs(os.path.join(folder, name))
mlflow_run(os.path.join(folder, "warm-up"), "warm-up", uri)  # imports and connects before the first round
for round in range(rounds):
    os.environ["MLFLOW_EXPERIMENT_NAME"] = f"sweep-{round}"
    while time.time() < start + round:
        time.sleep(0.001)
    mlflow_run(os.path.join(folder, f"round-{round}"), "point", uri)
'''


def test_the_points_of_a_sweep_that_race_to_create_one_mlflow_experiment_all_start_in_it(tmp_path) -> None:
    from mlflow.tracking import MlflowClient

    uri, points, rounds = f"sqlite:///{tmp_path}/mlflow.db", 6, 4
    client = MlflowClient(tracking_uri=uri)
    client.search_experiments()  # the database's tables, made once: the points race for the experiment, not for these
    (tmp_path / "point.py").write_text(SWEEP_POINT)
    start = time.time() + 15  # every point imported and connected by then, on 2 CPUs
    started = [subprocess.Popen([sys.executable, "point.py", uri, str(start), str(rounds), f"point-{k}"], cwd=tmp_path,
                                env={**os.environ, "MLFLOW_EXPERIMENT_NAME": "warm-up"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for k in range(points)]
    outputs = [point.communicate(timeout=180)[0] for point in started]
    assert [point.returncode for point in started] == [0] * points, "\n".join(outputs)
    for round in range(rounds):
        (experiment,) = [e for e in client.search_experiments() if e.name == f"sweep-{round}"]
        runs = client.search_runs([experiment.experiment_id])
        kept = {json.loads((tmp_path / f"point-{k}" / f"round-{round}" / "trackers.json").read_text())["mlflow"]["run_id"]
                for k in range(points)}
        assert {run.info.run_id for run in runs} == kept and len(kept) == points, round
