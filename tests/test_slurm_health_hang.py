"""The health gate and the hang supervisor, on the real Slurm test cluster (tests/cluster).

- A node whose environment differs (a node-specific setup line puts a stale site-packages first
  on one node's PYTHONPATH, as a site gets it wrong) ends the job before the model loads, naming
  that node and the difference; the job is not requeued.
- A 2-node LoRA job whose second node's rank processes are stopped with SIGSTOP at a random step
  (a real hang: the other rank blocks in its collective) ends as `hung` naming that node within
  the bound, is resubmitted without it, resumes from its last checkpoint and finishes with
  adapter weights bitwise equal to an uninterrupted run.
- The same job with all of node 1's processes killed at once (a node going down) ends that segment
  as `node_failed` naming the node, and finishes the same way in a continuation without it.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import yaml

from jobgen.rundir.files import rank_log
from jobgen.train.heartbeat import detection_delay
from tests.cluster.fixtures import SlurmTestCluster
from tests.helpers import assert_at_most_one_step_lost, jobgen
from tests.processes import hang_node, kill_node
from tests.test_slurm_requeue import (  # noqa: F401 - fixtures: tiny, reference
    MAX_STEPS, assert_bitwise_equal, goodput_of, job_fields, job_file, reference, segments, submit, tiny, trained_steps,
    wait_for, wait_for_step, wait_until_done,
)

pytestmark = pytest.mark.usefixtures("slurm_side_cluster")

PARTITION = SlurmTestCluster.side_partition


def hostnames(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()


def fake_site_packages(folder: Path, package: str, version: str) -> Path:
    """A folder that claims another version of `package` (a stale install's metadata)."""
    info = folder / f"{package}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return folder


def test_a_node_with_another_package_version_ends_the_job_before_the_model_loads(tmp_path: Path, tiny: Path) -> None:
    stale = fake_site_packages(tmp_path / "stale-site", "peft", "0.0.1")
    setup = [f'if [[ $NODE_RANK == 1 ]]; then export PYTHONPATH={stale}${{PYTHONPATH:+:$PYTHONPATH}}; fi']
    config = job_file(tmp_path / "job", tiny, "health-mismatch", PARTITION)
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "environment": {"setup": setup}}))
    job_id = submit("jobgen-submit", config, step_delay=0)
    assert wait_until_done(job_id, timeout=900) == "FAILED"
    run_dir = config.parent / "runs" / "jobgen-test-health-mismatch"
    second = hostnames(job_fields(job_id)["NodeList"])[1]
    from importlib.metadata import version

    line = f"node {second}: peft 0.0.1, the other node {version('peft')}"
    log = jobgen("logs", str(run_dir)).stdout
    assert f"jobgen: training failed: health check: {line}; not requeued" in log
    assert [s["outcome"] for s in segments(run_dir)] == ["failed"]
    assert job_fields(job_id)["Restarts"] == "0"
    health = json.loads((run_dir / "health.json").read_text())
    assert health["ok"] is False and health["problems"] == [line] and health["bad_nodes"] == [second]
    assert health["nodes"][second]["differed"] == ["peft"]
    # Before the model loads: no rank reached it, so no start-up record and no checkpoint.
    assert not (run_dir / "output" / "startup.jsonl").exists()
    assert "model " not in (run_dir / rank_log(job_id, 0)).read_text().split("health check")[-1]
    status = jobgen("status", str(run_dir)).stdout
    assert f"health check of job {job_id}: {line}" in status


def test_a_hung_node_is_named_excluded_and_the_job_finishes_exactly(tmp_path: Path, tiny: Path, reference: dict) -> None:
    config = job_file(tmp_path / "job", tiny, "hang", PARTITION)
    job_id = submit("jobgen-submit", config, step_delay=2)
    run_dir = config.parent / "runs" / "jobgen-test-hang"
    stop_at = random.randint(9, 10)  # in steady training (past heartbeat.WARM_PAUSES): the quick bound
    # The cluster is shared: the job may wait for nodes before its steps start.
    wait_for(lambda: job_fields(job_id).get("JobState") == "RUNNING", "the job to start", timeout=900, every=3)
    wait_for_step(run_dir, stop_at)
    wait_for(lambda: (run_dir / "heartbeat" / "node-1.json").exists(), "node 1's heartbeat")
    nodes = hostnames(job_fields(job_id)["NodeList"])
    stopped_at = hang_node(run_dir, 1)
    hang = json.loads((run_dir / "hang.json").read_text())
    detected = hang["at"] - stopped_at
    assert hang["nodes"] == nodes[1], hang
    assert f"stopped first: node {nodes[1]} (rank 1: stopped)" in hang["message"], hang
    assert detected <= hang["bound_seconds"] + detection_delay(len(nodes)), (detected, hang)  # docs/exit-codes.md
    assert wait_until_done(job_id) == "COMPLETED"  # it ended by submitting its continuation
    first = segments(run_dir)[0]
    assert first["outcome"] == "hung"
    assert (run_dir / "excluded-nodes").read_text().split() == [nodes[1]]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: hung: {hang['message']}" in log
    assert "submitted without node(s)" in log
    # Every rank's stack is in its log.
    for rank in (0, 1):
        text = (run_dir / rank_log(job_id, rank)).read_text()
        assert "jobgen hang supervisor: rank" in text and "File " in text, rank
    continuation = wait_for(lambda: len(segments(run_dir)) > 1 and segments(run_dir)[1]["job_id"], "the continuation to start", timeout=600)
    assert wait_until_done(continuation, timeout=600) == "COMPLETED"
    assert nodes[1] not in hostnames(job_fields(continuation)["NodeList"])
    second = segments(run_dir)[1]
    assert second["outcome"] == "completed" and second["restart"] == 1
    if nodes[0] in hostnames(job_fields(continuation)["NodeList"]):
        # Node 0 holds both ranks' snapshots of the steps before the stop (training.snapshot_every).
        assert_at_most_one_step_lost(run_dir, second["first_step"], stopped_at)
    else:  # no node of the hung run: its last periodic checkpoint
        assert second["first_step"] >= stop_at - 4 and second["first_step"] % 4 == 0
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    status = json.loads(jobgen("status", str(run_dir), "--json").stdout)
    assert status["excluded_nodes"] == [nodes[1]]
    assert [s["outcome"] for s in status["segments"]] == ["hung", "completed"]
    assert all(s["health"]["ok"] and s["health"]["bus_bandwidth_gbps"] > 0 for s in status["segments"])
    # The continuation is the run's newest submission: status asks Slurm of it, not of the ended job.
    assert [s["job_id"] for s in status["submissions"]] == [job_id, continuation]
    assert status["scheduler_state"]["job_id"] == continuation
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"hang at step ~{stop_at}: detected after {detected:.0f} s (bound {hang['bound_seconds']:.0f} s), "
          f"first new step {first_new_step - stopped_at:.0f} s after the stop; process-group timeout 1800 s; "
          f"goodput {goodput_of(run_dir)}")


def test_a_node_whose_processes_are_killed_is_excluded_and_the_job_continues_exactly(tmp_path: Path, tiny: Path, reference: dict) -> None:
    """All of node 1's processes are killed at once (SIGKILL, as when a node goes down): node 0's
    rank fails for want of it within seconds, the segment is a node failure naming node 1 (before,
    a failure of the job, not requeued), and the continuation without node 1 finishes exactly."""
    config = job_file(tmp_path / "job", tiny, "kill", PARTITION)
    job_id = submit("jobgen-submit", config, step_delay=2)
    run_dir = config.parent / "runs" / "jobgen-test-kill"
    kill_at = random.randint(3, 7)
    wait_for(lambda: job_fields(job_id).get("JobState") == "RUNNING", "the job to start", timeout=900, every=3)
    nodes = hostnames(job_fields(job_id)["NodeList"])
    wait_for_step(run_dir, kill_at)
    wait_for(lambda: (run_dir / "heartbeat" / "node-1.json").exists(), "node 1's heartbeat")
    killed_at = kill_node(run_dir, 1)
    assert wait_until_done(job_id) == "COMPLETED"  # it ended by submitting its continuation
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: node failure: node(s) {nodes[1]} lost: all of its processes ended at once without a status" in log, log
    assert "submitted without node(s)" in log
    continuation = wait_for(lambda: len(segments(run_dir)) > 1 and segments(run_dir)[1]["job_id"], "the continuation to start", timeout=600)
    assert wait_until_done(continuation, timeout=600) == "COMPLETED"
    assert nodes[1] not in hostnames(job_fields(continuation)["NodeList"])
    first, second = segments(run_dir)
    assert (first["outcome"], second["outcome"], second["restart"]) == ("node_failed", "completed", 1)
    assert (run_dir / "excluded-nodes").read_text().split() == [nodes[1]]
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"node killed at step ~{kill_at}: first new step {first_new_step - killed_at:.0f} s after the kill, in the continuation; "
          f"goodput {goodput_of(run_dir)}")


def test_a_node_stopped_during_a_checkpoint_save_is_named_and_the_job_finishes_exactly(
        tmp_path: Path, tiny: Path, reference: dict, monkeypatch) -> None:
    """The same, with the stop inside the save of step 8 (JOBGEN_DEBUG_SAVE_PAUSE holds every rank
    5 s in its write so that the test can stop node 2 there); requeue.hang_seconds: 20 sets the bound.
    (With training.async_save, the default, the write runs beside training and a stop there is a
    hang in training, which the first test covers.)"""
    monkeypatch.setenv("JOBGEN_DEBUG_SAVE_PAUSE", "write@8:5")
    # Synchronous saves: every rank is inside the save, not training beside a background write;
    # no snapshots, so that the checkpoints on disk alone decide where it resumes.
    config = job_file(tmp_path / "job", tiny, "hang-save", PARTITION, requeue={"hang_seconds": 20}, training={"async_save": False, "snapshot_every": 0})
    job_id = submit("jobgen-submit", config, step_delay=1)
    run_dir = config.parent / "runs" / "jobgen-test-hang-save"
    wait_for(lambda: job_fields(job_id).get("JobState") == "RUNNING", "the job to start", timeout=900, every=3)
    wait_for(lambda: (run_dir / "output" / "debug-save-pause-write-rank1").exists(), "node 2 inside the save of step 8",
             timeout=300, every=0.2)
    nodes = hostnames(job_fields(job_id)["NodeList"])
    stopped_at = hang_node(run_dir, 1)
    hang = json.loads((run_dir / "hang.json").read_text())
    detected = hang["at"] - stopped_at
    assert hang["phase"] == "saving" and hang["bound_seconds"] == 20 and hang["nodes"] == nodes[1], hang
    assert f"stopped first: node {nodes[1]} (rank 1: stopped)" in hang["message"], hang
    assert detected <= 20 + 5 + 15, (detected, hang)  # the bound after the pause, and the supervisors' polling
    assert wait_until_done(job_id) == "COMPLETED"
    assert segments(run_dir)[0]["outcome"] == "hung"
    continuation = wait_for(lambda: len(segments(run_dir)) > 1 and segments(run_dir)[1]["job_id"], "the continuation to start", timeout=600)
    assert wait_until_done(continuation, timeout=600) == "COMPLETED"
    assert nodes[1] not in hostnames(job_fields(continuation)["NodeList"])
    second = segments(run_dir)[1]
    # From the newest complete checkpoint: step 4's, or step 8's where the stopped rank, continued
    # for its stack dump, finished its part of the save before it was killed (its pause had run out).
    assert second["outcome"] == "completed" and second["first_step"] in (4, 8), second
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    print(f"hang in the save of step 8: detected after {detected:.0f} s (bound {hang['bound_seconds']:.0f} s)")
