"""Experiment trackers (training.report_to): TensorBoard, W&B and MLflow, logged by rank 0.

Each logging step's record goes to every tracker as `train/KEY` at the optimizer step, so a run
resumed from step N logs N+1 first and no step twice. W&B and MLflow continue one run across all
segments of a jobgen run, by the ids kept in the run directory (jobgen.rundir.trackers).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from typing import Any, Optional

from jobgen.errors import UserError
from jobgen.rundir.files import MLFLOW_STORE
from jobgen.rundir.trackers import keep_id, kept_ids, new_wandb_id, wandb_offline_folders

log = logging.getLogger("jobgen.train")

# The package each tracker needs, and what installs it.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
NOT_LOGGED = ("step", "time", "total_steps", "restart")  # the step is the axis; the others are bookkeeping


def check_installed(trackers: list[str], field: str = "training.report_to") -> None:
    """Before any process group or model load, alike on every rank: one line for a missing package."""
    for tracker in trackers:
        module, package = PACKAGES[tracker]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"{field} has {tracker} but the {module} package is not installed on this node: "
                            f"pip install {package}")


def mlflow_tracking_uri(run_dir: str) -> str:
    """MLFLOW_TRACKING_URI (environment.variables, the site's or the nodes' environment), else a
    file store in the run directory, which MLflow 3 takes only when asked (MLFLOW_ALLOW_FILE_STORE)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return "file:" + os.path.join(os.path.abspath(run_dir), MLFLOW_STORE)


def wandb_mode() -> str:
    """Compute nodes often have no internet: offline unless the user chose a mode."""
    return os.environ.get("WANDB_MODE") or "offline"


def own_program_environment(trackers: list[str], run_dir: str, keeper: bool) -> dict[str, str]:
    """What the job's own program (launch.command, launch.report_to) reads to continue the run's one
    tracker run, as the Hugging Face Trainer's callbacks read it. Made by jobgen-torchrun, where the
    program's packages are, before its ranks start; node 0 (`keeper`) makes the ids at the first
    start, and is the one writer of trackers.json; other nodes pass on what is kept (all of it
    from the second start on; rank 0, which alone reports, is node 0's with static rendezvous)."""
    check_installed(trackers, "launch.report_to")
    kept = kept_ids(run_dir)
    env: dict[str, str] = {}
    if "wandb" in trackers:
        run_id = keep_id(run_dir, "wandb", new_wandb_id) if keeper else kept.get("wandb")
        env.update(WANDB_RESUME="allow", WANDB_DIR=run_dir, WANDB_MODE=wandb_mode())
        if run_id:
            env["WANDB_RUN_ID"] = run_id
        if keeper and env["WANDB_MODE"] == "offline":
            print(f"jobgen-torchrun: W&B run {run_id} is offline; to upload it, from a machine with internet: "
                  f"wandb sync {wandb_offline_folders(run_dir, run_id)}", file=sys.stderr, flush=True)
    if "mlflow" in trackers:
        uri = mlflow_tracking_uri(run_dir)
        env["MLFLOW_TRACKING_URI"] = uri
        if "MLFLOW_ALLOW_FILE_STORE" in os.environ:
            env["MLFLOW_ALLOW_FILE_STORE"] = os.environ["MLFLOW_ALLOW_FILE_STORE"]
        # Named after the run directory: jobgen-torchrun does not read the job.
        run_id = mlflow_run(run_dir, os.path.basename(run_dir), uri)[1] if keeper else (kept.get("mlflow") or {}).get("run_id")
        if run_id:
            env["MLFLOW_RUN_ID"] = run_id
    return env


class Trackers:
    """Rank 0's trackers for one segment: `log(record)` each logging step, `close(completed)` at its end."""

    def __init__(self, names: list[str], run_dir: str, output_dir: str, run_name: str, config: dict) -> None:
        self.tensorboard: Optional[Any] = None
        self.wandb: Optional[Any] = None
        self.mlflow: Optional[tuple[Any, str]] = None  # (client, run id)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if "wandb" in names:
            self.wandb = _start_wandb(run_dir, run_name, config)
        if "mlflow" in names:
            uri = mlflow_tracking_uri(run_dir)
            self.mlflow = mlflow_run(run_dir, run_name, uri)
            log.info("MLflow run %s in %s", self.mlflow[1], uri)

    def log(self, record: dict) -> None:
        step = record["step"]
        values = {f"train/{key}": value for key, value in record.items()
                  if key not in NOT_LOGGED and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self.tensorboard is not None:
            for key, value in values.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            from mlflow.entities import Metric

            client, run_id = self.mlflow
            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(key, float(value), now, step) for key, value in values.items()])

    def close(self, completed: bool = False) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            client, run_id = self.mlflow
            # KILLED until the run's last segment: a stopped run is requeued and continues.
            client.set_terminated(run_id, "FINISHED" if completed else "KILLED")


def _start_wandb(run_dir: str, run_name: str, config: dict) -> Any:
    import wandb

    run_id = keep_id(run_dir, "wandb", new_wandb_id)
    mode = wandb_mode()
    run = wandb.init(id=run_id, resume="allow", dir=run_dir, name=run_name, config=config, mode=mode,
                     settings=wandb.Settings(silent=True))
    if mode == "offline":
        log.info("W&B run %s is offline; to upload it, from a machine with internet: wandb sync %s",
                 run_id, wandb_offline_folders(run_dir, run_id))
    else:
        log.info("W&B run %s (%s)", run_id, mode)
    return run


def mlflow_run(run_dir: str, run_name: str, uri: str) -> tuple[Any, str]:
    """(client, run id) of the run's one MLflow run in `uri`: created at the first start, kept,
    and set running again at every later one."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)

    def create() -> dict:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_name
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(name)
            except Exception:  # noqa: BLE001 - another point of a sweep created it since we looked
                # (a tracking server answers RESOURCE_ALREADY_EXISTS): theirs is ours.
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        return {"run_id": client.create_run(experiment_id, run_name=run_name).info.run_id, "tracking_uri": uri}

    kept = keep_id(run_dir, "mlflow", create)
    if kept["tracking_uri"] != uri:
        raise UserError(
            f"MLFLOW_TRACKING_URI: this run's MLflow run {kept['run_id']} is in {kept['tracking_uri']}, this start "
            f"would log to {uri}: set MLFLOW_TRACKING_URI back to it (environment.variables), or start a new run"
        )
    client.update_run(kept["run_id"], status="RUNNING")
    return client, kept["run_id"]
