"""A sweep as one Slurm job array on the real test cluster: 4 points, at most 2 running, one task
preempted on its own; every point completes, and each final adapter is bitwise the adapter of the
same point run alone.

Each point is a 1-node LoRA fine-tune of a tiny model (DeepSpeed ZeRO-2 on gloo), slowed by
JOBGEN_DEBUG_STEP_DELAY so that the test can preempt one task mid-training. The preemptor is an
exclusive job in the `high` partition on that task's node only, so the other tasks run on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import jobgen
from tests.test_slurm_requeue import (  # noqa: F401 (tiny is a fixture)
    VENV_PATH,
    adapter,
    job_fields,
    release_when_requeued,
    segments,
    tiny,
    trained_steps,
    wait_for,
    wait_until_done,
)

pytestmark = pytest.mark.usefixtures("slurm_cluster")

MAX_STEPS = 8
LEARNING_RATES = ("1e-4", "3e-4")
RANKS = (4, 8)


def base_job(folder: Path, tiny: Path, name: str) -> Path:
    job = {
        "name": name,
        "run_dir": "run",
        # Exclusive, as every run of this test: the sweep's tasks and the runs alone get the same allocation.
        "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:20:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1},
        "training": {
            "model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
            "per_device_batch_size": 2, "max_length": 64, "max_steps": MAX_STEPS, "save_interval": 4,
        },
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def run_jobgen(config: Path, *args: str, step_delay: float) -> str:
    env = {**os.environ, "PATH": VENV_PATH, "JOBGEN_DEBUG_STEP_DELAY": str(step_delay)}
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(config), *args],
                         cwd=config.parent, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def running_tasks(array_id: str) -> set[str]:
    listing = subprocess.run(["squeue", "--noheader", "--array", "--states=RUNNING", "--format=%i", "--jobs", array_id],
                             capture_output=True, text=True).stdout
    return {line.strip() for line in listing.splitlines() if line.strip()}


def test_a_sweep_runs_as_one_array_and_each_point_matches_its_run_alone(tmp_path: Path, tiny: Path) -> None:
    # Each point alone, as a plain job: the reference for its adapter.
    alone = {}
    for lr in LEARNING_RATES:
        for r in RANKS:
            config = base_job(tmp_path / f"alone-{lr}-{r}", tiny, f"jobgen-test-sweep-alone-{lr}-{r}")
            job_id = run_jobgen(config, "--set", f"training.learning_rate={lr}", "--set", f"training.lora.r={r}", step_delay=0).strip()
            alone[(lr, r)] = (job_id, config.parent / "run")

    config = base_job(tmp_path / "sweep", tiny, "jobgen-test-sweep")
    out = run_jobgen(config, "--sweep", f"training.learning_rate={','.join(LEARNING_RATES)}",
                     "--sweep", f"training.lora.r={','.join(map(str, RANKS))}", "--max-running", "2", step_delay=2)
    tasks = dict(line.split("\t")[::-1] for line in out.splitlines())  # point name -> ARRAYID_K
    sweep_dir = config.parent / "run"
    record = json.loads((sweep_dir / "sweep.json").read_text())
    array_id = record["array_job_id"]
    assert [p["name"] for p in record["points"]] == [f"learning_rate={lr},r={r}" for lr in LEARNING_RATES for r in RANKS]
    assert tasks == {p["name"]: f"{array_id}_{p['index']}" for p in record["points"]}
    assert "#SBATCH --array=0-3%2" in (sweep_dir / "job.slurm.sh").read_text()

    # Preempt task 1 once it has trained two steps; meanwhile no more than 2 tasks ever run at once.
    victim = record["points"][1]
    victim_dir, victim_id = Path(victim["run_dir"]), victim["job_id"]
    seen_running: list[set[str]] = []

    def victim_at_step_2() -> bool:
        seen_running.append(running_tasks(array_id))
        return any(s >= 2 for s in trained_steps(victim_dir))

    wait_for(victim_at_step_2, f"step 2 of task {victim_id}", timeout=300)
    node = job_fields(victim_id)["NodeList"]
    subprocess.run(["sbatch", "-p", "high", "--exclusive", "-N1", "-w", node, "--job-name=jobgen-test-preemptor",
                    "--output=/dev/null", "--wrap", "sleep 3"], check=True, capture_output=True)
    release_when_requeued(victim_id, restarts=1)

    def all_done() -> bool:
        seen_running.append(running_tasks(array_id))
        return all(job_fields(p["job_id"]).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") for p in record["points"])

    wait_for(all_done, "every task of the sweep to end", timeout=600, every=2)
    assert max(len(found) for found in seen_running) <= 2, seen_running

    for point in record["points"]:
        run_dir = Path(point["run_dir"])
        assert job_fields(point["job_id"])["JobState"] == "COMPLETED", point["name"]
        assert sorted(trained_steps(run_dir)) == list(range(1, MAX_STEPS + 1)), point["name"]
        history = segments(run_dir)
        if point is victim:
            first, second = history
            assert (first["outcome"], second["outcome"]) == ("preempted", "completed")
            assert second["first_step"] == first["last_step"] >= 2
            assert job_fields(victim_id)["Restarts"] == "1"
        else:
            assert [s["outcome"] for s in history] == ["completed"], point["name"]
        assert {s["job_id"] for s in history} == {point["job_id"]}
        lr, r = point["name"].split(",")
        job_id, alone_dir = alone[(lr.split("=")[1], int(r.split("=")[1]))]
        assert wait_until_done(job_id) == "COMPLETED"
        mine, reference = adapter(run_dir), adapter(alone_dir)
        assert mine.keys() == reference.keys()
        assert all(torch.equal(mine[name], reference[name]) for name in mine), f"{point['name']}: adapter differs from its run alone"
    # Four different runs, not four copies of one: each point's adapter differs from the others'.
    finals = [adapter(Path(p["run_dir"])) for p in record["points"]]
    for i, one in enumerate(finals):
        for other in finals[i + 1:]:
            assert one.keys() != other.keys() or any(not torch.equal(one[k], other[k]) for k in one)

    status = json.loads(jobgen("status", str(sweep_dir), "--json").stdout)
    assert [(p["job_id"], p["state"], p["step"]) for p in status["points"]] == [
        (p["job_id"], "completed", MAX_STEPS) for p in record["points"]]
    assert all(p["last_loss"] is not None and 0 < p["goodput"] <= 1 for p in status["points"])
    # The array's own id names the whole sweep.
    assert json.loads(jobgen("status", array_id, "--json").stdout)["sweep"] == str(sweep_dir.resolve())
    table = jobgen("status", str(sweep_dir)).stdout
    assert "training.learning_rate" in table and victim_id in table
    # A task by its Slurm name, as for any job.
    assert json.loads(jobgen("status", victim_id, "--json").stdout)["segments"][0]["outcome"] == "preempted"
    logs = jobgen("logs", str(sweep_dir)).stdout
    assert all(f"==> {p['name']} ({p['job_id']}) <==" in logs for p in record["points"])
    picture = tmp_path / "sweep.png"
    assert jobgen("plot", str(sweep_dir), "-o", str(picture)).returncode == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"sweep {array_id}: task {victim_id} preempted at step {segments(victim_dir)[0]['last_step']}; "
          f"at most {max(len(found) for found in seen_running)} running at once; {time.strftime('%H:%M:%S')}")
