"""jobgen's Slurm jobs on a Slurm cluster whose nodes are separate hosts (tests/cluster/slurm_hosts.py):
node names that resolve nowhere (only NodeAddr reaches a node), hostnames that are 127.0.1.1 on
themselves, a first interface that routes nowhere, and a run folder on a network file system that
each node mounts on its own."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobgen.train.heartbeat import detection_delay
from tests.cluster import hosts as separate
from tests.cluster.hosts import REAL_INTERFACE, in_the_write_of_step_8, powered_off_hosts
from tests.cluster.slurm_hosts import CACHE_SECONDS
from tests.helpers import assert_at_most_one_step_lost, assert_bitwise_equal, tiny_model, uninterrupted_adapter
from tests.processes import hang_node
from tests.test_pbs_scripts import probe_job
from tests.test_slurm_requeue import MAX_STEPS, SAVE_INTERVAL, segments, trained_steps, wait_for

ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}


def test_slurm_nodes_are_separate_hosts_whose_names_resolve_nowhere(slurm_on_hosts) -> None:
    ran = slurm_on_hosts.on_login(["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", "echo $SLURMD_NODENAME $(hostname)"])
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == ["cn001 host2", "cn002 host3"]
    for host in slurm_on_hosts.hosts:
        assert host.run(["getent", "hosts", "cn001"], capture_output=True).returncode != 0


def submit(cluster, name: str, job: dict, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """`jobgen submit` of `job` on the login node, from the shared folder; the job id and the run
    directory as this machine sees it (the file server's folder)."""
    job["name"] = name
    (cluster.served / name).mkdir()
    (cluster.served / name / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.on_login([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", f"{name}/job.yaml"], env=env or {})
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.strip().split()[-1], cluster.served / "runs" / name


def wait_until_ended(cluster, job_id: str, run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while cluster.on_login(["squeue", "-h", "-j", job_id]).stdout.strip():
        if time.monotonic() > deadline:
            logs = "".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())
            raise AssertionError(f"job {job_id} still in the queue after {timeout} s:\n{logs}")
        time.sleep(1)


def test_jobgen_slurm_ranks_on_separate_hosts_meet_at_the_first_nodes_address(slurm_on_hosts) -> None:
    job_id, run_dir = submit(slurm_on_hosts, "probe", probe_job(2, 2))
    wait_until_ended(slurm_on_hosts, job_id, run_dir, 180)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"))]
    summary = [(r["RANK"], r["hostname"], r["SLURMD_NODENAME"], r["MASTER_ADDR"], r["GLOO_SOCKET_IFNAME"], r["all_reduce_sum"])
               for r in records]
    first = slurm_on_hosts.node("cn001").address
    assert summary == [(str(rank), f"host{rank // 2 + 2}", f"cn00{rank // 2 + 1}", first, REAL_INTERFACE, 10)
                       for rank in range(4)]


def test_jobgen_slurm_c10d_rendezvous_on_separate_hosts_is_hosted_by_node_0(slurm_on_hosts) -> None:
    # torch's c10d backend guesses which node hosts its store by comparing the endpoint (the first
    # node's NodeAddr) with the machine's own names, which resolve to 127.0.1.1 here: left to guess,
    # no node hosts it and every node fails to connect. node.sh says it: node 0 hosts.
    job = probe_job(2, 2)
    job["launch"]["rendezvous"] = "c10d"
    job_id, run_dir = submit(slurm_on_hosts, "probe-c10d", job)
    wait_until_ended(slurm_on_hosts, job_id, run_dir, 180)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"))]
    logs = "".join(p.read_text()[-1500:] for p in sorted((run_dir / "logs").glob("*.out")))
    assert [(r["hostname"], r["all_reduce_sum"]) for r in records] == [("host2", 10), ("host2", 10), ("host3", 10), ("host3", 10)], logs


def job_state(cluster, job_id: str) -> dict[str, str]:
    shown = cluster.on_login(["scontrol", "-o", "show", "job", job_id]).stdout
    return dict(word.split("=", 1) for word in shown.split() if "=" in word)


def training(cluster) -> dict:
    tiny = cluster.served / "tiny"
    if not tiny.exists():
        tiny_model(tiny)
    model, data = cluster.shared / "tiny" / "model", cluster.shared / "tiny" / "data.json"
    return {
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(model), "data": str(data), "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": MAX_STEPS, "save_interval": SAVE_INTERVAL},
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }


def ended(cluster, job_id: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_state(cluster, job_id).get("JobState")) not in ENDED:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {state} after {timeout} s\n{what_slurm_and_the_logs_say(cluster, job_id)}")
        time.sleep(1)
    return state


def what_slurm_and_the_logs_say(cluster, job_id: str) -> str:
    """What a person would look at when a job does not end: the job, the nodes, the run's logs."""
    shown = [cluster.on_login(argv).stdout for argv in (["scontrol", "show", "job", job_id], ["sinfo", "-N", "-l"],
                                                           ["squeue", "-s", "-j", job_id])]
    run_dir = next((p for p in (cluster.served / "runs").glob("*") if (p / "logs" / f"{job_id}.out").exists()), None)
    logs = [] if run_dir is None else [f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*")) if p.is_file()]
    return "\n".join(shown + logs)


@pytest.fixture(scope="module")
def reference(slurm_on_hosts) -> dict:
    """The training run once without interruption: its adapter (tests.helpers.uninterrupted_adapter,
    trained on this machine once per test run for every module whose training is this one)."""
    return uninterrupted_adapter(training(slurm_on_hosts)["training"], slurm_on_hosts.served / "tiny")


def test_jobgen_slurm_training_preempted_on_separate_hosts_resumes_bitwise_from_the_shared_file_system(
        slurm_on_hosts, reference: dict) -> None:
    # The checkpoint is written through host1's mount and read back through each host's own, whose
    # caches show the other's writes late; the data store is prepared once for both hosts.
    cluster = slurm_on_hosts
    job_id, run_dir = submit(cluster, "preempted", training(cluster), env={"JOBGEN_DEBUG_STEP_DELAY": "2"})
    wait_for(lambda: any(step >= 2 for step in trained_steps(run_dir)), "step 2", 300)
    preemptor = cluster.on_login(["sbatch", "-p", "high", "--exclusive", f"-N{len(cluster.node_names)}", "--output=/dev/null",
                                  "--wrap", "sleep 3"])
    assert preemptor.returncode == 0, preemptor.stderr
    wait_for(lambda: job_state(cluster, job_id).get("JobState") == "PENDING" and job_state(cluster, job_id).get("Restarts") == "1",
             "the requeue", 120)
    time.sleep(3)  # Slurm's clean-up of the last allocation (see tests/test_slurm_requeue.py)
    assert cluster.on_login(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]).returncode == 0
    assert ended(cluster, job_id) == "COMPLETED"
    first, second = segments(run_dir)
    assert (first["outcome"], second["outcome"]) == ("preempted", "completed")
    assert second["first_step"] == first["last_step"] >= 2
    assert sorted(trained_steps(run_dir)) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    # What the user sees of it: Slurm counts one restart, jobgen status names the preemption.
    assert job_state(cluster, job_id)["Restarts"] == "1"
    status = cluster.on_login([sys.executable, "-m", "jobgen.cli", "status", "runs/preempted", "--json"])
    assert json.loads(status.stdout)["segments"][0]["outcome"] == "preempted", status.stderr


def test_jobgen_slurm_a_hung_first_node_on_separate_hosts_is_replaced_by_the_spare_and_the_master_moves(
        slurm_on_hosts, reference: dict) -> None:
    # Node 0 is the rendezvous: without it the restart's master is another host, whose NodeAddr
    # (not its NodeName, which resolves nowhere) the ranks must be given. The heartbeats the hang
    # supervisor reads are the other host's, through its own mount's cache.
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["spare_nodes"] = 1
    job_id, run_dir = submit(cluster, "spare", job, env={"JOBGEN_DEBUG_STEP_DELAY": "2"})
    stop_at = random.randint(9, 10)  # in steady training (past heartbeat.WARM_PAUSES): the quick bound
    wait_for(lambda: any(step >= stop_at for step in trained_steps(run_dir)), f"step {stop_at}", 300)
    wait_for(lambda: (run_dir / "heartbeat" / "node-0.json").exists(), "node 0's heartbeat", 60)
    stopped_at = hang_node(run_dir, 0)
    hang = json.loads((run_dir / "hang.json").read_text())
    assert hang["nodes"] == "cn001", hang
    # Within the bound and the supervisors' own delays, and those of each mount's cache.
    assert hang["at"] - stopped_at <= hang["bound_seconds"] + detection_delay(len(cluster.node_names)) + CACHE_SECONDS, hang
    state = ended(cluster, job_id, 600)
    assert state == "COMPLETED", what_slurm_and_the_logs_say(cluster, job_id)
    first, second = segments(run_dir)
    assert (first["outcome"], second["outcome"], second["restart"], second["job_id"]) == ("hung", "completed", 1, job_id)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: job {job_id} (restart 1) on cn002 cn003;" in log, log
    # The restart's ranks met at cn002's address (host3), on its routed interface.
    restarted = (run_dir / "logs" / f"{job_id}-node0.out").read_text()
    assert f"sockets on {REAL_INTERFACE}, the interface toward {cluster.node('cn002').address}" in restarted, restarted[-3000:]
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"separate hosts, spare: node 0 hung at step ~{stop_at}: detected after {hang['at'] - stopped_at:.0f} s "
          f"(bound {hang['bound_seconds']:.0f} s, phase {hang['phase']}, by node {hang['detected_by_node']}), "
          f"first new step {first_new_step - stopped_at:.0f} s after the stop")


# Real node failures (tests/cluster/slurm_hosts.py: the host's link down, then every process of it
# killed, slurmd included). Slurm marks such a node DOWN after SlurmdTimeout (30 s here) and cuts it
# out of a --no-kill job; the job must go on without it and end as an uninterrupted run.

def restart_figures(run_dir: Path, first: dict, second: dict, failed_at: float) -> str:
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    first_new_step = min(m["time"] for m in metrics if m["step"] == second["first_step"] + 1 and m["time"] > failed_at)
    reached = max(m["step"] for m in metrics if m["time"] <= failed_at)
    return (f"first new step {first_new_step - failed_at:.0f} s after the failure; reached step {reached}, resumed from "
            f"{second['first_step']}: {reached - second['first_step']} step(s) trained again")


@pytest.fixture
def powered_off(slurm_on_hosts):
    yield from powered_off_hosts(slurm_on_hosts)


def worker_replaced_by_the_spare(cluster, name: str, reference: dict, fault, env: dict[str, str] | None = None,
                                 when=("step 5", lambda run_dir: any(step >= 5 for step in trained_steps(run_dir)))
                                 ) -> tuple[Path, dict, dict, float]:
    """A 2-node job with a spare whose node 1 (cn002; cn001 runs the batch script, cn003 is the
    spare) meets `fault(cluster, "cn002")` at `when` (what, a test of the run directory): the
    segment ends `node_failed` naming it, the job restarts on cn001 cn003 and ends as the
    uninterrupted run. Returns the run directory, both segments and the time of the fault."""
    job = training(cluster)
    job["resources"]["spare_nodes"] = 1
    job_id, run_dir = submit(cluster, name, job, env={"JOBGEN_DEBUG_STEP_DELAY": "2", **(env or {})})
    wait_for(lambda: when[1](run_dir), when[0], 300, every=0.2)
    assert job_state(cluster, job_id)["NodeList"] == "cn[001-003]"
    failed_at = fault(cluster, "cn002")
    assert ended(cluster, job_id, 600) == "COMPLETED"
    first, second = segments(run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", ["cn002"], "completed"), log
    assert f"jobgen: job {job_id} (restart 1) on cn001 cn003;" in log, log
    # Whoever knew first: Slurm (DOWN or not responding), or the hang supervisors, whose probes the
    # node did not answer while the others waited.
    assert "the scheduler says they are gone" in log or "cn002 (rank 1) does not answer on the network" in log, log
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    assert_at_most_one_step_lost(run_dir, second["first_step"], failed_at)  # node 0 holds node 1's snapshots
    return run_dir, first, second, failed_at


def test_jobgen_slurm_a_worker_powered_off_while_it_writes_a_checkpoint_is_replaced_by_the_spare_and_the_run_ends_bitwise_equal(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # Node 1 goes down with its part of step 8's checkpoint unwritten (its write held 5 s; the
    # default asynchronous save, so training goes on beside it), once node 0 holds node 1's
    # snapshot of step 8 (a step saved in the background is snapshotted too): the half-written
    # checkpoint is not taken; the restart resumes from step 8, held in node 0's memory.
    powered_off.append("cn002")

    run_dir, first, second, failed_at = worker_replaced_by_the_spare(
        slurm_on_hosts, "power-off-in-save", reference, lambda cluster, node: cluster.power_off(node),
        env={"JOBGEN_DEBUG_SAVE_PAUSE": "write@8:5"},
        when=("node 1 inside its write of step 8's checkpoint, its snapshot of step 8 in node 0's memory", lambda run_dir: in_the_write_of_step_8(run_dir, "cn001")))
    assert second["first_step"] == 8, second
    assert not (run_dir / "output" / "checkpoints" / "step-000008" / "manifest.json").exists() or "written_from" in json.loads(
        (run_dir / "output" / "checkpoints" / "step-000008" / "manifest.json").read_text())
    status = slurm_on_hosts.on_login([sys.executable, "-m", "jobgen.cli", "status", "runs/power-off-in-save"]).stdout
    cost = next((line.strip() for line in status.splitlines() if "after node_failed (cn002)" in line), status)
    assert cost.startswith("restart 1 of job ") and ": no step trained again; first new step after " in cost, cost
    print(f"power-off of a worker in its checkpoint write, spare in the allocation: "
          f"{restart_figures(run_dir, first, second, failed_at)}; jobgen status: {cost}")


def released_when_requeued(cluster, job_id: str, timeout: float = 300) -> None:
    """Slurm holds a requeued job back for a while (its BeginTime); the test lets it start now."""
    wait_for(lambda: job_state(cluster, job_id).get("JobState") == "PENDING" and job_state(cluster, job_id).get("Restarts") == "1",
             "the requeue", timeout)
    time.sleep(3)  # Slurm's clean-up of the last allocation (see tests/test_slurm_requeue.py)
    assert cluster.on_login(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]).returncode == 0


def test_jobgen_slurm_a_powered_off_batch_host_is_requeued_by_a_surviving_node_and_the_run_ends_bitwise_equal(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # Under --no-kill Slurm cuts the DOWN batch host out of the job and keeps the job RUNNING on the
    # others, its batch script gone: a surviving node must requeue it.
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["spare_nodes"] = 1
    job_id, run_dir = submit(cluster, "power-off-batch-host", job, env={"JOBGEN_DEBUG_STEP_DELAY": "2"})
    wait_for(lambda: any(step >= 5 for step in trained_steps(run_dir)), "step 5", 300)
    batch_host = job_state(cluster, job_id)["BatchHost"]
    powered_off.append(batch_host)
    failed_at = cluster.power_off(batch_host)
    released_when_requeued(cluster, job_id)
    requeued_at = time.time()
    assert ended(cluster, job_id, 600) == "COMPLETED"
    first, second = segments(run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", [batch_host], "completed"), log
    assert f"the batch host {batch_host} is down (Slurm says so) and its batch script with it" in log, log
    assert batch_host not in job_state(cluster, job_id)["NodeList"]
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    print(f"power-off of the batch host, spare in the allocation: requeued {requeued_at - failed_at:.0f} s after the "
          f"failure (then held by Slurm's BeginTime until the test released it); "
          f"{restart_figures(run_dir, first, second, failed_at)} (the wait for the release included)")


def test_jobgen_slurm_a_powered_off_node_of_a_job_without_spares_is_left_out_of_its_continuation_and_the_run_ends_bitwise_equal(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # Without spare nodes the job is not --no-kill, and Slurm would kill it at the node's DOWN
    # (SlurmdTimeout, 30 s here; 300 s by default) and queue it again. The hang supervisors name
    # the node first, as not answering on the network (about 10 s): the segment ends node_failed
    # and the job ends by submitting its continuation without that node, as after a hang.
    cluster = slurm_on_hosts
    job_id, run_dir = submit(cluster, "power-off-no-spare", training(cluster), env={"JOBGEN_DEBUG_STEP_DELAY": "2"})
    wait_for(lambda: any(step >= 5 for step in trained_steps(run_dir)), "step 5", 300)
    worker = "cn002" if job_state(cluster, job_id)["BatchHost"] != "cn002" else "cn001"
    powered_off.append(worker)
    failed_at = cluster.power_off(worker)
    state = ended(cluster, job_id, 120)
    assert state == "COMPLETED", (run_dir / "logs" / f"{job_id}.out").read_text()  # its continuation submitted, before Slurm's NODE_FAIL
    ended_at = time.time()
    continuation = wait_for(lambda: len(segments(run_dir)) > 1 and segments(run_dir)[1]["job_id"], "the continuation to start", 300)
    assert ended(cluster, continuation, 600) == "COMPLETED"
    assert worker not in job_state(cluster, continuation)["NodeList"]
    first, second = segments(run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", [worker], "completed"), log
    assert f"continuation {continuation} submitted without node(s) {worker}" in log, log
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    print(f"power-off of a worker, no spare: the job ended {ended_at - failed_at:.0f} s after the failure, its "
          f"continuation without {worker} queued; {restart_figures(run_dir, first, second, failed_at)}")


def test_jobgen_slurm_a_spare_that_died_idle_is_not_chosen_when_a_worker_fails_later(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # Slurm cuts a DOWN idle spare out of the allocation; a restart that named it in srun --nodelist
    # would fail before any rank starts. The batch script reads the allocation again before it.
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["spare_nodes"] = 2
    # The spare must be DOWN (SlurmdTimeout, 30 s) before the worker fails mid-run: it powers off
    # as the job starts (no step of the job runs there), and the steps are slow enough (5 s) that
    # Slurm's word comes while training.
    job_id, run_dir = submit(cluster, "dead-spare", job, env={"JOBGEN_DEBUG_STEP_DELAY": "5"})
    log = run_dir / "logs" / f"{job_id}.out"
    wait_for(lambda: log.exists() and f"jobgen: job {job_id} (restart 0) on cn001 cn002" in log.read_text(), "the start", 120)
    assert job_state(cluster, job_id)["NodeList"] == "cn[001-004]"
    powered_off.append("cn003")  # the first spare
    cluster.power_off("cn003")
    wait_for(lambda: "DOWN" in cluster.node_state("cn003"), "Slurm to mark the dead spare DOWN", 120)
    wait_for(lambda: any(step >= 2 for step in trained_steps(run_dir)), "step 2", 300)
    assert max(trained_steps(run_dir)) < MAX_STEPS - 2
    powered_off.append("cn002")
    failed_at = cluster.power_off("cn002")
    assert ended(cluster, job_id, 600) == "COMPLETED"
    first, second = segments(run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", ["cn002"], "completed"), log
    assert "cn003 are gone from this job: not used again" in log, log  # with cn002, which just failed
    assert f"jobgen: job {job_id} (restart 1) on cn001 cn004;" in log, log
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    print(f"a dead idle spare, then a powered-off worker: {restart_figures(run_dir, first, second, failed_at)}")


def test_jobgen_slurm_a_node_range_job_whose_worker_powers_off_goes_on_inside_its_allocation_on_fewer_nodes(
        slurm_on_hosts, powered_off: list[str]) -> None:
    # resources.nodes "2-3" given 3 nodes, no spares: node 1 powers off, and the job goes on inside
    # its allocation on the other 2, the global batch of 12 kept over 3 ranks and then 2,
    # from the step node 0 held in memory. Its losses against an unchanged run are resizing's own
    # test (tests/test_slurm_spare_nodes.py, a hung node of a node range; tests/test_slurm_resize.py).
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["nodes"] = "2-3"
    job["training"]["global_batch_size"] = 12  # one that 2 and 3 ranks split
    job_id, run_dir = submit(cluster, "power-off-node-range", job, env={"JOBGEN_DEBUG_STEP_DELAY": "2"})
    wait_for(lambda: any(step >= 5 for step in trained_steps(run_dir)), "step 5", 300)
    assert job_state(cluster, job_id)["NodeList"] == "cn[001-003]"
    powered_off.append("cn002")
    failed_at = cluster.power_off("cn002")
    assert ended(cluster, job_id, 600) == "COMPLETED", what_slurm_and_the_logs_say(cluster, job_id)
    first, second = segments(run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", ["cn002"], "completed"), log
    assert "the scheduler says they are gone" in log or "cn002 (rank 1) does not answer on the network" in log, log
    assert "jobgen: restarting inside this allocation without node(s) cn002 on 2 node(s)" in log, log
    assert f"jobgen: job {job_id} (restart 1) on cn001 cn003;" in log, log
    said = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*") if p.is_file())
    assert "global batch 12 = 3 ranks x " in said and "global batch 12 = 2 ranks x " in said, said[-3000:]
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_at_most_one_step_lost(run_dir, second["first_step"], failed_at)
    print(f"power-off of a worker of a node range 2-3, no spare: on 2 nodes inside the allocation; "
          f"{restart_figures(run_dir, first, second, failed_at)}")


def test_jobgen_slurm_a_partitioned_worker_is_replaced_by_the_spare_and_its_processes_end_when_it_is_back(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # A lost cable: the node's processes live on, cut off (its ranks blocked in a collective, its
    # mount gone dead), while the job goes on without it. When the link comes back, what is left of
    # the old step there ends; nothing of it reaches the run.
    cluster = slurm_on_hosts
    powered_off.append("cn002")  # powered on afresh after the test, whatever is left of it
    run_dir, first, second, failed_at = worker_replaced_by_the_spare(
        cluster, "partition-worker", reference, lambda cluster, node: cluster.partition(node))
    stale = separate.training_processes_of(cluster.node("cn002").host)
    reconnected_at = time.time()
    separate.link_up(cluster.node("cn002").host)
    wait_for(lambda: not separate.training_processes_of(cluster.node("cn002").host), "the old step's processes on cn002 to end", 180)
    gone_after = time.time() - reconnected_at
    assert_bitwise_equal(run_dir, reference)  # nothing of theirs was written when the mount came back
    print(f"partition of a worker, spare in the allocation: {restart_figures(run_dir, first, second, failed_at)}; "
          f"{len(stale)} process(es) of the old step left on cn002, ended {gone_after:.0f} s after its link came back")


def test_jobgen_slurm_a_worker_whose_slurmd_dies_alone_leaves_the_run_bitwise_equal(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # The daemon alone dies (its ranks, network and mount live on): Slurm marks the node DOWN after
    # SlurmdTimeout as if it had failed, and cuts it out of the --no-kill job.
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["spare_nodes"] = 1
    # Slow steps: the training must outlast SlurmdTimeout (30 s) and Slurm's reaction.
    job_id, run_dir = submit(cluster, "slurmd-death", job, env={"JOBGEN_DEBUG_STEP_DELAY": "6"})
    wait_for(lambda: any(step >= 1 for step in trained_steps(run_dir)), "step 1", 300)
    powered_off.append("cn002")  # slurmd started again after the test
    failed_at = cluster.kill_slurmd("cn002")
    wait_for(lambda: "DOWN" in cluster.node_state("cn002"), "Slurm to mark cn002 DOWN", 120)
    down_after = time.time() - failed_at
    assert max(trained_steps(run_dir)) < MAX_STEPS - 2, "the training ended before Slurm said anything"
    assert ended(cluster, job_id, 600) == "COMPLETED"
    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["event"] == "end"]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert ends[-1]["outcome"] == "completed", log
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    print(f"slurmd of a worker killed alone: DOWN in Slurm {down_after:.0f} s after; segments "
          f"{[(e['outcome'], e.get('nodes')) for e in ends]}; "
          + (restart_figures(run_dir, ends[0], ends[1], failed_at) if len(ends) > 1 else "no restart"))


def test_jobgen_slurm_a_worker_powered_off_during_start_up_is_replaced_by_the_spare_and_the_run_ends_bitwise_equal(
        slurm_on_hosts, reference: dict, powered_off: list[str]) -> None:
    # Before the rendezvous: node 0's ranks wait for a peer that will never come, and nothing has
    # trained yet. The start-up has a bound of its own (the hang supervisor's), then the spare.
    cluster = slurm_on_hosts
    job = training(cluster)
    job["resources"]["spare_nodes"] = 1
    job_id, run_dir = submit(cluster, "power-off-at-start", job)
    log = run_dir / "logs" / f"{job_id}.out"
    wait_for(lambda: log.exists() and f"jobgen: job {job_id} (restart 0) on cn001 cn002" in log.read_text(), "the start", 120)
    powered_off.append("cn002")
    failed_at = cluster.power_off("cn002")
    assert not trained_steps(run_dir), "a step was trained before the power-off"
    assert ended(cluster, job_id, 600) == "COMPLETED", what_slurm_and_the_logs_say(cluster, job_id)
    first, second = segments(run_dir)
    text = log.read_text()
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", ["cn002"], "completed"), text
    assert f"jobgen: job {job_id} (restart 1) on cn001 cn003;" in text, text
    assert sorted(trained_steps(run_dir)) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    first_step = min(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines())
    print(f"power-off of a worker during start-up, spare in the allocation: first step {first_step - failed_at:.0f} s after the failure")
