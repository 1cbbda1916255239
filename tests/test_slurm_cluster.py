"""The Slurm test cluster behaves like the multi-node cluster jobgen's jobs will meet.

These tests check the cluster itself (tests/cluster/slurm-cluster.sh), so that a failure in a
jobgen integration test can be trusted to be jobgen's. They need root and the Slurm packages.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time

SUBMIT_TIMEOUT_S = 60


def run(*command: str, timeout: float = SUBMIT_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict (values are single words, e.g. Reason=BeginTime)."""
    shown = run("scontrol", "--oneliner", "show", "job", job_id)
    assert shown.returncode == 0, shown.stderr
    return dict(re.findall(r"(\w+)=(\S*)", shown.stdout))


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.5)


def test_all_ten_nodes_are_up(slurm_cluster):
    # %N, not %n: %n is the node's hostname, which is "localhost" for every node here.
    listing = run("sinfo", "--Node", "--noheader", "--format=%N %t")
    assert listing.returncode == 0, listing.stderr
    states = dict(line.split() for line in listing.stdout.splitlines())
    assert sorted(states) == sorted(slurm_cluster.nodes + slurm_cluster.side_nodes + slurm_cluster.binding_nodes)
    unusable = {node: state for node, state in states.items() if state not in {"idle", "mix", "alloc"}}
    assert not unusable, f"nodes not usable: {unusable}\n{run('sinfo', '-N', '-l').stdout}"


def test_node_names_resolve_for_rendezvous(slurm_cluster):
    # Every node is at 127.0.0.1 (NodeAddr), and so is its name: jobs' MASTER_ADDR is the NodeAddr.
    assert {socket.gethostbyname(node) for node in slurm_cluster.nodes + slurm_cluster.side_nodes + slurm_cluster.binding_nodes} == {"127.0.0.1"}


def test_three_node_job_sees_one_task_per_node(slurm_cluster, tmp_path):
    output = tmp_path / "hosts.out"
    submitted = run(
        "sbatch", "--wait", "-N3", "--ntasks-per-node=1", "--job-name=jobgen-test-hosts",
        f"--output={output}",
        "--wrap", "srun bash -c 'echo $SLURM_NODEID $SLURMD_NODENAME $SLURM_JOB_NUM_NODES'",
    )
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert sorted(output.read_text().splitlines()) == ["0 node1 3", "1 node2 3", "2 node3 3"]


def test_eight_gpus_per_node_can_be_requested(slurm_cluster):
    checked = run("sbatch", "--test-only", "--gpus-per-node=8", "-N2", "--wrap", "true")
    assert checked.returncode == 0, checked.stderr
    assert "node[1-2]" in checked.stderr  # "sbatch: Job N to start at ... on nodes node[1-2] ..."


def _submit_held(*options: str) -> subprocess.CompletedProcess[str]:
    # A real submission, as a user's: --test-only accepts some jobs that submission refuses and
    # vice versa. Held and named, so that a job wrongly accepted never runs and is cancelled.
    return run("sbatch", "--hold", "--job-name=jobgen-test-refused", *options, "--wrap", "true")


def test_more_nodes_than_the_cluster_has_is_refused(slurm_cluster):
    refused = _submit_held("-N5")
    assert refused.returncode != 0, f"-N5 was accepted: {refused.stdout}"
    assert "Batch job submission failed: Node count specification invalid" in refused.stderr


def test_unknown_partition_is_refused(slurm_cluster):
    refused = _submit_held("--partition=nope")
    assert refused.returncode != 0, f"--partition=nope was accepted: {refused.stdout}"
    assert "invalid partition specified: nope" in refused.stderr


def test_high_partition_job_preempts_and_requeues_debug_job(slurm_cluster):
    # Takes about 35 s: the preempted job keeps running for GraceTime=30 s before it is requeued.
    low = high = None
    try:
        low = run(
            "sbatch", "--parsable", "--requeue", "--exclusive", "-N4",
            f"--partition={slurm_cluster.default_partition}", "--job-name=jobgen-test-preempted",
            "--output=/dev/null", "--wrap", "sleep 300",
        ).stdout.strip()
        assert low.isdigit(), f"submitting the debug job failed: {low!r}"
        wait_for(lambda: job_fields(low)["JobState"] == "RUNNING", 30, f"debug job {low} to run")

        high = run(
            "sbatch", "--parsable", "--exclusive", "-N4",
            f"--partition={slurm_cluster.preempting_partition}", "--job-name=jobgen-test-preemptor",
            "--output=/dev/null", "--wrap", "sleep 300",
        ).stdout.strip()
        assert high.isdigit(), f"submitting the high job failed: {high!r}"

        wait_for(
            lambda: int(job_fields(low)["Restarts"]) >= 1
            and job_fields(high)["JobState"] == "RUNNING",
            80, f"debug job {low} to be requeued and high job {high} to run",
        )
        requeued = job_fields(low)
        assert requeued["JobState"] in {"PENDING", "REQUEUED", "COMPLETING"}, requeued
    finally:
        run("scancel", *(job for job in (low, high) if job and job.isdigit()))
