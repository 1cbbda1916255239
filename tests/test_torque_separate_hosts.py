"""jobgen's Torque jobs on a Torque complex whose nodes are separate hosts
(tests/cluster/torque_hosts.py): the job submitted on the server host, its nodes two other hosts
whose own name is 127.0.1.1 on themselves, each with a first interface that routes nowhere, the
run folder on a network file system that each host mounts on its own, and pbsdsh (through the
MoMs, with the tasks' bare environment) starting every node. About 5 minutes, most of it the
uninterrupted reference run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from tests.cluster.hosts import assert_probe_met_at_node_0
from tests.helpers import assert_at_most_one_step_lost, assert_bitwise_equal
from tests.test_pbs_scripts import probe_job
# reference and tiny are fixtures: the uninterrupted run and the tiny model, as the Torque server's tests have them.
from tests.test_pbs_servers import MAX_STEPS, SAVE_INTERVAL, lora_job, reference, tiny, trained_steps, wait_for_step  # noqa: F401


def submit(cluster, job: dict) -> tuple[str, Path]:
    """`jobgen submit` by the job user on host1, from a folder of the shared file system; the job
    id and the run directory as this machine (the file server) sees it."""
    job["environment"] = {**job.get("environment", {}), "setup": [f"source {cluster.venv}/bin/activate"]}
    folder = cluster.served / job["name"]
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.as_user(["jobgen", "submit", "-s", "torque", "job.yaml"], cwd=cluster.shared / job["name"])
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.split()[-1], folder / "runs" / job["name"]


def wait_until_complete(cluster, job_id: str, run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while "job_state = C" not in cluster.run("host1", ["qstat", "-f", job_id]).stdout:
        if time.monotonic() > deadline:
            logs = "".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())
            raise AssertionError(f"Torque job {job_id} not complete after {timeout} s:\n{logs}")
        time.sleep(1)


def test_jobgen_torque_ranks_on_separate_hosts_meet_at_the_mother_superiors_address(torque_on_hosts) -> None:
    cluster = torque_on_hosts
    job_id, run_dir = submit(cluster, {**probe_job(2, 2), "name": "probe"})
    wait_until_complete(cluster, job_id, run_dir, 240)
    assert_probe_met_at_node_0(run_dir, cluster)


def test_jobgen_torque_training_rerun_on_separate_hosts_resumes_bitwise_from_the_shared_file_system(
        torque_on_hosts, tiny: Path, reference: dict) -> None:
    # The operator's qrerun kills both nodes at once (no time to save); the job starts again
    # under its id on the same hosts and resumes from the step it reached or the one before, a
    # peer snapshot written out as a checkpoint through one host's mount and read back through
    # both hosts' own, whose caches show it late.
    cluster = torque_on_hosts
    job = lora_job(tiny, "rerun", setup=[], step_delay=2)
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 2)
    rerun = cluster.run("host1", ["qrerun", job_id])
    assert rerun.returncode == 0, rerun.stderr
    wait_until_complete(cluster, job_id, run_dir, 480)
    status = cluster.as_user(["jobgen", "status", str(cluster.shared / run_dir.relative_to(cluster.served)), "--json"],
                             cwd=cluster.shared)
    assert status.returncode == 0, status.stderr
    first, second = json.loads(status.stdout)["segments"]
    assert first["outcome"] == "killed by the scheduler" and first["last_step"] >= SAVE_INTERVAL + 2, first
    assert (second["outcome"], second["restart"]) == ("completed", 1), second
    assert_at_most_one_step_lost(run_dir, second["first_step"], reached=first["last_step"])
    assert trained_steps(run_dir)[-1] == MAX_STEPS
    assert_bitwise_equal(run_dir, reference)
