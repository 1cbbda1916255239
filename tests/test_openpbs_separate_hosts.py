"""jobgen's PBS Pro jobs on an OpenPBS complex whose nodes are separate hosts
(tests/cluster/openpbs_hosts.py): the job submitted on the server host, its chunks on two other
hosts whose own name is 127.0.1.1 on themselves, each with a first interface that routes nowhere,
the run folder on a network file system that each host mounts on its own, and pbsdsh starting
the second node's task through the MoMs and pbs_comm, with the task's bare environment; and a
compute host that powers off mid-training, cut off or loses its MoM. About 17 minutes of a worker (11 tests;
the uninterrupted reference is the test run's one, tests.helpers.uninterrupted_adapter)."""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from tests.cluster.hosts import (assert_probe_met_at_node_0, back_on_the_network, in_the_write_of_step_8, link_down,
                                powered_off_hosts, run_logs, status_segments)
from tests.helpers import assert_at_most_one_step_lost, assert_bitwise_equal
from tests.test_pbs_scripts import probe_job
# reference and tiny are fixtures: the uninterrupted run and the tiny model, as the PBS servers' tests have them.
from tests.test_pbs_servers import (MAX_STEPS, SAVE_INTERVAL, ended_as_the_reference, lora_job, reference, tiny,  # noqa: F401
                                    trained_steps, wait_for, wait_for_step)


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
    first, second = status_segments(cluster, run_dir)
    # Once, in a whole run with the CPUs 93% busy, the first segment was `failed`: the run's word says why next time.
    assert first["outcome"] == "preempted" and first["last_step"] >= SAVE_INTERVAL + 2, f"{first}\n{run_logs(run_dir)}"
    assert (second["outcome"], second["first_step"], second["restart"]) == ("completed", first["last_step"], 1), f"{second}\n{run_logs(run_dir)}"
    assert trained_steps(run_dir)[-1] == MAX_STEPS
    assert_bitwise_equal(run_dir, reference)



def qstat_fields(cluster, job_id: str) -> dict[str, str]:
    """The job's `qstat -xf` as NAME -> value (continued lines joined)."""
    fields, name = {}, None
    for line in cluster.run("host1", ["qstat", "-xf", job_id], timeout=30).stdout.splitlines():
        if line.startswith("    ") and " = " in line:
            name, value = line.strip().split(" = ", 1)
            fields[name] = value
        elif name and line.startswith("\t"):
            fields[name] += line.strip()
    return fields


def daemon_log(cluster, host: str, daemon: str) -> str:
    """What `daemon` (mom, server) on `host` logged today, read from the host's PBS_HOME."""
    return "".join(p.read_text(errors="replace") for p in sorted((cluster.complex_hosts.state / "home" / host / f"{daemon}_logs").glob("*")))


@pytest.fixture
def powered_off(openpbs_on_hosts):
    yield from powered_off_hosts(openpbs_on_hosts)


def finished_after_power_off(cluster, job_id: str, run_dir: Path, host: str, off_at: float, marks: dict
                             ) -> tuple[dict[str, str], dict[str, float]]:
    """The job's fields once it has finished (at most 300 s after `host` powered off at `off_at`),
    and when each of `marks` (name: a test of the job's fields) first held."""
    seen: dict[str, float] = {}
    deadline = time.time() + 300
    while (fields := qstat_fields(cluster, job_id)).get("job_state") != "F":
        now = time.time()
        assert now < deadline, f"OpenPBS job {job_id} not finished {now - off_at:.0f} s after {host} powered off: {fields}\n{run_logs(run_dir)}"
        for name, holds in marks.items():
            if name not in seen and holds(fields):
                seen[name] = now
        time.sleep(0.5)
    return fields, seen


def assert_killed_by_the_mother_superior_and_requeued(cluster, job_id: str, mother: str, sister: str) -> None:
    """The mother superior's log: it lost the sister past $max_poll_downtime and killed the job; the
    server's: it requeued the job for the down node."""
    mom = daemon_log(cluster, mother, "mom")
    assert f"{job_id};im_eof, lost communication with {sister} for > 10 secs, killing job now" in mom, mom[-3000:]
    server = daemon_log(cluster, "host1", "server")
    assert f"{job_id};Job requeued, execution node {sister} down" in server, server[-3000:]


def continued_by_jobgen_when_the_mother_superior_keeps_the_job(cluster, job_id: str, run_dir: Path, reference: dict, sister: str,
                                                             off_at: float) -> None:
    """The job ended by jobgen's hang supervisor, not killed by the mother superior: the segment
    names the sister, the continuation runs without it and the run ends as the uninterrupted one."""
    mom = daemon_log(cluster, qstat_fields(cluster, job_id)["exec_host"].split("/")[0], "mom")
    assert f"{job_id};im_eof, lost communication with {sister}, not killing job yet" in mom, mom[-3000:]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f", without node(s) {sister}" in log and "jobgen: continuation " in log, log
    next_id = log.split("jobgen: continuation ")[1].split()[0]
    fields = wait_until_finished(cluster, next_id, run_dir, 300)
    assert "Exit_status = 0" in fields, f"{fields}\n{run_logs(run_dir)}"
    first, second = status_segments(cluster, run_dir)
    assert (first["nodes"], second["outcome"]) == ([sister], "completed"), (first, second)
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"OpenPBS, a sister powered off at step {reached}: the mother superior kept the job (\"not killing job yet\"); "
          f"jobgen's hang supervisor ended it ({first['outcome']}) and its continuation {next_id} ran without {sister}: "
          f"first new step {first_new_step:.0f} s after; {again} step(s) trained again (from step {second['first_step']})")


def test_jobgen_openpbs_a_sister_that_powers_off_gets_the_job_killed_and_rerun_by_the_server_and_it_ends_bitwise(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """Node 1's host (a sister MoM, not the mother superior) powers off mid-training: pbs_comm
    loses it, the server marks it down, and the mother superior, past $max_poll_downtime without
    it, kills the whole job with SIGKILL (exit status -14, JOB_EXEC_RERUN_SIS_FAIL: no signal the
    script could trap first); the server requeues the rerunnable job (-r y) and runs it again on
    the free nodes, a free host in place of the lost one, and the job resumes from the step it reached or
    the one before: node 0's host holds both ranks' peer snapshots. requeue.hang_seconds is 120 s,
    so that what OpenPBS does is seen, not jobgen's own hang supervisor (about 10 s here by
    default), which would stop the job first and submit a continuation pinned away from the
    silent node. The mother superior does not always act: under load it was seen to log "lost
    communication with host3, not killing job yet" at each poll for 5 minutes (each poll opens a
    new stream to the sister, and the time the sister has been lost is counted from that stream's
    end). Then the hang supervisor's bound ends the segment, and the run must end the same through
    jobgen's continuation. Prints the figures (docs/exit-codes.md)."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "power-off", setup=[], step_delay=2)
    job["environment"]["secrets"] = []
    job["requeue"]["hang_seconds"] = 120
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(sister)
    off_at = cluster.power_off(sister)
    fields, at = finished_after_power_off(cluster, job_id, run_dir, sister, off_at, {
        "down": lambda fields: "down" in cluster.node_state(sister),
        "killed": lambda fields: fields.get("Exit_status") == "-14",
        "rerun": lambda fields: fields.get("run_count") == "2" and fields.get("job_state") == "R"})
    if fields.get("run_count") == "1":  # not rerun by the server
        continued_by_jobgen_when_the_mother_superior_keeps_the_job(cluster, job_id, run_dir, reference, sister, off_at)
        return
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "2"), fields
    assert fields["exec_host"].startswith(f"{mother}/0+") and sister not in fields["exec_host"], fields["exec_host"]
    assert_killed_by_the_mother_superior_and_requeued(cluster, job_id, mother, sister)
    mom = daemon_log(cluster, mother, "mom")
    assert f"{job_id};node EOF 1 ({sister})" in mom, mom[-3000:]
    first, second = status_segments(cluster, run_dir)
    # SIGKILL: the batch script recorded no end of its segment; the rerun found it so.
    assert (first["outcome"], first["restart"], first["last_step"] >= SAVE_INTERVAL + 1) == ("killed by the scheduler", 0, True), first
    assert (second["outcome"], second["restart"]) == ("completed", 1), second
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"OpenPBS, a sister powered off at step {reached}: {sister} down in pbsnodes {at['down'] - off_at:.0f} s after, "
          f"the job killed (-14) by the mother superior {at['killed'] - off_at:.0f} s after, rerun on {fields['exec_host']} "
          f"{at['rerun'] - off_at:.0f} s after, first new step {first_new_step:.0f} s after; "
          f"{again} step(s) trained again (from step {second['first_step']})")


def test_jobgen_openpbs_a_sister_that_powers_off_in_a_checkpoint_write_is_replaced_by_the_spare_inside_the_job_which_tolerates_it(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1; node 1's host powers off with its part of step 8's
    checkpoint unwritten (its write held 5 s; the default asynchronous save, so training goes on
    beside it), once node 0 holds node 1's snapshot of step 8. jobgen asks for
    `tolerate_node_failures=all` for a job with spares, so the mother superior does not kill the
    job when it loses the sister: jobgen's hang supervisor finds that the node does not answer on
    the network while node 0 waits (in about 10 s, the quick floor) and stops the stuck segment
    naming it, and the batch script restarts at once on node 0 and the spare, in the same job
    (run_count 1), without waiting for pbsdsh's task on the lost host. The half-written checkpoint
    is not taken: the restart resumes from step 8, held in node 0's memory. Prints the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "power-off-spare", setup=[], step_delay=2, resources={"spare_nodes": 1})
    job["environment"]["secrets"] = []
    job["environment"]["variables"]["JOBGEN_DEBUG_SAVE_PAUSE"] = "write@8:5"
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    # Node 1's supervisor publishes its summary, with the address it answers probes at, every 10 s:
    # a node lost before its first summary is judged by its silence alone (the start-up bound).
    heartbeat = run_dir / "heartbeat" / "node-1.json"
    wait_for(lambda: heartbeat.exists() and '"phase": "training"' in heartbeat.read_text(), "node 1 training in its heartbeat", 60)
    fields = qstat_fields(cluster, job_id)
    assert fields["tolerate_node_failures"] == "all", fields
    mother, sister, spare = [part.split("/")[0] for part in fields["exec_host"].split("+")]
    wait_for(lambda: in_the_write_of_step_8(run_dir, mother), "node 1 inside its write of step 8, its snapshot on node 0", 120, every=0.2)
    powered_off.append(sister)
    off_at = cluster.power_off(sister)
    fields, at = finished_after_power_off(cluster, job_id, run_dir, sister, off_at, {"down": lambda fields: "down" in cluster.node_state(sister)})
    logs = run_logs(run_dir)
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "1"), f"{fields}\n{logs}"
    mom = daemon_log(cluster, mother, "mom")
    assert f"{job_id};im_eof, lost communication with {sister}" not in mom, mom[-3000:]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: job {job_id} (restart 0) on {mother} {sister} (spare: {spare});" in log, log
    # The server's word (pbsnodes shows it down) where it came before the probes' (node 0 names it).
    assert (f"jobgen: node failure: node(s) {sister} failed: the scheduler says they are gone" in log
            or f"jobgen: node failure: node {sister} (rank 1) does not answer on the network (powered off, or cut off)" in log), log
    assert f"jobgen: restarting inside this allocation without node(s) {sister} on 2 node(s)" in log, log
    assert f"jobgen: job {job_id} (restart 1) on {mother} {spare};" in log, log
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), (first, second)
    assert second["first_step"] == 8, second
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    manifest = run_dir / "output" / "checkpoints" / "step-000008" / "manifest.json"
    assert not manifest.exists() or "written_from" in json.loads(manifest.read_text()), manifest.read_text()
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    down = f"{at['down'] - off_at:.0f} s after" if "down" in at else "not yet when the job ended"
    restarted = datetime.fromisoformat(second["started_at"].replace("Z", "+00:00")).timestamp()
    print(f"OpenPBS, spare nodes, tolerate_node_failures=all: a sister powered off in its write of step 8's checkpoint, at step {reached}: {sister} down in "
          f"pbsnodes {down}; the job not killed, restarted on {mother}+{spare} inside it {restarted - off_at:.0f} s after, "
          f"first new step {first_new_step:.0f} s after; {again} step(s) trained again "
          f"(from step {second['first_step']})")


def test_jobgen_openpbs_a_sister_that_powers_off_during_start_up_is_replaced_by_the_spare_inside_the_job(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1; node 1's host powers off as soon as the batch script has started
    the nodes, before the rendezvous: node 0's ranks wait for a peer that will never come, nothing
    has trained, and node 1 has published no summary yet. The start-up has a bound of its own (the
    hang supervisor's); the segment ends naming the silent node and the batch script restarts on
    node 0 and the spare inside the job (run_count 1). Prints the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "power-off-at-start", setup=[], step_delay=2, resources={"spare_nodes": 1})
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    log = run_dir / "logs" / f"{job_id}.out"
    wait_for(lambda: log.exists() and f"jobgen: job {job_id} (restart 0) on " in log.read_text(), "the start", 120, every=0.2)
    mother, sister, spare = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(sister)
    off_at = cluster.power_off(sister)
    assert not trained_steps(run_dir), "a step was trained before the power-off"
    fields, _ = finished_after_power_off(cluster, job_id, run_dir, sister, off_at, {})
    text = log.read_text()
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "1"), f"{fields}\n{run_logs(run_dir)}"
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), text
    # The server's word with the silence of node 1's summary: before, node 0 waited at the
    # rendezvous for the start-up's hang bound (15 min; seen: still running 300 s after).
    assert f"jobgen: node failure: node(s) {sister} failed: the scheduler says they are gone" in text, text
    assert f"jobgen: job {job_id} (restart 1) on {mother} {spare};" in text, text
    assert trained_steps(run_dir) == list(range(1, MAX_STEPS + 1)), text  # each once
    assert_bitwise_equal(run_dir, reference)
    first_step = min(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines())
    print(f"OpenPBS, spare nodes: a sister powered off during start-up: first step {first_step - off_at:.0f} s after the power-off")


def test_jobgen_openpbs_a_spare_that_died_idle_is_not_chosen_when_a_sister_powers_off_later(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 2; the first spare's host powers off while it waits (no rank of the
    job runs there: nothing of the training notices, and the mother superior keeps the job), then,
    once the server shows it down, node 1's host. The restart inside the job must take the second
    spare: the server's word (pbsnodes) leaves the dead spare out before the restart, where pbsdsh
    would otherwise start node 1 on a host that is gone. 4 s steps, so that training outlasts the
    server's notice of the first power-off. Prints the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "dead-spare", setup=[], step_delay=4, resources={"spare_nodes": 2})
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, 2)
    mother, sister, first_spare, second_spare = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(first_spare)
    cluster.power_off(first_spare)
    wait_for(lambda: "down" in cluster.node_state(first_spare), "the server to mark the dead spare down", 120)
    assert max(trained_steps(run_dir)) < MAX_STEPS - 3, trained_steps(run_dir)
    heartbeat = run_dir / "heartbeat" / "node-1.json"
    wait_for(lambda: heartbeat.exists() and '"phase": "training"' in heartbeat.read_text(), "node 1 training in its heartbeat", 60)
    powered_off.append(sister)
    off_at = cluster.power_off(sister)
    fields, _ = finished_after_power_off(cluster, job_id, run_dir, sister, off_at, {})
    text = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "1"), f"{fields}\n{run_logs(run_dir)}"
    assert re.search(rf"jobgen: the scheduler says node\(s\) [ a-z0-9]*\b{first_spare}\b[ a-z0-9]* are gone from this job: not used again", text), text
    assert f"jobgen: job {job_id} (restart 1) on {mother} {second_spare};" in text, text
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), text
    assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"OpenPBS, two spares: the first spare powered off idle, then node 1's host at step {reached}: restarted on "
          f"{mother}+{second_spare}, first new step {first_new_step:.0f} s after; {again} step(s) trained again")


def test_jobgen_openpbs_a_mother_superior_that_powers_off_gets_the_job_requeued_by_the_server_and_it_ends_bitwise(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """Node 0's host (the mother superior, which runs the batch script) powers off mid-training, no
    spares: the batch script is gone with it, and node 1's ranks wait on the silent peer until its
    hang supervisor ends them. The server itself requeues a job whose mother superior has been
    down for `node_fail_requeue` seconds (310 by default; an admin's `qmgr -c "set server
    node_fail_requeue = N"`, 20 here) and runs it again on free nodes; the job resumes from the
    step it reached or the one before where the sister is among them (it holds both ranks' peer
    snapshots), else from its newest periodic checkpoint. Prints the figures (docs/exit-codes.md)."""
    cluster = openpbs_on_hosts
    assert cluster.run("host1", ["qmgr", "-c", "set server node_fail_requeue = 20"]).returncode == 0
    try:
        job = lora_job(tiny, "power-off-mother", setup=[], step_delay=2)
        job["environment"]["secrets"] = []
        job_id, run_dir = submit(cluster, job)
        wait_for_step(run_dir, SAVE_INTERVAL + 1)
        mother, sister = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
        powered_off.append(mother)
        off_at = cluster.power_off(mother)
        fields, at = finished_after_power_off(cluster, job_id, run_dir, mother, off_at, {"rerun": lambda fields: fields.get("run_count") == "2"})
    finally:
        cluster.run("host1", ["qmgr", "-c", "unset server node_fail_requeue"])
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "2"), fields
    assert mother not in fields["exec_host"], fields["exec_host"]
    server = daemon_log(cluster, "host1", "server")
    assert f"{job_id};Job requeued, execution node {mother} down" in server, server[-3000:]
    first, second = status_segments(cluster, run_dir)
    # The batch script went with its host: no end of its segment; the rerun found it so.
    assert (first["outcome"], first["restart"]) == ("killed by the scheduler", 0), first
    assert (second["outcome"], second["restart"]) == ("completed", 1), second
    if f"{sister}/" in fields["exec_host"]:
        assert_at_most_one_step_lost(run_dir, second["first_step"], off_at)
    else:
        assert second["first_step"] == SAVE_INTERVAL, second
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, off_at, second["first_step"])
    print(f"OpenPBS, the mother superior powered off at step {reached} (node_fail_requeue 20): rerun on {fields['exec_host']} "
          f"{at['rerun'] - off_at:.0f} s after, first new step {first_new_step:.0f} s after; "
          f"{again} step(s) trained again (from step {second['first_step']})")


def test_jobgen_openpbs_a_sister_whose_mom_dies_alone_in_a_job_that_tolerates_it_ends_when_its_training_does(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1 (so `tolerate_node_failures=all`); node 1's pbs_mom dies alone, its
    ranks, network and mount living on. The server marks the node down and the mother superior
    keeps the job; training goes on undisturbed to its end. Then pbsdsh waits for the dead MoM's
    report of its task, which never comes: before the batch script ended a launcher that outlived
    its node's own record on a node pbsnodes shows down, the job held its nodes to its time limit
    (seen: still running 240 s after the training completed). Now it ends within about 20 s of
    its last step."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "mom-death-spare", setup=[], step_delay=2, resources={"spare_nodes": 1})
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister, spare = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(sister)  # its MoM started again after the test
    killed_at = cluster.kill_mom(sister)
    fields, at = finished_after_power_off(cluster, job_id, run_dir, sister, killed_at, {"down": lambda fields: "down" in cluster.node_state(sister)})
    finished_at = time.time()
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "1"), fields
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert re.search(rf"jobgen: node 1 \({sister}\) ended its part 1\d s ago and the scheduler says its node is down: "
                     r"its launcher waits for that node's daemon, which will not answer; ending the launcher", log), log
    (segment,) = status_segments(cluster, run_dir)
    assert (segment["outcome"], segment["restart"]) == ("completed", 0), segment
    assert trained_steps(run_dir) == list(range(1, MAX_STEPS + 1))  # each once: never interrupted
    assert_bitwise_equal(run_dir, reference)
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    reached = max(m["step"] for m in metrics if m["time"] <= killed_at)
    last_step = max(m["time"] for m in metrics)
    print(f"OpenPBS, tolerate_node_failures=all: the sister's pbs_mom killed alone at step {reached}: {sister} down in "
          f"pbsnodes {at['down'] - killed_at:.0f} s after; training went on; the job finished {finished_at - last_step:.0f} s "
          f"after its last step")


def test_jobgen_openpbs_a_sister_whose_mom_dies_alone_in_a_job_without_spares_is_rerun_by_the_server_and_ends_bitwise(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """No spares (the job does not tolerate node failures); node 1's pbs_mom dies alone, its ranks,
    network and mount living on. The mother superior, past $max_poll_downtime without the sister,
    kills the job; the server requeues it ("execution node host3 down") and runs it again on node
    0's host and a free one. The sister's rank, which no MoM can kill now, ends at its lost peer.
    The run resumes and ends bitwise equal to an uninterrupted one, at most one step trained
    again. 4 s steps, so that training outlasts the mother superior's wait. Prints the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "mom-death", setup=[], step_delay=4)
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(sister)  # its MoM started again after the test
    killed_at = cluster.kill_mom(sister)
    fields, at = finished_after_power_off(cluster, job_id, run_dir, sister, killed_at, {
        "down": lambda fields: "down" in cluster.node_state(sister),
        "rerun": lambda fields: fields.get("run_count") == "2" and fields.get("job_state") == "R"})
    logs = run_logs(run_dir)
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "2"), f"{fields}\n{logs}"
    assert sister not in fields["exec_host"], fields["exec_host"]
    assert_killed_by_the_mother_superior_and_requeued(cluster, job_id, mother, sister)
    first, second = status_segments(cluster, run_dir)
    assert (second["outcome"], second["restart"]) == ("completed", 1), (first, second)
    assert_at_most_one_step_lost(run_dir, second["first_step"], killed_at)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, killed_at, second["first_step"])
    print(f"OpenPBS, no spares: the sister's pbs_mom killed alone at step {reached}: {sister} down in pbsnodes "
          f"{at['down'] - killed_at:.0f} s after; first segment {first['outcome']!r}; rerun on {fields['exec_host']} "
          f"{at['rerun'] - killed_at:.0f} s after, first new step {first_new_step:.0f} s after; {again} step(s) trained again "
          f"(from step {second['first_step']})")


def test_jobgen_openpbs_a_partitioned_sister_is_replaced_by_the_spare_and_the_host_comes_back_by_itself(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """resources.spare_nodes: 1; node 1's host loses its link mid-training (a cable or switch port),
    its processes alive: pbs_mom, the ranks, the mount, cut off. The job goes on without it inside the
    allocation; when the link is back, nothing of the old segment is left running there and the
    server takes the host back without a restart of its MoM. Prints the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "partition", setup=[], step_delay=2, resources={"spare_nodes": 1})
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister, spare = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    heartbeat = run_dir / "heartbeat" / "node-1.json"
    wait_for(lambda: heartbeat.exists() and '"phase": "training"' in heartbeat.read_text(), "node 1 training in its heartbeat", 60)
    powered_off.append(sister)  # should the host not come back by itself: powered on afresh after the test
    cut_at = time.time()
    link_down(cluster.host(sister))
    fields, _ = finished_after_power_off(cluster, job_id, run_dir, sister, cut_at, {})
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "1"), f"{fields}\n{run_logs(run_dir)}"
    text = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"jobgen: job {job_id} (restart 1) on {mother} {spare};" in text, text
    first, second = status_segments(cluster, run_dir)
    assert (first["outcome"], first["nodes"], second["outcome"], second["restart"]) == ("node_failed", [sister], "completed", 1), text
    assert_at_most_one_step_lost(run_dir, second["first_step"], cut_at)
    left, free_after = back_on_the_network(cluster, sister, powered_off)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, cut_at, second["first_step"])
    print(f"OpenPBS, spare nodes: node 1's host cut off at step {reached}: restarted on {mother}+{spare} inside the job, "
          f"first new step {first_new_step:.0f} s after; {again} step(s) trained again; {left} process(es) of the "
          f"old segment left there when the job finished; the host free again {free_after:.0f} s after its link came back")



def test_jobgen_openpbs_a_partitioned_sister_of_a_job_without_spares_ends_bitwise_and_leaves_nothing_on_the_host(
        openpbs_on_hosts, tiny: Path, reference: dict, powered_off: list[str]) -> None:
    """No spares; node 1's host loses its link mid-training, its processes alive. Whoever acts
    first, jobgen's hang supervisor (the node does not answer: the segment ends `node_failed` and a
    continuation is submitted pinned away from it) or the mother superior past $max_poll_downtime
    (the server reruns the job), the run ends completed, every step trained once, bitwise equal to
    an uninterrupted run; once the link is back nothing of the old segment runs on the host and
    the server has it free again. Prints which acted, and the figures."""
    cluster = openpbs_on_hosts
    job = lora_job(tiny, "partition-no-spare", setup=[], step_delay=2)
    job["environment"]["secrets"] = []
    job_id, run_dir = submit(cluster, job)
    wait_for_step(run_dir, SAVE_INTERVAL + 1)
    mother, sister = [part.split("/")[0] for part in qstat_fields(cluster, job_id)["exec_host"].split("+")]
    powered_off.append(sister)  # should the host not come back by itself: powered on afresh after the test
    cut_at = time.time()
    link_down(cluster.host(sister))
    wait_for(lambda: [segment["outcome"] for segment in status_segments(cluster, run_dir)][-1:] == ["completed"],
             "the run to complete", 400, every=5)
    submitted = [json.loads(line)["job_id"] for line in (run_dir / "submissions.jsonl").read_text().splitlines()]
    for each in submitted:
        wait_until_finished(cluster, each, run_dir, 300)
    segments = status_segments(cluster, run_dir)
    first, last = segments[0], segments[-1]
    assert len(segments) == 2 and first["outcome"] in ("node_failed", "killed by the scheduler"), f"{segments}\n{run_logs(run_dir)}"
    if first["outcome"] == "node_failed":
        assert first["nodes"] == [sister] and len(submitted) == 2, (first, submitted)
    assert_at_most_one_step_lost(run_dir, last["first_step"], cut_at)
    left, free_after = back_on_the_network(cluster, sister, powered_off)
    reached, first_new_step, again = ended_as_the_reference(run_dir, reference, cut_at, last["first_step"])
    acted = (f"jobgen's continuation {submitted[-1]}" if first["outcome"] == "node_failed"
             else "the server's rerun (the mother superior killed the job)")
    print(f"OpenPBS, no spares: node 1's host cut off at step {reached}: {acted}, first new step {first_new_step:.0f} s after; "
          f"{again} step(s) trained again; {left} process(es) of the old segment left there when the run completed; "
          f"the host free again {free_after:.0f} s after its link came back")
