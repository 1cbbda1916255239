"""jobgen's Torque jobs on a Torque complex whose nodes are separate hosts
(tests/cluster/torque_hosts.py): the job submitted on the server host, its nodes two other hosts
whose own name is 127.0.1.1 on themselves, each with a first interface that routes nowhere, the
run folder on a network file system that each host mounts on its own, and pbsdsh (through the
MoMs, with the tasks' bare environment) starting every node; and compute hosts that power off
mid-training, inside a checkpoint write or during start-up (an idle spare with them), are cut off
or lose their MoM. About 20 minutes of a worker (8 tests; the uninterrupted reference is the test
run's one, tests.helpers.uninterrupted_adapter)."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.cluster.hosts import (assert_probe_met_at_node_0, back_on_the_network, in_the_write_of_step_8, link_down,
                                powered_off_hosts, run_logs, status_segments)
from tests.helpers import assert_at_most_one_step_lost, assert_bitwise_equal
from tests.test_pbs_scripts import probe_job
# reference and tiny are fixtures: the uninterrupted run and the tiny model, as the Torque server's tests have them.
from tests.test_pbs_servers import (MAX_STEPS, SAVE_INTERVAL, SECRET, SECRET_SEEN, assert_secret_reached_every_node,  # noqa: F401
                                    ended_as_the_reference, lora_job, reference, tiny, trained_steps, wait_for, wait_for_step)


def submit(cluster, job: dict, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """`jobgen submit` by the job user on host1 (with `env` besides), from a folder of the shared
    file system; the job id and the run directory as this machine (the file server) sees it. The
    job's setup lines come after the one that puts jobgen on PATH."""
    environment = job.get("environment", {})
    job["environment"] = {**environment, "setup": [f"source {cluster.venv}/bin/activate", *environment.get("setup", [])]}
    folder = cluster.served / job["name"]
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.as_user(["jobgen", "submit", "-s", "torque", "job.yaml"], cwd=cluster.shared / job["name"], env=env)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    return submitted.stdout.split()[-1], folder / "runs" / job["name"]


def wait_until_complete(cluster, job_id: str, run_dir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while "job_state = C" not in cluster.run("host1", ["qstat", "-f", job_id]).stdout:
        if time.monotonic() > deadline:
            raise AssertionError(f"Torque job {job_id} not complete after {timeout} s:\n{run_logs(run_dir)}")
        time.sleep(1)


def test_jobgen_torque_ranks_on_separate_hosts_meet_at_the_mother_superiors_address(torque_on_hosts) -> None:
    cluster = torque_on_hosts
    job_id, run_dir = submit(cluster, {**probe_job(2, 2), "name": "probe"})
    wait_until_complete(cluster, job_id, run_dir, 240)
    assert_probe_met_at_node_0(run_dir, cluster)


def test_jobgen_torque_training_rerun_on_separate_hosts_resumes_bitwise_from_the_shared_file_system(
        torque_on_hosts, tiny: Path, reference: dict) -> None:
    # The operator's qrerun kills both nodes at once (no time to save, nor to record its end: on PBS
    # a SIGTERM reads as a preemption, and whether the script began its stop before the SIGKILL is
    # a race the machine's load decides); the job starts again under its id on the same hosts and
    # resumes from the step it reached or the one before, a peer snapshot written out as a
    # checkpoint through one host's mount and read back through both hosts' own, whose caches show
    # it late. The job's secret, given at `jobgen submit`, reaches both nodes in both segments.
    cluster = torque_on_hosts
    job = lora_job(tiny, "rerun", setup=[SECRET_SEEN], step_delay=2)
    job_id, run_dir = submit(cluster, job, env={"JOBGEN_TEST_TOKEN": SECRET})
    wait_for_step(run_dir, SAVE_INTERVAL + 2)
    rerun = cluster.run("host1", ["qrerun", job_id])
    assert rerun.returncode == 0, rerun.stderr
    # Taken here, to the microsecond: the segment's started_at has whole seconds only, so the
    # killed run's last line can fall in the rerun's first second.
    killed_at = time.time()
    wait_until_complete(cluster, job_id, run_dir, 480)
    first, second = status_segments(cluster, run_dir)
    records = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    began_to_stop = any(r.get("event") == "stopping" and r.get("restart") == 0 for r in records)
    assert first["outcome"] == ("preempted" if began_to_stop else "killed by the scheduler") and first["ended_at"], first
    assert first["last_step"] >= SAVE_INTERVAL + 2, first
    assert (second["outcome"], second["restart"]) == ("completed", 1), second
    assert_at_most_one_step_lost(run_dir, second["first_step"], reached=first["last_step"])
    # No rank of the killed run trained on beside the rerun (torchrun's ranks live in sessions of
    # their own, which Torque does not kill).
    steps_since = [json.loads(line)["step"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                   if json.loads(line)["time"] >= killed_at]
    assert steps_since == list(range(second["first_step"] + 1, MAX_STEPS + 1)), steps_since
    table = cluster.jobgen_on_host1(["status", str(cluster.shared / run_dir.relative_to(cluster.served))]).stdout
    assert first["outcome"] in table and "running or lost" not in table, table
    assert_secret_reached_every_node(run_dir, 2)
    assert_bitwise_equal(run_dir, reference)


@pytest.fixture
def powered_off(torque_on_hosts):
    yield from powered_off_hosts(torque_on_hosts)


def nodes_of(log: str, job_id: str) -> list[str]:
    """The hosts of the job's first segment as its batch log names them: node 0, node 1 (and the spare)."""
    line = next(line for line in log.splitlines() if line.startswith(f"jobgen: job {job_id} (restart 0) on "))
    return line.split(" on ", 1)[1].split(";")[0].replace("(spare: ", "").replace(")", "").split()


def powered_off_mid_training(cluster, tiny: Path, name: str, node: int, powered_off: list[str], spare_nodes: int = 0,
                             fault: Callable[[str], float] | None = None, variables: dict[str, str] | None = None,
                             when: tuple[str, Callable[[Path, list[str]], bool]] | None = None) -> tuple[str, Path, list[str], float]:
    """A 2-node LoRA job (2 s steps, no secrets, `variables` in its environment) trained past its
    first checkpoint, node `node` training, then, once `when` holds (a description and a test of
    the run folder and the job's hosts), that node's host powered off (or `fault` done to it): the
    job id, its run folder, its hosts as the batch log names them (node 0, node 1, the spares) and
    the time of the fault. The host is in `powered_off` (powered on afresh after the test) until a
    test takes it out."""
    job = lora_job(tiny, name, setup=[], step_delay=2, resources={"spare_nodes": spare_nodes})
    job["environment"]["secrets"] = []
    job["environment"]["variables"].update(variables or {})
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    if spare_nodes:  # heartbeats are published by jobs with spares only
        heartbeat = run_dir / "heartbeat" / f"node-{node}.json"
        wait_for(lambda: heartbeat.exists() and '"phase": "training"' in heartbeat.read_text(),
                 f"node {node} training in its heartbeat", 60)
    hosts = nodes_of((run_dir / "logs" / f"{job_id}.out").read_text(), job_id)
    if when:
        wait_for(lambda: when[1](run_dir, hosts), when[0], 120, every=0.2)
    powered_off.append(hosts[node])
    return job_id, run_dir, hosts, (fault or cluster.power_off)(hosts[node])


def cut_off(cluster) -> Callable[[str], float]:
    """A partition: the host's link down, its processes (pbs_mom, the ranks, the mount) alive."""
    def fault(name: str) -> float:
        at = time.time()
        link_down(cluster.host(name))
        return at
    return fault


def test_jobgen_torque_a_sister_that_powers_off_in_a_checkpoint_write_is_replaced_by_the_spare_inside_the_job(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1; node 1's host (a sister MoM) powers off with its part of step 8's
    checkpoint unwritten (its write held 5 s; the default asynchronous save, so training goes on
    beside it), once node 0 holds node 1's snapshot of step 8. Torque keeps the job (it has no rule
    that kills a job for a lost sister); jobgen's hang supervisor finds that node 1 does not answer
    on the network while node 0 waits, the segment ends naming it, and the batch script restarts on
    node 0 and the spare inside the same job. The half-written checkpoint is not taken: the restart
    resumes from step 8, held in node 0's memory. Prints the figures."""
    cluster = torque_on_hosts
    job_id, run_dir, (mother, sister, spare), off_at = powered_off_mid_training(
        cluster, tiny, "power-off-in-save", 1, powered_off, spare_nodes=1, variables={"JOBGEN_DEBUG_SAVE_PAUSE": "write@8:5"},
        when=("node 1 inside its write of step 8, its snapshot on node 0", lambda run_dir, hosts: in_the_write_of_step_8(run_dir, hosts[0])))
    log = run_dir / "logs" / f"{job_id}.out"
    wait_until_complete(cluster, job_id, run_dir, 300)
    ended_at = time.time()
    text = log.read_text()
    assert f"jobgen: restarting inside this allocation without node(s) {sister} on 2 node(s)" in text, text
    assert f"jobgen: job {job_id} (restart 1) on {mother} {spare};" in text, text
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), run_logs(run_dir)
    assert second["first_step"] == 8, second
    manifest = run_dir / "output" / "checkpoints" / "step-000008" / "manifest.json"
    assert not manifest.exists() or "written_from" in json.loads(manifest.read_text()), manifest.read_text()
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"Torque, spare nodes: a sister powered off in its write of step 8's checkpoint, at step {reached}: restarted on "
          f"{mother}+{spare} inside the job, first new step {first_new_step:.0f} s after, the job complete "
          f"{ended_at - off_at:.0f} s after; {again} step(s) trained again (from step {second['first_step']})")


def test_jobgen_torque_a_sister_and_a_spare_lost_during_start_up_leave_the_second_spare_to_replace_the_sister(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 2; as soon as the batch script has started the nodes, before the
    rendezvous, the first spare's host powers off (idle: no rank of the job runs there) and then
    node 1's: node 0's ranks wait for a peer that will never come, nothing has trained, and node 1
    has published no summary. Torque's server shows both hosts down at its next node check
    (node_check_rate); that word, with the silence of node 1's summary, ends the segment naming
    node 1, and the restart inside the job must take the second spare: the same word leaves the
    dead first spare out, where pbsdsh would otherwise start node 1 on a host that is gone. (Slurm's
    and OpenPBS's tests show the two apart; here one job shows both, since each waits for Torque's
    node check, minutes of a worker.) Prints the figures."""
    cluster = torque_on_hosts
    job = lora_job(tiny, "power-off-at-start", setup=[], step_delay=2, resources={"spare_nodes": 2})
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    log = run_dir / "logs" / f"{job_id}.out"
    wait_for(lambda: log.exists() and f"jobgen: job {job_id} (restart 0) on " in log.read_text(), "the start", 120, every=0.2)
    mother, sister, first_spare, second_spare = nodes_of(log.read_text(), job_id)
    powered_off.extend([first_spare, sister])
    cluster.power_off(first_spare)
    # The sister's MoM reports once more (every 5 s) after the spare's last report: the server's node
    # check, which goes by the time of a node's last report, then calls the spare down no later than
    # the sister, and the restart cannot come between the two.
    spare_reported = cluster.reported_since(first_spare)
    wait_for(lambda: cluster.reported_since(sister) > spare_reported, "a report of node 1's MoM after the spare's last", 30, every=0.2)
    off_at = cluster.power_off(sister)
    assert not trained_steps(run_dir), "a step was trained before the power-off"
    down_at = when_down(cluster, sister, 300)
    wait_until_complete(cluster, job_id, run_dir, 300)
    text = log.read_text()
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), text
    assert f"jobgen: node failure: node(s) {sister} failed: the scheduler says they are gone" in text, text
    assert re.search(rf"jobgen: the scheduler says node\(s\) [ a-z0-9]*\b{first_spare}\b[ a-z0-9]* are gone from this job: not used again", text), text
    assert f"jobgen: job {job_id} (restart 1) on {mother} {second_spare};" in text, text
    assert trained_steps(run_dir) == list(range(1, MAX_STEPS + 1)), text  # each once
    assert_bitwise_equal(run_dir, reference)
    restarted = datetime.fromisoformat(second["started_at"].replace("Z", "+00:00")).timestamp()
    first_step = min(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines())
    print(f"Torque, two spares: node 1's host and the first spare's powered off during start-up: {sister} down in pbsnodes "
          f"{down_at - off_at:.0f} s after, restarted on {mother}+{second_spare} {restarted - off_at:.0f} s after, "
          f"first step {first_step - off_at:.0f} s after the power-off")


def when_down(cluster, name: str, timeout: float) -> float:
    """The time the server first shows host `name` down in pbsnodes."""
    wait_for(lambda: "down" in cluster.node_state(name), f"the server to show {name} down", timeout)
    return time.time()


def test_jobgen_torque_a_partitioned_sister_is_replaced_by_the_spare_and_the_host_comes_back_by_itself(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1; node 1's host loses its link mid-training (a cable or switch port),
    its processes alive: pbs_mom, the ranks, the mount, cut off. jobgen's hang supervisor finds it
    does not answer, and the batch script restarts on node 0 and the spare inside the job; when the
    link is back, nothing of the old segment is left running there (its own supervisor found node 0
    unreachable and ended its ranks) and the server has the host free again without a restart of
    its MoM. Prints the figures."""
    cluster = torque_on_hosts
    job_id, run_dir, (mother, sister, spare), cut_at = powered_off_mid_training(
        cluster, tiny, "partition", 1, powered_off, spare_nodes=1, fault=cut_off(cluster))
    wait_until_complete(cluster, job_id, run_dir, 300)
    text = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: job {job_id} (restart 1) on {mother} {spare};" in text, text
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), run_logs(run_dir)
    assert_at_most_one_step_lost(run_dir, second["first_step"], cut_at)
    left, free_after = back_on_the_network(cluster, sister, powered_off)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, cut_at, second["first_step"])
    print(f"Torque, spare nodes: node 1's host cut off at step {reached}: restarted on {mother}+{spare} inside the job, "
          f"first new step {first_new_step:.0f} s after; {again} step(s) trained again; {left} process(es) of the "
          f"old segment left there when the job finished; the host free again {free_after:.0f} s after its link came back")


def test_jobgen_torque_a_sister_that_powers_off_in_a_job_without_spares_is_continued_without_it(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """No spares; node 1's host powers off mid-training. Torque keeps the job; jobgen's hang
    supervisor names the silent node, and the batch script submits the continuation without it
    (qsub, the lost host excluded), which runs on node 0's host and the free one and resumes from
    the last complete checkpoint or node 0's peer snapshot. Prints the figures."""
    cluster = torque_on_hosts
    job_id, run_dir, (mother, sister), off_at = powered_off_mid_training(cluster, tiny, "power-off", 1, powered_off)
    log = run_dir / "logs" / f"{job_id}.out"
    wait_until_complete(cluster, job_id, run_dir, 300)
    text = log.read_text()
    assert "jobgen: continuation " in text, text
    next_id = text.split("jobgen: continuation ")[1].split()[0]
    wait_until_complete(cluster, next_id, run_dir, 300)
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", [sister], "completed"), run_logs(run_dir)
    continued_on = nodes_of((run_dir / "logs" / f"{next_id}.out").read_text().replace("(restart 1)", "(restart 0)"), next_id)
    assert sister not in continued_on, continued_on
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"Torque, no spares: a sister powered off at step {reached}: continued as job {next_id} on "
          f"{' '.join(continued_on)}, first new step {first_new_step:.0f} s after; {again} step(s) trained again")


def test_jobgen_torque_a_mother_superior_that_powers_off_is_continued_by_a_surviving_node(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """No spares; node 0's host, the mother superior where the batch script runs, powers off
    mid-training. Torque keeps the job running with nothing left to end it (no rule requeues it;
    qrerun is an operator's). Node 1's ranks fail for want of node 0; its jobgen-torchrun waits for
    the server to show that host down (node_check_rate), then submits the continuation itself
    (allow_node_submit) and asks for the stuck job's deletion, which Torque carries out once the
    host's MoM is back. Prints the figures."""
    cluster = torque_on_hosts
    job_id, run_dir, (mother, sister), off_at = powered_off_mid_training(cluster, tiny, "power-off-mother", 0, powered_off)
    log = run_dir / "logs" / f"{job_id}.out"
    submissions = run_dir / "submissions.jsonl"
    wait_for(lambda: len(submissions.read_text().splitlines()) > 1, "the continuation's submission", 300)
    next_id = json.loads(submissions.read_text().splitlines()[-1])["job_id"]
    submitted_at = time.time()
    wait_until_complete(cluster, next_id, run_dir, 400)
    text = log.read_text()
    assert (f"jobgen: node failure: the mother superior {mother} is down (Torque says so) and the batch script with it: "
            f"node {sister} submitted continuation {next_id} (restart 1)") in text, run_logs(run_dir)
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"]) == ("node_failed", [mother], "completed"), run_logs(run_dir)
    # Node 1's supervisor found the master silent on the network (its probe), not by the 60 s bound.
    hang = json.loads((run_dir / "hang.json").read_text())
    assert (str(hang["restart"]), hang["cause"], hang["node_ranks"]) == ("0", "unreachable", [0]), hang
    continued_on = nodes_of((run_dir / "logs" / f"{next_id}.out").read_text().replace("(restart 1)", "(restart 0)"), next_id)
    assert mother not in continued_on, continued_on
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    # The stuck job: not complete while its MoM is down (the deletion asked for waits on it), complete or
    # gone once the host is back.
    stuck = qstat_state(cluster, job_id)
    assert stuck not in ("C", ""), stuck
    powered_off.remove(mother)
    cluster.power_on(mother)
    back_at = time.time()
    wait_for(lambda: qstat_state(cluster, job_id) in ("C", ""), "the stuck job to end", 300)
    print(f"Torque, the mother superior powered off at step {reached}: named unreachable by node 1 {hang['at'] - off_at:.0f} s "
          f"after; continued by node 1 as job {next_id} on "
          f"{' '.join(continued_on)}, submitted {submitted_at - off_at:.0f} s after (seen within 1 s), first new step "
          f"{first_new_step:.0f} s after; {again} step(s) trained again; the stuck job {stuck} until its host came back, "
          f"ended {time.time() - back_at:.0f} s after that")


def qstat_state(cluster, job_id: str) -> str:
    """The job's state letter in `qstat -f` (R, E, C...), "" once the server no longer knows it."""
    shown = cluster.run("host1", ["qstat", "-f", job_id]).stdout
    return next((line.split("=", 1)[1].strip() for line in shown.splitlines() if line.strip().startswith("job_state =")), "")


def test_jobgen_torque_a_sister_whose_mom_dies_alone_ends_when_its_training_does(
        torque_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """No spares; node 1's pbs_mom dies alone mid-training, its ranks, network and mount living on.
    Torque has no rule that ends a job for it: the server marks the node down at its next check
    (node_check_rate) and training goes on undisturbed. At the end pbsdsh waits for the dead MoM's
    report of its task, which never comes; the batch script ends a launcher that outlived its
    node's own record on a node the server shows down, and the mother superior finishes the job
    after `$job_exit_wait_time`. Prints the figures."""
    cluster = torque_on_hosts
    job = lora_job(tiny, "mom-death", setup=[], step_delay=2)
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister = nodes_of((run_dir / "logs" / f"{job_id}.out").read_text(), job_id)
    powered_off.append(sister)  # its MoM started again after the test
    killed_at = cluster.kill_mom(sister)
    down_at = when_down(cluster, sister, 200)
    wait_until_complete(cluster, job_id, run_dir, 300)
    finished_at = time.time()
    (segment,) = status_segments(cluster, run_dir)
    assert (segment["outcome"], segment["restart"]) == ("completed", 0), f"{segment}\n{run_logs(run_dir)}"
    assert trained_steps(run_dir) == list(range(1, MAX_STEPS + 1))  # each once: never interrupted
    assert_bitwise_equal(run_dir, reference)
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    reached = max(m["step"] for m in metrics if m["time"] <= killed_at)
    last_step = max(m["time"] for m in metrics)
    print(f"Torque: the sister's pbs_mom killed alone at step {reached}: {sister} down in pbsnodes {down_at - killed_at:.0f} s "
          f"after; training went on; the job complete {finished_at - last_step:.0f} s after its last step")
