"""jobgen's PBS Pro jobs on an OpenPBS complex whose nodes are separate hosts
(tests/cluster/openpbs_hosts.py): the job submitted on the server host, its chunks on two other
hosts whose own name is 127.0.1.1 on themselves, each with a first interface that routes nowhere,
the run folder on a network file system that each host mounts on its own, and pbsdsh starting
the second node's task through the MoMs and pbs_comm, with the task's bare environment. About 3
minutes, half of it the uninterrupted reference run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from tests.cluster.hosts import assert_probe_met_at_node_0
from tests.helpers import assert_bitwise_equal
from tests.test_pbs_scripts import probe_job
# reference and tiny are fixtures: the uninterrupted run and the tiny model, as the PBS servers' tests have them.
from tests.test_pbs_servers import MAX_STEPS, SAVE_INTERVAL, lora_job, reference, tiny, trained_steps, wait_for_step  # noqa: F401


def submit(cluster, job: dict) -> tuple[str, Path]:
    """`jobgen submit` on host1 from a folder of the shared file system; the job id and the run
    directory as this machine (the file server) sees it."""
    # A PBS job starts as a login shell, its PATH afresh: the job's setup puts jobgen on it.
    job["environment"] = {**job.get("environment", {}), "setup": [f"source {Path(sys.executable).parent}/activate"]}
    folder = cluster.served / job["name"]
    folder.mkdir()
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.run("host1", ["sh", "-c", 'cd "$0" && exec "$@"', str(cluster.shared / job["name"]),
                                      sys.executable, "-m", "jobgen.cli", "submit", "-s", "pbs", "job.yaml"])
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.split()[-1], folder / "runs" / job["name"]


def wait_until_finished(cluster, job_id: str, run_dir: Path, timeout: float) -> str:
    """The job's `qstat -xf` once it has finished (job_state F)."""
    deadline = time.monotonic() + timeout
    while "job_state = F" not in (shown := cluster.run("host1", ["qstat", "-xf", job_id]).stdout):
        if time.monotonic() > deadline:
            logs = "".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.rglob("*.log")) if p.is_file())
            raise AssertionError(f"OpenPBS job {job_id} not finished after {timeout} s:\n{shown}\n{logs}")
        time.sleep(1)
    return shown


def test_jobgen_openpbs_ranks_on_separate_hosts_meet_at_the_first_chunks_address(openpbs_on_hosts) -> None:
    cluster = openpbs_on_hosts
    job_id, run_dir = submit(cluster, {**probe_job(2, 2), "name": "probe"})
    shown = wait_until_finished(cluster, job_id, run_dir, 240)
    assert "Exit_status = 0" in shown, shown
    assert_probe_met_at_node_0(run_dir, cluster)


def test_jobgen_openpbs_training_rerun_on_separate_hosts_stops_with_a_checkpoint_and_resumes_bitwise(
        openpbs_on_hosts, tiny: Path, reference: dict) -> None:
    # The operator's qrerun sends SIGTERM to every process of the job on both hosts (SIGKILL after
    # the queue's kill_delay): the ranks save where they are, through host2's and host3's own
    # mounts, and the job, run again under its id, resumes from that save read back through them.
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "rerun", setup=[], step_delay=2)
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 2)
    rerun = cluster.run("host1", ["qrerun", job_id])
    assert rerun.returncode == 0, rerun.stderr
    shown = wait_until_finished(cluster, job_id, run_dir, 480)
    assert "Exit_status = 0" in shown and "run_count = 2" in shown, shown
    status = cluster.run("host1", [sys.executable, "-m", "jobgen.cli", "status", str(cluster.shared / run_dir.relative_to(cluster.served)),
                                   "--json"])
    assert status.returncode == 0, status.stderr
    first, second = json.loads(status.stdout)["segments"]
    assert first["outcome"] == "preempted" and first["last_step"] >= SAVE_INTERVAL + 2, first
    assert (second["outcome"], second["first_step"], second["restart"]) == ("completed", first["last_step"], 1), second
    assert trained_steps(run_dir)[-1] == MAX_STEPS
    assert_bitwise_equal(run_dir, reference)
