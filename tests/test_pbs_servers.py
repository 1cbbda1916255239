"""PBS Pro and Torque jobs on real servers: a real OpenPBS and a real Torque on this machine
(tests/cluster/pbs_servers.py), each with two nodes per job.

What each test checks is what a user would: the ranks' variables and the job's module, the logs,
`jobgen status` and `jobgen cancel`, and for the trainings, the final adapter. Every interrupted
training (a preemption by an express-queue job on PBS Pro, the walltime with the job's own
continuation on both; Torque's `qrerun` is tests/test_torque_separate_hosts.py's) must end bitwise equal to the same job run without
interruption, the reference, run once. On Torque the jobs are submitted by and run as the
ordinary user `tquser` (root may not submit there), from its own folders with its own Python.

The training is the tiny model of jobgen.train.tiny: a 2-node LoRA fine-tune on DeepSpeed ZeRO-2
(gloo), 12 steps; JOBGEN_DEBUG_STEP_DELAY (in environment.variables, which reaches the job on
every path) slows its steps so that a test can interrupt it mid-training.
"""

from __future__ import annotations

import hashlib
import json
import random
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.pbs_servers import PbsServer
from tests.helpers import assert_at_most_one_step_lost, assert_bitwise_equal, tiny_model, uninterrupted_adapter

MAX_STEPS = 12
SAVE_INTERVAL = 4
SECRET = "s3cret, with a comma and spaces"  # what PBS Pro's qsub -v passes intact (see the refusal test)
MODULE = "jobgen-test/1.0"
GREETING = "it's $(not run)"
# The node script records a hash of the secret it got, so the value itself is never written.
SECRET_SEEN = 'printf %s "$JOBGEN_TEST_TOKEN" | sha256sum | cut -c1-16 >> "$JOBGEN_RUN_DIR/secret-seen-$NODE_RANK"'
SECRET_HASH = hashlib.sha256(SECRET.encode()).hexdigest()[:16]


# --- shared: the tiny model, the reference, submitting and waiting ----------------------------


@pytest.fixture(scope="module")
def tiny() -> Path:
    """The tiny model and data, in a folder every job user can read."""
    folder = Path(tempfile.mkdtemp(prefix="jobgen-test-tiny-", dir="/var/tmp"))
    folder.chmod(0o755)
    tiny_model(folder)
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def lora_job(tiny: Path, name: str, setup: list[str], step_delay: float = 0, **sections) -> dict:
    job = {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1},
        "environment": {"setup": setup, "secrets": ["JOBGEN_TEST_TOKEN"],
                        "variables": {"JOBGEN_DEBUG_STEP_DELAY": str(step_delay)}},
        "training": {
            "model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
            "per_device_batch_size": 2, "max_length": 64, "max_steps": MAX_STEPS, "save_interval": SAVE_INTERVAL,
        },
        "requeue": {"max_restarts": 5, "warning_seconds": 30},
    }
    for section, values in sections.items():
        job[section].update(values)
    return job


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict:
    """The job run once without interruption (tests.helpers.uninterrupted_adapter: once per test
    run, shared with the Slurm modules and the complexes of separate hosts)."""
    return uninterrupted_adapter(lora_job(tiny, "reference", setup=[])["training"], tiny)


def write_job(server: PbsServer, folder: Path, job: dict) -> Path:
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    shutil.chown(path, server.user, server.user)
    return path


def jobgen_as(server: PbsServer, folder: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`jobgen ARGS` as the job user runs it, in `folder`."""
    return server.run([f"{server.venv}/bin/jobgen", *args], cwd=folder, env=env)


def submit(server: PbsServer, folder: Path, job: dict, how: str, env: dict | None = None) -> str:
    """The job, by `jobgen submit` or by plain `qsub` of the script `jobgen render` wrote."""
    config = write_job(server, folder, job)
    if how == "qsub":
        rendered = jobgen_as(server, folder, "render", "-s", server.flavour, config.name, "-o", "job.sh")
        assert rendered.returncode == 0, rendered.stderr
        result = server.run([str(server.bin / "qsub"), "job.sh"], cwd=folder, env=env)
    else:
        result = jobgen_as(server, folder, "submit", "-s", server.flavour, config.name, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split()[-1]  # both print the job id alone on stdout


def run_dir_of(folder: Path, job: dict) -> Path:
    return folder / "runs" / job["name"]


def wait_for(condition, what: str, timeout: float = 240, every: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def finished(server: PbsServer, job_id: str) -> dict[str, str]:
    """The job's last `qstat -f` fields once it has finished (PBS Pro: state F; Torque: C, or gone)."""
    last: dict[str, str] = {}

    def done() -> bool:
        fields = server.qstat_fields(job_id)
        last.update(fields)
        return not fields or fields.get("job_state") in ("F", "C")

    wait_for(done, f"job {job_id} to finish", timeout=300)
    return last


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "output" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def ended_as_the_reference(run_dir: Path, reference: dict, fault_at: float, resumed_from: int) -> tuple[int, float, int]:
    """Every step trained, the last one last, and the result bitwise the uninterrupted run's; the
    step reached at the fault, the seconds from it to the first new step, the steps trained again."""
    steps = trained_steps(run_dir)
    assert sorted(set(steps)) == list(range(1, MAX_STEPS + 1)) and steps[-1] == MAX_STEPS, steps
    assert_bitwise_equal(run_dir, reference)
    metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    first_new_step = min(m["time"] for m in metrics if m["step"] == resumed_from + 1 and m["time"] > fault_at)
    reached = max(m["step"] for m in metrics if m["time"] <= fault_at)
    return reached, first_new_step - fault_at, len(steps) - MAX_STEPS


def wait_for_step(run_dir: Path, step: int) -> None:
    wait_for(lambda: any(s >= step for s in trained_steps(run_dir)), f"step {step} in {run_dir}")


def status(server: PbsServer, folder: Path, target: str) -> dict:
    result = jobgen_as(server, folder, "status", target, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def logs(server: PbsServer, folder: Path, run_dir: Path, *option: str) -> str:
    return jobgen_as(server, folder, "logs", str(run_dir), *option).stdout


def assert_secret_reached_every_node(run_dir: Path, segments: int) -> None:
    for node in (0, 1):
        assert (run_dir / f"secret-seen-{node}").read_text().split() == [SECRET_HASH] * segments, f"node {node}"


def follow_continuations(server: PbsServer, folder: Path, run_dir: Path, first_id: str) -> list[dict]:
    """Waits for the job and each continuation it submitted at its walltime; the segments. Up to
    requeue.max_restarts (5) continuations: on a loaded machine each segment trains fewer steps."""
    job_id = first_id
    for _ in range(1 + 5):
        finished(server, job_id)
        log = (run_dir / "logs" / f"{job_id}.out").read_text()
        if "jobgen: continuation " not in log:
            break
        job_id = log.split("jobgen: continuation ")[1].split()[0]
    report = status(server, folder, str(run_dir))
    segments = report["segments"]
    # Each continuation is the run's newest submission: status asks the server of the last one.
    continuations = [(s["continuation_of"], s["job_id"]) for s in report["submissions"] if s.get("continuation_of")]
    assert continuations == [(a["job_id"], b["job_id"]) for a, b in zip(segments, segments[1:])], report["submissions"]
    assert report["scheduler_state"]["job_id"] == segments[-1]["job_id"], report["scheduler_state"]
    # The timer stopped the job at least once: a run that fits in one segment proves nothing.
    assert len(segments) >= 2, logs(server, folder, run_dir)
    assert [s["outcome"] for s in segments] == ["time_limit"] * (len(segments) - 1) + ["completed"], segments
    for number, (before, after) in enumerate(zip(segments, segments[1:]), start=1):
        assert (after["first_step"], after["restart"]) == (before["last_step"], number), segments
        assert after["job_id"] != before["job_id"]
        log = (run_dir / "logs" / f"{before['job_id']}.out").read_text()
        # Each segment saved a newer checkpoint: its continuation does not spend requeue.max_restarts.
        assert (f"jobgen: continuation {after['job_id']} submitted (restart {number}, not counted toward "
                "requeue.max_restarts ") in log, log
    return segments


def setup_lines(server: PbsServer) -> list[str]:
    return [f"source {server.venv}/bin/activate", SECRET_SEEN]


def probe(name: str, setup: list[str], modulefiles: Path | None = None, **launch) -> dict:
    return {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:05:00"},
        "launch": {"procs_per_node": 2, "entrypoint": "jobgen-probe", **launch},
        "environment": {
            "setup": [*setup, 'printf "%s" "$GREETING" > "$JOBGEN_RUN_DIR/greeting-$NODE_RANK"'],
            "modules": [MODULE] if modulefiles else [],
            "variables": {"GREETING": GREETING, **({"MODULEPATH": str(modulefiles)} if modulefiles else {})},
        },
        "training": {"model": "unused", "data": "unused"},
    }


def modulefiles_for(server: PbsServer) -> Path:
    """A module every node must load: Lmod's (scripts/test installs it), from a folder of the user's."""
    if not Path("/usr/share/lmod/lmod/init/bash").exists():
        pytest.fail("Lmod is not installed: apt-get install -y lmod (scripts/test does it)", pytrace=False)
    folder = server.folder("modulefiles")
    (folder / "jobgen-test").mkdir()
    (folder / MODULE).write_text("#%Module1.0\nsetenv JOBGEN_TEST_MODULE loaded\n")
    subprocess.run(["chown", "-R", f"{server.user}:{server.user}", str(folder)], check=True)
    return folder


def assert_every_rank_wired(server: PbsServer, run_dir: Path) -> None:
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"), key=lambda p: int(p.stem[5:]))]
    assert len(records) == 4
    for rank, record in enumerate(records):
        assert (record["RANK"], record["LOCAL_RANK"], record["WORLD_SIZE"]) == (str(rank), str(rank % 2), "4")
        assert (record["NODE_RANK"], record["NNODES"]) == (str(rank // 2), "2")
        assert record["MASTER_ADDR"] == records[0]["MASTER_ADDR"] and record["MASTER_ADDR"] in server.nodes
        assert record["all_reduce_sum"] == 10
        assert MODULE in (record["LOADEDMODULES"] or "").split(":"), f"rank {rank} runs without {MODULE}"
    for node in (0, 1):
        assert (run_dir / f"greeting-{node}").read_text() == GREETING


# --- PBS Pro (OpenPBS) --------------------------------------------------------------------------


# Each launcher once, each way of submitting once.
@pytest.mark.parametrize("launcher,how", [("pbsdsh", "qsub"), ("pbs_tmrsh", "jobgen-submit")])
def test_openpbs_every_rank_is_wired_and_has_the_module(openpbs: PbsServer, launcher: str, how: str) -> None:
    folder = openpbs.folder(f"wired-{launcher}-{how}")
    job = probe("wired", [f"source {openpbs.venv}/bin/activate"], modulefiles_for(openpbs), launcher=launcher)
    job_id = submit(openpbs, folder, job, how)
    fields = finished(openpbs, job_id)
    run_dir = run_dir_of(folder, job)
    assert fields["Exit_status"] == "0", logs(openpbs, folder, run_dir)
    # Two vnodes (chunks), one node rank each.
    assert fields["exec_vnode"].count("(vm") == 2
    assert_every_rank_wired(openpbs, run_dir)
    log = logs(openpbs, folder, run_dir)
    assert f"jobgen: job {job_id} (restart 0) on vm" in log and "jobgen: probe completed: " in log
    for node in (0, 1):
        assert f"node {node} of 2" in logs(openpbs, folder, run_dir, "--node", str(node))
    # The server's own output file holds the same batch log, where PBS puts it.
    assert "jobgen: probe completed: " in (folder / f"jobgen-test-wired.o{job_id.split('.')[0]}").read_text()
    assert [s["outcome"] for s in status(openpbs, folder, str(run_dir))["segments"]] == ["completed"]


def test_openpbs_an_express_job_preempts_a_training_that_resumes_exactly(openpbs: PbsServer, tiny: Path, reference: dict) -> None:
    folder = openpbs.folder("preempt")
    job = lora_job(tiny, "preempt", setup_lines(openpbs), step_delay=2)
    job_id = submit(openpbs, folder, job, "jobgen-submit", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    wait_for_step(run_dir, 2)
    # It needs every CPU of every vnode: the scheduler requeues the workq job to run it.
    preemptor = subprocess.run([str(openpbs.bin / "qsub"), "-q", openpbs.express_queue, "-N", "jobgen-test-preemptor",
                                "-l", "select=4:ncpus=4", "-j", "oe", "-o", "/dev/null", "--", "/bin/sleep", "3"],
                               cwd=folder, capture_output=True, text=True, env={**os.environ, "PATH": f"{openpbs.bin}:/usr/bin:/bin"})
    assert preemptor.returncode == 0, preemptor.stderr
    fields = finished(openpbs, job_id)
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "2"), logs(openpbs, folder, run_dir)
    first, second = status(openpbs, folder, job_id)["segments"]
    assert first["outcome"] == "preempted" and second["outcome"] == "completed"
    assert second["first_step"] == first["last_step"] >= 2
    assert status(openpbs, folder, job_id)["scheduler_state"]["restarts"] == 1
    log = logs(openpbs, folder, run_dir)
    assert f"jobgen: stopped (preempted) with a complete checkpoint at step {first['last_step']}" in log
    assert "training failed" not in log
    everything = "".join(p.read_text() for p in (run_dir / "logs").glob("*.out"))
    assert "Traceback" not in everything
    # What every rank prints (transformers' weight-loading progress) is in the node logs once per
    # run, from rank 0 (the rerun has the same job id, so the same logs); every rank's whole
    # output is in its own log.
    node0, node1, rank1 = (logs(openpbs, folder, run_dir, *option) for option in (("--node", "0"), ("--node", "1"), ("--rank", "1")))
    assert node0.count("Loading weights: 100%") == 2 and "Loading weights" not in node1
    assert "Loading weights: 100%" in rank1
    assert_secret_reached_every_node(run_dir, 2)
    assert_bitwise_equal(run_dir, reference)


def test_openpbs_at_its_walltime_a_training_continues_in_a_job_it_submits_and_ends_exactly(openpbs: PbsServer, tiny: Path, reference: dict) -> None:
    # PBS cannot warn before the walltime: the script's own timer stops it 30 s before the limit,
    # after a minute, when 12 steps of 5 s cannot have been trained. requeue.max_restarts is 0:
    # every continuation at the walltime saved a newer checkpoint, and none is counted, so the run
    # of more segments than max_restarts completes (before, its first continuation was refused).
    folder = openpbs.folder("walltime")
    job = lora_job(tiny, "walltime", setup_lines(openpbs), step_delay=5, resources={"time_limit": "00:01:30"},
                   requeue={"max_restarts": 0})
    first_id = submit(openpbs, folder, job, "qsub", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    segments = follow_continuations(openpbs, folder, run_dir, first_id)
    # The server's own output file of the first job says so too.
    assert "jobgen: continuation " in (folder / f"jobgen-test-walltime.o{first_id.split('.')[0]}").read_text()
    assert_secret_reached_every_node(run_dir, len(segments))
    assert_bitwise_equal(run_dir, reference)


def test_openpbs_a_secret_its_qsub_would_change_is_refused_before_submitting(openpbs: PbsServer, tiny: Path) -> None:
    # Seen on this server: a value with ' arrives as \ in the job, one with " is refused by qsub.
    folder = openpbs.folder("quoted-secret")
    job = lora_job(tiny, "quoted-secret", setup_lines(openpbs))
    write_job(openpbs, folder, job)
    result = jobgen_as(openpbs, folder, "submit", "-s", "pbs", "job.yaml", env={"JOBGEN_TEST_TOKEN": "it's"})
    assert result.returncode != 0
    assert ("environment.secrets: the value of JOBGEN_TEST_TOKEN has \"'\", which pbs's qsub -v does not pass on "
            "intact: use a value without them, or a file the job reads") in result.stderr, result.stderr
    assert not (run_dir_of(folder, job) / "submissions.jsonl").exists()



BAD_NODE_ONCE = 'if [[ $JOBGEN_RESTART_COUNT == 0 && $NODE_RANK == 1 ]]; then exit 75; fi'  # docs/exit-codes.md: "this node is bad"


def test_openpbs_a_node_failure_continues_on_hosts_without_that_node_and_ends_exactly(openpbs: PbsServer, tiny: Path, reference: dict) -> None:
    folder = openpbs.folder("bad-node")
    job = lora_job(tiny, "bad-node", [*setup_lines(openpbs), BAD_NODE_ONCE])
    first_id = submit(openpbs, folder, job, "jobgen-submit", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    finished(openpbs, first_id)
    log = (run_dir / "logs" / f"{first_id}.out").read_text()
    bad = log.split(" on ", 1)[1].split(";")[0].split()[1]  # node 1, the nodefile's second host
    assert f"jobgen: node failure: node(s) {bad} exited 75 (node failure)" in log, log
    # PBS Pro's select cannot exclude a host: the continuation names two hosts that are not it.
    assert "jobgen: the continuation runs on " in log and f", without node(s) {bad}" in log, log
    next_id = log.split("jobgen: continuation ")[1].split()[0]
    fields = finished(openpbs, next_id)
    assert fields["Exit_status"] == "0", logs(openpbs, folder, run_dir)
    used = {part.split(":")[0].strip("(") for part in fields["exec_vnode"].split("+")}
    assert len(used) == 2 and bad not in used, fields["exec_vnode"]
    report = status(openpbs, folder, str(run_dir))
    assert [s["outcome"] for s in report["segments"]] == ["node_failed", "completed"], report["segments"]
    assert report["excluded_nodes"] == [bad]
    assert_bitwise_equal(run_dir, reference)


def test_openpbs_a_failed_node_is_replaced_by_a_spare_inside_the_job_and_it_ends_exactly(openpbs: PbsServer, tiny: Path, reference: dict) -> None:
    """resources.spare_nodes: 1 holds a third vnode: node 1's failure (exit 75) is followed at once,
    in the same job, by a segment on node 0 and the spare (pbsdsh -n by the spare's index in the
    node file): no continuation is submitted."""
    folder = openpbs.folder("spare")
    job = lora_job(tiny, "spare", [*setup_lines(openpbs), BAD_NODE_ONCE], resources={"spare_nodes": 1})
    job_id = submit(openpbs, folder, job, "jobgen-submit", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    fields = finished(openpbs, job_id)
    assert fields["Exit_status"] == "0", logs(openpbs, folder, run_dir)
    used = [part.split(":")[0].strip("(") for part in fields["exec_vnode"].split("+")]
    assert len(set(used)) == 3, fields["exec_vnode"]
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    first, bad, spare = log.split(" on ", 1)[1].split(";")[0].replace("(spare: ", "").rstrip(")").split()
    assert f"jobgen: node failure: node(s) {bad} exited 75 (node failure)" in log, log
    assert f"jobgen: restarting inside this allocation without node(s) {bad} on 2 node(s) (restart 1 of at most 5; spare(s) left: none)" in log, log
    assert f"jobgen: job {job_id} (restart 1) on {first} {spare};" in log, log
    assert "jobgen: continuation " not in log, log
    report = status(openpbs, folder, str(run_dir))
    assert [(s["job_id"], s["restart"], s["outcome"], s["nodes"]) for s in report["segments"]] == [
        (job_id, 0, "node_failed", [bad]), (job_id, 1, "completed", [])], report["segments"]
    assert [s["job_id"] for s in report["submissions"]] == [job_id]
    assert report["excluded_nodes"] == [bad]
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_openpbs_a_node_that_hangs_or_is_killed_while_training_is_replaced_by_a_spare_and_it_ends_exactly(
        openpbs: PbsServer, tiny: Path, reference: dict, fault: str) -> None:
    """While the job trains, node 1's rank is stopped with SIGSTOP (a hang the supervisor names) or
    all of node 1's processes are killed (a node going down): the job restarts at once on node 0
    and the spare, in the same job. Prints the time from the fault to the first new step
    (BENCHMARKS.md)."""
    from tests.processes import hang_node, kill_node

    folder = openpbs.folder(f"spare-{fault}")
    job = lora_job(tiny, f"spare-{fault}", setup_lines(openpbs), step_delay=2, resources={"spare_nodes": 1})
    job_id = submit(openpbs, folder, job, "jobgen-submit", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    # A hang in steady training (past heartbeat.WARM_PAUSES), where the quick bound applies.
    at_step = random.randint(9, 10) if fault == "hang" else random.randint(3, 7)
    wait_for_step(run_dir, at_step)
    wait_for(lambda: (run_dir / "heartbeat" / "node-1.json").exists(), "node 1's heartbeat", 60)
    fault_at = hang_node(run_dir, 1) if fault == "hang" else kill_node(run_dir, 1)
    fields = finished(openpbs, job_id)
    assert fields["Exit_status"] == "0", logs(openpbs, folder, run_dir)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    first, bad, spare = log.split(" on ", 1)[1].split(";")[0].replace("(spare: ", "").rstrip(")").split()
    said = "jobgen: hung: " if fault == "hang" else f"jobgen: node failure: node(s) {bad} lost: "
    assert said in log, log
    assert f"jobgen: job {job_id} (restart 1) on {first} {spare};" in log, log
    report = status(openpbs, folder, str(run_dir))
    outcome = "hung" if fault == "hang" else "node_failed"
    assert [(s["job_id"], s["outcome"], s["nodes"]) for s in report["segments"]] == [
        (job_id, outcome, [bad]), (job_id, "completed", [])], report["segments"]
    assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
    assert_bitwise_equal(run_dir, reference)
    second = report["segments"][1]
    first_new_step = max(json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
                         if json.loads(line)["step"] == second["first_step"] + 1)
    print(f"OpenPBS, spare nodes: {fault} at step ~{at_step}: first new step {first_new_step - fault_at:.0f} s after it, "
          "inside the job")


def test_torque_a_job_that_cannot_be_placed_without_its_bad_node_says_so(torque: PbsServer) -> None:
    """The Torque server has two nodes: a 2-node job without one of them can never start."""
    folder = torque.folder("bad-node")
    job = probe("bad-node", [f"source {torque.venv}/bin/activate", BAD_NODE_ONCE])
    job_id = submit(torque, folder, job, "qsub")
    fields = finished(torque, job_id)
    run_dir = run_dir_of(folder, job)
    log = "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.out")))
    log += (run_dir / "segments.jsonl").read_text() + str(fields)
    bad = log.split("jobgen: job ", 1)[1].split(" on ", 1)[1].split(";")[0].split()[1]  # node 1
    assert "jobgen: not requeued: the job needs 2 nodes but the server has 1 usable ones left (up, with " in log, log
    assert (f"cores) after excluding {bad} (listed in {run_dir}/excluded-nodes); fix or return those nodes, "
            "then submit the job again") in log, log
    assert "jobgen: continuation" not in log
    assert status(torque, folder, str(run_dir))["excluded_nodes"] == [bad]

# --- Torque -----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["qsub", "jobgen-submit"])
def test_torque_every_rank_is_wired_and_has_the_module(torque: PbsServer, how: str) -> None:
    folder = torque.folder(f"wired-{how}")
    job = probe("wired", [f"source {torque.venv}/bin/activate"], modulefiles_for(torque))
    job_id = submit(torque, folder, job, how)
    finished(torque, job_id)
    run_dir = run_dir_of(folder, job)
    assert_every_rank_wired(torque, run_dir)
    log = logs(torque, folder, run_dir)
    assert "jobgen: job " in log and " on tq" in log and "jobgen: probe completed: " in log, log
    # Torque's own output file, in the submit folder, owned by the job's user.
    output = folder / f"jobgen-test-wired.o{job_id.split('.')[0]}"
    assert "jobgen: probe completed: " in output.read_text() and output.owner() == torque.user
    assert [s["outcome"] for s in status(torque, folder, str(run_dir))["segments"]] == ["completed"]


def test_torque_a_failed_node_is_replaced_by_the_spare_its_pbsdsh_reaches_by_name(torque: PbsServer) -> None:
    """The Torque server has two nodes: a 1-node probe with one spare. Its node fails (exit 75) at
    the first start; the probe runs again at once in the same job on the spare (pbsdsh -h)."""
    folder = torque.folder("spare")
    job = probe("spare", [f"source {torque.venv}/bin/activate",
                          'if [[ $JOBGEN_RESTART_COUNT == 0 ]]; then exit 75; fi'])
    job["resources"].update(nodes=1, spare_nodes=1)
    job_id = submit(torque, folder, job, "jobgen-submit")
    finished(torque, job_id)
    run_dir = run_dir_of(folder, job)
    log = logs(torque, folder, run_dir)
    bad, spare = log.split(" on ", 1)[1].split(";")[0].replace("(spare: ", "").rstrip(")").split()
    assert f"jobgen: restarting inside this allocation without node(s) {bad} on 1 node(s)" in log, log
    assert f"(restart 1) on {spare};" in log and "jobgen: probe completed: " in log, log
    assert "jobgen: continuation" not in log, log
    segments = status(torque, folder, str(run_dir))["segments"]
    assert [(s["job_id"], s["outcome"], s["nodes"]) for s in segments] == [
        (job_id, "node_failed", [bad]), (job_id, "completed", [])], segments


def test_torque_at_its_walltime_a_training_continues_in_a_job_it_submits_and_ends_exactly(torque: PbsServer, tiny: Path, reference: dict) -> None:
    folder = torque.folder("walltime")
    job = lora_job(tiny, "walltime", setup_lines(torque), step_delay=5, resources={"time_limit": "00:01:30"})
    first_id = submit(torque, folder, job, "qsub", env={"JOBGEN_TEST_TOKEN": SECRET})
    run_dir = run_dir_of(folder, job)
    # Each continuation is submitted with Torque's own qsub, not another PBS's or Slurm's, which
    # this machine also has.
    segments = follow_continuations(torque, folder, run_dir, first_id)
    assert_secret_reached_every_node(run_dir, len(segments))
    assert_bitwise_equal(run_dir, reference)


@pytest.mark.parametrize("flavour,launcher", [("torque", "pbsdsh"), ("pbs", "pbsdsh"), ("pbs", "pbs_tmrsh")])
def test_a_failing_node_is_reported_with_its_status_and_node(flavour: str, launcher: str, request) -> None:
    """Torque's pbsdsh exits 0 when its task failed: the batch log must say which node failed
    and how (126 here: what the node runs cannot be executed, as a venv's python the job's user
    may not run), and the other node is ended."""
    server: PbsServer = request.getfixturevalue("openpbs" if flavour == "pbs" else "torque")
    folder = server.folder(f"failing-{launcher}")
    program = folder / "not-executable"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o644)
    job = probe("failing", [f"source {server.venv}/bin/activate", f'if [[ $NODE_RANK == 1 ]]; then exec {program}; fi', "sleep 300"],
                launcher=launcher)
    started = time.time()
    job_id = submit(server, folder, job, "qsub")
    fields = finished(server, job_id)
    assert time.time() - started < 120, "node 0 was not ended when node 1 failed"
    run_dir = run_dir_of(folder, job)
    log = logs(server, folder, run_dir)
    node1 = log.split(" on ", 1)[1].split(";")[0].split()[1]  # the nodefile's order: the second host is node 1
    assert node1 in server.nodes
    assert f"jobgen: node 1 ({node1}) exited with status 126: ending the other nodes" in log, log
    assert f"jobgen: training failed: the trainer left no report (node 1 ({node1}) exited with status 126)" in log
    assert fields.get("exit_status", fields.get("Exit_status")) == "126"
    assert [s["outcome"] for s in status(server, folder, str(run_dir))["segments"]] == ["failed"]


def test_torque_a_model_file_the_job_user_cannot_read_is_refused_naming_the_user(torque: PbsServer, tiny: Path) -> None:
    folder = torque.folder("unreadable")
    model = folder / "model"
    shutil.copytree(tiny / "model", model)
    subprocess.run(["chown", "-R", f"{torque.user}:{torque.user}", str(model)], check=True)
    weights = model / "model.safetensors"
    shutil.chown(weights, "root", "root")
    weights.chmod(0o600)  # saved by another user with a private umask
    job = lora_job(tiny, "unreadable", setup_lines(torque), training={"model": str(model)})
    write_job(torque, folder, job)
    expected = (f"training.model: '{weights}' is not readable by user {torque.user} (owner root, mode 0600): "
                f"give that user read access, e.g. chmod a+r {weights}")
    for command in (("validate", "job.yaml"), ("submit", "-s", "torque", "job.yaml")):
        result = jobgen_as(torque, folder, *command, env={"JOBGEN_TEST_TOKEN": SECRET})
        assert result.returncode != 0 and expected in result.stderr, result.stderr
    assert not (folder / "runs").exists() or not any((folder / "runs").iterdir())


@pytest.mark.parametrize("flavour", ["pbs", "torque"])
def test_status_logs_and_cancel_follow_a_running_job(flavour: str, request) -> None:
    server: PbsServer = request.getfixturevalue("openpbs" if flavour == "pbs" else "torque")
    folder = server.folder("cancel")
    job = probe("cancel", [f"source {server.venv}/bin/activate", "echo node-log-line", "sleep 300"])
    job_id = submit(server, folder, job, "jobgen-submit")
    run_dir = run_dir_of(folder, job)
    wait_for(lambda: "node-log-line" in logs(server, folder, run_dir, "--node", "1"), "node 1's log to show its setup line", 120)
    report = status(server, folder, job_id)
    assert report["scheduler_state"]["state"] == "R" and report["run_dir"] == str(run_dir)
    assert report["segments"][0]["outcome"] == "running or lost"
    assert f"jobgen: job {job_id} (restart 0)" in logs(server, folder, run_dir)
    cancelled = jobgen_as(server, folder, "cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    finished(server, job_id)
    # The scheduler says the job is done, and so does its segment: on PBS Pro the script's trap
    # records the SIGTERM (kill_delay leaves it 10 s); Torque's SIGKILL follows within
    # milliseconds, and the segment ended with the job all the same.
    report = status(server, folder, job_id)
    assert report["scheduler_state"]["state"] == ("F" if flavour == "pbs" else "C")
    segment = report["segments"][0]
    assert segment["ended_at"], segment
    if flavour == "torque":
        assert segment["outcome"] == "killed by the scheduler"
