"""A sweep on the local scheduler, for real: its points run one after another, each in its own run
directory, and `jobgen status|plot|logs|cancel` of the sweep's folder read every point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import jobgen, tiny_model

STEPS = 3


def test_a_local_sweep_runs_its_points_in_turn_and_reads_back_as_one_table(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    tiny_model(tiny)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({
        "name": "local-sweep",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": STEPS, "save_interval": STEPS},
    }))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml",
                             "--sweep", "training.learning_rate=1e-4,3e-4"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep_dir = tmp_path / "runs" / "local-sweep"
    names = ["learning_rate=1e-4", "learning_rate=3e-4"]
    assert [line.split("\t")[1] for line in result.stdout.splitlines()] == names
    assert "sweep point 1 of 2: learning_rate=1e-4" in result.stderr and "sweep point 2 of 2" in result.stderr

    status = json.loads(jobgen("status", str(sweep_dir), "--json").stdout)
    assert [(p["name"], p["values"], p["state"], p["step"]) for p in status["points"]] == [
        (names[0], {"training.learning_rate": 1e-4}, "completed", STEPS),
        (names[1], {"training.learning_rate": 3e-4}, "completed", STEPS),
    ]
    assert all(isinstance(p["last_loss"], float) and p["final_model"] for p in status["points"])
    table = jobgen("status", str(sweep_dir)).stdout
    assert "training.learning_rate" in table and "completed" in table and "0.0003" in table
    # One point alone, by its folder, as any run.
    one = json.loads(jobgen("status", str(sweep_dir / names[1]), "--json").stdout)
    assert [s["outcome"] for s in one["segments"]] == ["completed"]

    picture, data = tmp_path / "sweep.png", tmp_path / "sweep.json"
    plotted = jobgen("plot", str(sweep_dir), "-o", str(picture), "--data", str(data))
    assert plotted.returncode == 0, plotted.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [(p["name"], p["steps"]) for p in json.loads(data.read_text())["points"]] == [(n, [1, 2, 3]) for n in names]

    logs = jobgen("logs", str(sweep_dir)).stdout
    assert all(f"==> {name} (" in logs for name in names) and logs.count("training completed at step 3") == 2
    follow = jobgen("logs", "-f", str(sweep_dir))
    assert follow.returncode == 2 and "give a point's folder" in follow.stderr
    cancelled = jobgen("cancel", str(sweep_dir))
    assert cancelled.returncode == 0 and "cancelled 0 point(s)" in cancelled.stderr
