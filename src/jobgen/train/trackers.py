"""Experiment trackers (training.report_to): TensorBoard, W&B and MLflow, logged by rank 0.

Each logging step's record goes to every tracker as `train/KEY` at the optimizer step, so a run
resumed from step N logs N+1 first and no step twice. W&B and MLflow continue one run across all
segments of a jobgen run, by the ids kept in the run directory (jobgen.rundir.trackers).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from typing import Any, Optional

from jobgen.errors import UserError
from jobgen.rundir.files import MLFLOW_STORE
from jobgen.rundir.trackers import keep_id, new_wandb_id, wandb_offline_folders

log = logging.getLogger("jobgen.train")

# The package each tracker needs, and what installs it.
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
NOT_LOGGED = ("step", "total_steps", "restart")  # the step is the axis; the others are bookkeeping


def check_installed(trackers: list[str]) -> None:
    """Before any process group or model load, alike on every rank: one line per missing package."""
    for tracker in trackers:
        module, package = PACKAGES[tracker]
        if importlib.util.find_spec(module) is None:
            raise UserError(f"training.report_to has {tracker} but the {module} package is not installed on this node: "
                            f"pip install {package}")


def mlflow_tracking_uri(configured: Optional[str], run_dir: str) -> str:
    """The job's mlflow_tracking_uri, else the environment's MLFLOW_TRACKING_URI, else a file
    store in the run directory (which MLflow 3 accepts only when asked: MLFLOW_ALLOW_FILE_STORE)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return "file:" + os.path.join(os.path.abspath(run_dir), MLFLOW_STORE)


class Trackers:
    """Rank 0's trackers for one segment: `log(record)` each logging step, `close(completed)` at its end."""

    def __init__(self, names: list[str], run_dir: str, output_dir: str, run_name: str, config: dict,
                 mlflow_uri: Optional[str] = None) -> None:
        self.tensorboard: Optional[Any] = None
        self.wandb: Optional[Any] = None
        self.mlflow: Optional[tuple[Any, str]] = None  # (client, run id)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if "wandb" in names:
            self.wandb = _start_wandb(run_dir, run_name, config)
        if "mlflow" in names:
            self.mlflow = _start_mlflow(run_dir, run_name, mlflow_tracking_uri(mlflow_uri, run_dir))

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
    # Compute nodes often have no internet: offline unless the user chose a mode.
    mode = os.environ.get("WANDB_MODE") or "offline"
    run = wandb.init(id=run_id, resume="allow", dir=run_dir, name=run_name, config=config, mode=mode,
                     settings=wandb.Settings(silent=True))
    if mode == "offline":
        log.info("W&B run %s is offline; to upload it, from a machine with internet: wandb sync %s",
                 run_id, wandb_offline_folders(run_dir, run_id))
    else:
        log.info("W&B run %s (%s)", run_id, mode)
    return run


def _start_mlflow(run_dir: str, run_name: str, uri: str) -> tuple[Any, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)

    def create() -> dict:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_name
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        return {"run_id": client.create_run(experiment_id, run_name=run_name).info.run_id, "tracking_uri": uri}

    kept = keep_id(run_dir, "mlflow", create)
    if kept["tracking_uri"] != uri:
        raise UserError(
            f"training.mlflow_tracking_uri: this run's MLflow run {kept['run_id']} is in {kept['tracking_uri']}, "
            f"this start would log to {uri}: set mlflow_tracking_uri (or MLFLOW_TRACKING_URI) back to it"
        )
    client.update_run(kept["run_id"], status="RUNNING")
    log.info("MLflow run %s in %s", kept["run_id"], uri)
    return client, kept["run_id"]
