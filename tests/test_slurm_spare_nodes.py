"""Spare nodes on the real Slurm test cluster (tests/cluster): `resources.spare_nodes: 1` holds a
third node beside the job's two. Node 1's rank is stopped with SIGSTOP at a random step (a real
hang: node 0's rank blocks in its collective). The job ends that segment as `hung`, and restarts at
once inside its own allocation on node 0 and the spare: no new job, no wait in the queue. It
finishes with adapter weights bitwise equal to an uninterrupted run, and prints the time from the
stop to the first new step (BENCHMARKS.md), against which test_slurm_health_hang.py prints that of
today's continuation without spares."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from jobgen.train.heartbeat import detection_delay
from tests.cluster.fixtures import SlurmTestCluster
from tests.helpers import assert_at_most_one_step_lost, jobgen
from tests.processes import hang_node, kill_node
from tests.test_slurm_health_hang import hostnames
from tests.test_slurm_requeue import (  # noqa: F401 - fixtures: tiny, reference
    MAX_STEPS, assert_bitwise_equal, goodput_of, job_fields, job_file, reference, segments, submit, tiny, trained_steps,
    wait_for, wait_for_step, wait_until_done,
)

pytestmark = pytest.mark.usefixtures("slurm_side_cluster")

PARTITION = SlurmTestCluster.side_partition


def spare_job_at_a_random_step(tmp_path: Path, tiny: Path, name: str, steps: tuple[int, int] = (3, 7)
                               ) -> tuple[str, Path, list[str], int]:
    """The 2-node job with one spare, submitted and followed to a random step in `steps` with node
    1's heartbeat published: its job id, run directory, allocated nodes and that step."""
    config = job_file(tmp_path / "job", tiny, name, PARTITION, resources={"spare_nodes": 1})
    job_id = submit("jobgen-submit", config, step_delay=2)
    run_dir = config.parent / "runs" / f"jobgen-test-{name}"
    at_step = random.randint(*steps)
    wait_for(lambda: job_fields(job_id).get("JobState") == "RUNNING", "the job to start", timeout=900, every=3)
    allocated = hostnames(job_fields(job_id)["NodeList"])
    assert len(allocated) == 3, allocated
    wait_for_step(run_dir, at_step)
    wait_for(lambda: (run_dir / "heartbeat" / "node-1.json").exists(), "node 1's heartbeat")
    return job_id, run_dir, allocated, at_step


def test_a_hung_node_is_replaced_by_the_spare_inside_the_allocation_and_the_job_finishes_exactly(
        tmp_path: Path, tiny: Path, reference: dict) -> None:
    # In steady training (past heartbeat.WARM_PAUSES), where the quick bound applies.
    job_id, run_dir, allocated, stop_at = spare_job_at_a_random_step(tmp_path, tiny, "spare", steps=(9, 10))
    stopped_at = hang_node(run_dir, 1)
    hang = json.loads((run_dir / "hang.json").read_text())
    detected = hang["at"] - stopped_at
    assert hang["nodes"] == allocated[1], hang
    assert detected <= hang["bound_seconds"] + detection_delay(2), (detected, hang)
    assert wait_until_done(job_id, timeout=600) == "COMPLETED"
    # One job: the restart ran inside it, on node 0 and the spare, node ranks in allocation order.
    first, second = segments(run_dir)
    assert (first["job_id"], first["restart"], first["outcome"]) == (job_id, 0, "hung"), first
    assert (second["job_id"], second["restart"], second["outcome"]) == (job_id, 1, "completed"), second
    # From the survivor's memory: node 0 holds both ranks' snapshots of the steps before the stop.
    assert_at_most_one_step_lost(run_dir, second["first_step"], stopped_at)
    assert (run_dir / "excluded-nodes").read_text().split() == [allocated[1]]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: hung: {hang['message']}" in log
    assert (f"jobgen: restarting inside this allocation without node(s) {allocated[1]} on 2 node(s) (restart 1 of at most 3; "
            "spare(s) left: none)") in log, log
    assert f"jobgen: job {job_id} (restart 1) on {allocated[0]} {allocated[2]};" in log, log
    assert "submitted without node(s)" not in log and job_fields(job_id)["Restarts"] == "0"
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    status = json.loads(jobgen("status", str(run_dir), "--json").stdout)
    assert [s["outcome"] for s in status["segments"]] == ["hung", "completed"]
    assert [s["job_id"] for s in status["submissions"]] == [job_id]
    assert status["excluded_nodes"] == [allocated[1]]
    text = jobgen("status", str(run_dir)).stdout
    assert "hung" in text and "completed" in text, text
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"spare nodes: hang at step ~{stop_at}: detected after {detected:.0f} s (bound {hang['bound_seconds']:.0f} s), "
          f"first new step {first_new_step - stopped_at:.0f} s after the stop, inside the allocation; goodput {goodput_of(run_dir)}")


def test_a_node_whose_processes_are_killed_is_replaced_by_the_spare_and_the_job_finishes_exactly(
        tmp_path: Path, tiny: Path, reference: dict) -> None:
    """All of node 1's processes are killed at once (SIGKILL, as when a node goes down): node 0's
    rank fails for want of its peer, node 1 records nothing, and the segment is a node failure
    naming node 1 (docs/exit-codes.md); the job restarts at once on node 0 and the spare."""
    job_id, run_dir, allocated, kill_at = spare_job_at_a_random_step(tmp_path, tiny, "spare-kill")
    killed_at = kill_node(run_dir, 1)
    assert wait_until_done(job_id, timeout=600) == "COMPLETED"
    first, second = segments(run_dir)
    assert (first["job_id"], first["restart"], first["outcome"]) == (job_id, 0, "node_failed"), first
    assert (second["job_id"], second["restart"], second["outcome"]) == (job_id, 1, "completed"), second
    assert (run_dir / "excluded-nodes").read_text().split() == [allocated[1]]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: node failure: node(s) {allocated[1]} lost: all of its processes ended at once without a status" in log, log
    assert f"jobgen: job {job_id} (restart 1) on {allocated[0]} {allocated[2]};" in log, log
    assert_at_most_one_step_lost(run_dir, second["first_step"], killed_at)
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    ended = json.loads([line for line in (run_dir / "segments.jsonl").read_text().splitlines() if '"end"' in line][0])
    print(f"spare nodes: node killed at step ~{kill_at}: segment ended {ended_seconds(ended) - killed_at:.0f} s after the kill, "
          f"first new step {first_new_step - killed_at:.0f} s after it, inside the allocation; goodput {goodput_of(run_dir)}")


def ended_seconds(record: dict) -> float:
    from datetime import datetime

    return datetime.fromisoformat(record["at"].replace("Z", "+00:00")).timestamp()


def test_a_node_range_job_goes_on_without_a_hung_node_inside_its_allocation_with_the_same_losses(tmp_path: Path, tiny: Path) -> None:
    """`resources.nodes: "2-3"` given 3 nodes, without spares: node 1 is stopped, and the job
    restarts at once on the other 2 of its allocation, the global batch of 12 kept. Its losses are
    those of an uninterrupted 2-node run of the same job, run beside it on the cluster's two other
    nodes (partition bind): resizing's guarantee, the same samples make each step, split over
    other ranks."""
    from tests.test_slurm_resize import job_file as resize_job_file, losses

    def job(name: str, nodes, partition: str = PARTITION) -> Path:
        config = resize_job_file(tmp_path / name, tiny, name, nodes=nodes, partition=partition)
        fields = yaml.safe_load(config.read_text())
        fields["training"].update(max_steps=MAX_STEPS, save_interval=4)
        fields["requeue"] = {"max_restarts": 3, "warning_seconds": 30}
        config.write_text(yaml.safe_dump(fields))
        return config

    config, reference_config = job("shrink", "2-3"), job("shrink-reference", 2, partition="bind")
    job_id = submit("jobgen-submit", config, step_delay=2)
    reference_id = submit("jobgen-submit", reference_config, step_delay=0)
    run_dir = config.parent / "runs" / "jobgen-test-shrink"
    wait_for(lambda: job_fields(job_id).get("JobState") == "RUNNING", "the job to start", timeout=900, every=3)
    allocated = hostnames(job_fields(job_id)["NodeList"])
    assert len(allocated) == 3, allocated  # what the partition has free, up to 3
    stop_at = random.randint(5, 7)
    wait_for_step(run_dir, stop_at)
    wait_for(lambda: (run_dir / "heartbeat" / "node-1.json").exists(), "node 1's heartbeat")
    stopped_at = hang_node(run_dir, 1)
    assert json.loads((run_dir / "hang.json").read_text())["nodes"] == allocated[1]
    assert wait_until_done(job_id, timeout=600) == "COMPLETED"
    assert wait_until_done(reference_id, timeout=600) == "COMPLETED"
    first, second = segments(run_dir)
    assert (first["job_id"], first["outcome"], second["job_id"], second["restart"], second["outcome"]) == (
        job_id, "hung", job_id, 1, "completed"), (first, second)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: restarting inside this allocation without node(s) {allocated[1]} on 2 node(s)" in log, log
    assert f"jobgen: job {job_id} (restart 1) on {allocated[0]} {allocated[2]};" in log, log
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").rglob("*") if p.is_file())
    assert "global batch 12 = 3 ranks x micro-batch 2 x 2 accumulation" in logs
    assert "global batch 12 = 2 ranks x micro-batch 3 x 2 accumulation" in logs  # after the restart: the same batch
    expected = losses(reference_config.parent / "runs" / "jobgen-test-shrink-reference")
    got = losses(run_dir)  # a step trained twice (before the hang and after it) counts by its last line
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-6, abs=0), step
    worst = max(abs(got[step] - expected[step]) for step in got)
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"node range 2-3: hang at step ~{stop_at}; first new step {first_new_step - stopped_at:.0f} s after the stop, "
          f"on 2 nodes inside the allocation; largest loss difference to the 2-node run {worst:.2e}")
