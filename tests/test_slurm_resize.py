"""A job resubmitted on another number of nodes, on the real Slurm test cluster: a 2-node LoRA
fine-tune (real DeepSpeed ZeRO-2 on gloo) stopped with a checkpoint, then submitted again with
`resources.nodes: 3`, finishes from where it stopped, with the loss curve of the same job run on
2 nodes without a stop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.fixtures import SlurmTestCluster
from tests.helpers import tiny_model
from tests.test_slurm_requeue import job_fields, trained_steps, wait_for, wait_until_done

pytestmark = pytest.mark.usefixtures("slurm_side_cluster")

PARTITION = SlurmTestCluster.side_partition
MAX_STEPS = 8
# The cluster is shared: a job may wait for nodes behind other tests' jobs.
QUEUE_SECONDS = 900
VENV_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def job_file(folder: Path, tiny: Path, name: str, nodes: int | str, partition: str = PARTITION) -> Path:
    job = {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": nodes, "gpus_per_node": 0, "time_limit": "00:20:00", "partition": partition, "exclusive": True},
        "launch": {"procs_per_node": 1},
        # 12 samples per step: 6 per rank on 2 nodes (3 x 2 rounds), 4 on 3 (2 x 2). No dropout:
        # its masks are drawn per rank, so they differ when the ranks hold other samples.
        "training": {
            "model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
            "per_device_batch_size": 3, "gradient_accumulation": 2, "max_length": 64, "max_steps": MAX_STEPS,
            "save_interval": 100, "lora": {"r": 4, "alpha": 8, "dropout": 0.0},
        },
        # Off: the stop ends the job, and the user submits it again, on 3 nodes.
        "requeue": {"enabled": False, "warning_seconds": 30},
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def submit(config: Path, step_delay: float) -> str:
    env = {**os.environ, "PATH": VENV_PATH, "JOBGEN_DEBUG_STEP_DELAY": str(step_delay)}
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(config)],
                         cwd=config.parent, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model(folder)
    return folder


def test_a_2_node_job_stopped_and_submitted_again_on_3_nodes_finishes_from_where_it_stopped(tmp_path: Path, tiny: Path) -> None:
    reference_config = job_file(tmp_path / "reference", tiny, "resize-reference", nodes=2)
    config = job_file(tmp_path / "resized", tiny, "resize", nodes=2)
    reference_id = submit(reference_config, step_delay=0)
    first_id = submit(config, step_delay=1.0)
    run_dir = config.parent / "runs" / "jobgen-test-resize"
    wait_for(lambda: any(step >= 2 for step in trained_steps(run_dir)), "step 2", timeout=QUEUE_SECONDS)
    # What the scheduler sends before the time limit: the ranks stop together with a checkpoint.
    subprocess.run(["scancel", "--batch", "--signal=USR1", first_id], check=True)
    wait_until_done(first_id, timeout=QUEUE_SECONDS)
    stopped = json.loads((run_dir / "trainer-exit.json").read_text())
    assert stopped["reason"] == "stopped" and 2 <= stopped["last_step"] < MAX_STEPS, stopped
    assert wait_until_done(reference_id, timeout=QUEUE_SECONDS) == "COMPLETED"  # frees its nodes for the 3-node job

    job_file(tmp_path / "resized", tiny, "resize", nodes=3)
    second_id = submit(config, step_delay=0)
    assert wait_until_done(second_id, timeout=QUEUE_SECONDS) == "COMPLETED"
    assert job_fields(second_id)["NumNodes"] == "3"
    report = json.loads((run_dir / "trainer-exit.json").read_text())
    assert (report["reason"], report["first_step"], report["last_step"]) == ("completed", stopped["last_step"], MAX_STEPS)
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    assert "global batch 12 = 3 ranks x micro-batch 2 x 2 accumulation" in logs  # the same batch, split in 3
    expected, got = losses(reference_config.parent / "runs" / "jobgen-test-resize-reference"), losses(run_dir)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))  # every step once: 2 nodes, then 3
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=0), step
