"""Shared fixtures for the trainer tests: one tiny model per session, job files, torchrun launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")


def subprocess_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def torchrun_command(job: Path, nproc: int, launcher_args: tuple = ()) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", *launcher_args, f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", "-m", "jobgen.train", "--job", str(job),
    ]


def train(job: Path, nproc: int = 2, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run jobgen-train under torchrun to the end; stdout and stderr together in .stdout."""
    return subprocess.run(
        torchrun_command(job, nproc), cwd=job.parent, env=subprocess_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )


def start(job: Path, nproc: int = 2, launcher_args: tuple = (), **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_command(job, nproc, launcher_args), cwd=job.parent, env=subprocess_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 180, log: Path = None) -> None:
    """Until the trainer has logged `step`. Its output is in proc.stdout (a pipe), or in `log` for a
    process whose output goes to a file; either way a failure shows it."""
    def output() -> str:
        return log.read_text(errors="replace")[-20000:] if log else proc.stdout.read()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        if proc.poll() is not None:
            raise AssertionError(f"trainer ended before step {step}:\n{output()}")
        time.sleep(0.1)
    if log:
        raise AssertionError(f"step {step} not reached in {timeout}s; the trainer's output so far:\n{output()}")
    raise AssertionError(f"step {step} not reached in {timeout}s")


def exit_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "trainer-exit.json").read_text())


def adapter_weights(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output_dir / "final" / "adapter_model.safetensors"))


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """DIR with model/ (tiny random Llama + tokenizer) and data.json (48 conversations)."""
    from jobgen.train.tiny import build

    directory = tmp_path_factory.mktemp("tiny")
    build(str(directory), conversations=48)
    return directory


def write_job(run_dir: Path, tiny: Path, procs: int = 2, collective_timeout_minutes: int = 3, **training) -> Path:
    """RUN_DIR/job.yaml for a CPU job on the tiny model (LoRA with dropout unless overridden); a
    test that hangs in a collective fails after `collective_timeout_minutes`, not the default 30."""
    run_dir.mkdir(parents=True, exist_ok=True)
    section = {
        "model": str(tiny / "model"),
        "data": str(tiny / "data.json"),
        "method": "lora",
        "precision": "fp32",
        "per_device_batch_size": 2,
        "gradient_accumulation": 2,
        "epochs": 2,
        "save_interval": 3,
        "max_length": 128,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1},
    }
    section.update(training)
    job = {
        "name": run_dir.name,
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": procs, "collective_timeout_minutes": collective_timeout_minutes},
        "training": section,
    }
    path = run_dir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture
def make_job(tiny, tmp_path):
    """make_job(name, procs=2, **training) -> RUN_DIR/job.yaml under this test's tmp_path."""
    return lambda name="run", procs=2, **training: write_job(tmp_path / name, tiny, procs, **training)


@pytest.fixture(scope="session")
def tools():
    """The helpers above, for module-scoped fixtures and tests."""
    import types

    return types.SimpleNamespace(
        train=train, start=start, wait_for_step=wait_for_step, exit_report=exit_report,
        adapter_weights=adapter_weights, write_job=write_job, subprocess_env=subprocess_env,
    )
