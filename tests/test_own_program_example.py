"""The shipped own-program example (examples/own-program: finetune.py, a Hugging Face Trainer with
JobgenCallback, and cpu-2node.yaml) run as a user runs it: the local scheduler, two simulated
nodes of one rank each on the CPU, stopped once (Ctrl-C to jobgen) and resumed to the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.helpers import REPO, jobgen, tiny_model

EXAMPLE = REPO / "examples" / "own-program"
STEPS, SAVE_STEPS, BATCH = 60, 10, 4


def example_job(folder: Path, **changed: str) -> Path:
    """The example's files in FOLDER, its job with these TrainingArguments changed (enough steps to
    stop it midway), and the tiny model it names."""
    for name in ("finetune.py", "train.jsonl", "cpu-2node.yaml"):
        shutil.copy(EXAMPLE / name, folder / name)
    tiny_model(folder / "tiny")
    job = yaml.safe_load((folder / "cpu-2node.yaml").read_text())
    command = job["launch"]["command"]
    for option, value in changed.items():
        flag = f"--{option}"
        if flag in command:
            command[command.index(flag) + 1] = value
        else:
            command += [flag, value]
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    return folder / "job.yaml"


def test_the_example_trains_data_parallel_stops_with_a_checkpoint_and_resumes_to_completed(tmp_path: Path) -> None:
    config = example_job(tmp_path, max_steps=str(STEPS), save_steps=str(SAVE_STEPS))
    rows = len((tmp_path / "train.jsonl").read_text().splitlines())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("ACCELERATE_USE_CPU", None)
    submit = [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", config.name]
    run_dir = tmp_path / "runs" / "own-program-cpu"

    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (tmp_path / "output" / f"checkpoint-{SAVE_STEPS}" / "trainer_state.json").exists():
            assert time.time() < deadline and first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.1)
        os.kill(first.pid, signal.SIGINT)  # jobgen alone, as a time limit's warning reaches the batch shell
        said, _ = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    status = json.loads(jobgen("status", "--json", str(run_dir)).stdout)
    stopped = status["segments"][-1]
    assert stopped["outcome"] not in ("completed", "failed", "running or lost"), (stopped, said[-3000:])
    stopped_at = int(stopped["last_step"])
    assert SAVE_STEPS <= stopped_at < STEPS
    # train() returned after the stop: the script saw JobgenCallback.stopped_at and saved no final model.
    assert not (tmp_path / "output" / "final").exists()

    second = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*.out")))
    assert f"resuming from {tmp_path}/output/checkpoint-{stopped_at}" in logs
    status = json.loads(jobgen("status", "--json", str(run_dir)).stdout)
    assert [s["outcome"] for s in status["segments"]][-1] == "completed", status["segments"]
    assert (tmp_path / "output" / "final" / "config.json").exists()
    state = json.loads((tmp_path / "output" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    # One data-parallel run: each step takes BATCH rows on each of the 2 ranks, so an epoch is half
    # the steps one process would take (two separate copies each counted rows / BATCH a epoch).
    assert state["global_step"] == STEPS
    assert state["epoch"] == STEPS / (rows / (BATCH * 2)), state["epoch"]
    assert "parallel_mode != ParallelMode.DISTRIBUTED" not in logs

    # jobgen plot: the loss is the Trainer's log_history (the newest checkpoint's trainer_state.json),
    # each segment's steps its own; no goodput, which would need the program's training time.
    drawn = jobgen("plot", str(run_dir), "-o", str(tmp_path / "run.png"), "--data", str(tmp_path / "run.json"))
    assert drawn.returncode == 0, drawn.stderr
    data = json.loads((tmp_path / "run.json").read_text())
    first, second = data["segments"]
    assert first["steps"] == list(range(1, stopped_at + 1)) and second["steps"] == list(range(stopped_at + 1, STEPS + 1))
    assert first["loss"] + second["loss"] == [r["loss"] for r in state["log_history"] if "loss" in r]
    assert data["goodput"] is None and data["goodput_unknown"] == "n/a: an own program (launch.command) tells jobgen no training time"


def test_the_example_reports_to_wandb_and_mlflow_with_one_report_to_word(tmp_path: Path, monkeypatch) -> None:
    """HfArgumentParser takes one word after --report_to (`--report_to wandb mlflow` is refused:
    "Some specified arguments are not used"); the example splits `wandb,mlflow`, and rank 0 logs
    every step once into the one W&B and MLflow run jobgen keeps (launch.report_to)."""
    from mlflow.tracking import MlflowClient

    from tests.test_trackers import wandb_history

    config = example_job(tmp_path, max_steps="4", report_to="wandb,mlflow")
    job = yaml.safe_load(config.read_text())
    job["launch"]["report_to"] = ["wandb", "mlflow"]
    config.write_text(yaml.safe_dump(job))
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
           "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"), "WANDB_DATA_DIR": str(tmp_path / "wandb-data")}
    for name in ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    ran = jobgen("submit", "-s", "local", config.name, cwd=tmp_path, env=env, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    run_dir = tmp_path / "runs" / "own-program-cpu"
    kept = json.loads((run_dir / "trackers.json").read_text())
    rows = [row for row in wandb_history(run_dir, kept["wandb"]) if "train/loss" in row]
    assert [row["train/global_step"] for row in rows] == [1, 2, 3, 4]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=kept["mlflow"]["tracking_uri"])
    assert sorted(metric.step for metric in client.get_metric_history(kept["mlflow"]["run_id"], "loss")) == [1, 2, 3, 4]
