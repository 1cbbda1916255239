"""Preemption, time limit, restart bound and a lost node, on the real Slurm test cluster.

A scenario runs the rendered script submitted by hand with `sbatch`, or the same job through
`jobgen submit`, or both side by side on disjoint nodes: a failure and the restart bound on both,
the preemption, the time limit, the restart count and a lost node on one each (the preemption of a
job `jobgen submit` gave Slurm: tests/test_slurm_separate_hosts.py). Once submitted the
two are the same script (`jobgen submit` gives submitit the rendered script unchanged, and
tests/test_slurm_submit.py shows both start the same processes with the same variables), so a
second run of a scenario repeats its processes, not its path. Each job is a 2-node LoRA fine-tune of a
tiny model (real DeepSpeed ZeRO-2 on gloo); JOBGEN_DEBUG_STEP_DELAY slows its steps so the test
can interrupt it mid-training. The final adapter of every interrupted run must be bitwise equal to
the same job run without interruption, and every optimizer step must be trained exactly once.

Requeued jobs wait about two minutes (Reason=BeginTime) before Slurm starts them again; as the
cluster's administrator the tests release them at once with `scontrol update StartTime=now`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import adapter, assert_bitwise_equal, jobgen, tiny_model, uninterrupted_adapter  # noqa: F401 - adapter: also imported from here

pytestmark = pytest.mark.usefixtures("slurm_cluster")

MAX_STEPS = 12
SAVE_INTERVAL = 4
VENV_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
PATHS = ("sbatch", "jobgen-submit")


def training(tiny: Path) -> dict:
    return {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
            "per_device_batch_size": 2, "max_length": 64, "max_steps": MAX_STEPS, "save_interval": SAVE_INTERVAL}


def job_file(folder: Path, tiny: Path, name: str, partition: str = "debug", **sections) -> Path:
    job = {
        "name": f"jobgen-test-{name}",
        # Exclusive: the two jobs of a scenario get disjoint nodes.
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00", "partition": partition, "exclusive": True},
        "launch": {"procs_per_node": 1},
        "training": training(tiny),
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }
    for section, values in sections.items():
        job[section].update(values)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def submit(path: str, config: Path, step_delay: float) -> str:
    env = {**os.environ, "PATH": VENV_PATH, "JOBGEN_DEBUG_STEP_DELAY": str(step_delay)}
    if path == "sbatch":
        script = config.with_suffix(".sbatch")
        assert jobgen("render", "-s", "slurm", str(config), "-o", str(script)).returncode == 0
        out = subprocess.run(["sbatch", "--parsable", str(script)], cwd=config.parent, env=env, capture_output=True, text=True)
    else:
        out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(config)],
                             cwd=config.parent, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def wait_for(condition, what: str, timeout: float = 180, every: float = 1.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def trained_steps(run_dir: Path) -> list[int]:
    path = run_dir / "output" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_step(run_dir: Path, step: int) -> None:
    wait_for(lambda: any(s >= step for s in trained_steps(run_dir)), f"step {step} in {run_dir}")


def is_requeued(job_id: str, restarts: int) -> bool:
    fields = job_fields(job_id)
    return fields.get("JobState") == "PENDING" and int(fields.get("Restarts", 0)) >= restarts


def release_when_requeued(job_id: str, restarts: int) -> None:
    """Waits until Slurm has put the job back in the queue, then lets it start at once."""
    wait_for(lambda: is_requeued(job_id, restarts), f"job {job_id} to be requeued ({restarts})", timeout=120)
    # Released within a second of its requeue, a job was started before its previous allocation
    # was cleaned up and failed ("Job credential revoked"); Slurm's own delay is two minutes.
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


def wait_until_done(job_id: str, timeout: float = 300) -> str:
    """The job's end state. Unless it is COMPLETED, what a person would look at is printed, which
    pytest shows with a failed test: the job as Slurm has it, its accounting and its batch log."""
    done = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
    try:
        state = wait_for(lambda: job_fields(job_id).get("JobState") in done and job_fields(job_id)["JobState"],
                         f"job {job_id} to end", timeout)
    except AssertionError:
        print(what_slurm_says(job_id))
        raise
    if state != "COMPLETED":
        print(what_slurm_says(job_id))
    return state


def what_slurm_says(job_id: str) -> str:
    shown = [subprocess.run(argv, capture_output=True, text=True).stdout
             for argv in (["scontrol", "show", "job", job_id], ["sacct", "-j", job_id, "-o", "JobID,State,ExitCode,NodeList,Start,End"],
                          ["sinfo", "-N", "-l"])]
    log = Path(job_fields(job_id).get("StdOut", "/nonexistent"))
    shown.append(f"--- {log}\n{log.read_text()[-4000:]}" if log.is_file() else f"--- no batch log at {log}")
    return "\n".join(shown)


def preempt_everything() -> None:
    """An exclusive job in the high-priority partition needs every node, so it preempts `debug`."""
    subprocess.run(["sbatch", "-p", "high", "--exclusive", "-N4", "--job-name=jobgen-test-preemptor", "--output=/dev/null", "--wrap", "sleep 3"],
                   check=True, capture_output=True)


def preempt_nodes_of(job_id: str) -> None:
    """An exclusive job in the high-priority partition on the job's own nodes preempts it, and only it."""
    nodes = job_fields(job_id)["NodeList"]
    subprocess.run(["sbatch", "-p", "high", "--exclusive", f"-N{len(node_names(nodes))}", "-w", nodes,
                    "--job-name=jobgen-test-preemptor", "--output=/dev/null", "--wrap", "sleep 3"],
                   check=True, capture_output=True)


def node_names(nodelist: str) -> list[str]:
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True).stdout.split()


def segments(run_dir: Path) -> list[dict]:
    from jobgen.rundir.status import pair_segments

    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    return pair_segments(events)


def goodput_of(run_dir: Path) -> str:
    """`jobgen status`'s goodput of the run (training time / time its segments held their nodes),
    for the figures a test prints."""
    from tests.helpers import jobgen as run_jobgen

    found = json.loads(run_jobgen("status", str(run_dir), "--json").stdout).get("goodput")
    return "-" if found is None else f"{found:.1%}"


def assert_every_step_trained_once(run_dir: Path) -> None:
    assert sorted(trained_steps(run_dir)) == list(range(1, MAX_STEPS + 1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model(folder)
    return folder


@pytest.fixture(scope="module")
def reference(tiny: Path) -> dict:
    """The same job run once without interruption (tests.helpers.uninterrupted_adapter: once per
    test run, on this machine, shared with every module whose training is this one)."""
    return uninterrupted_adapter(training(tiny), tiny)


def start(tmp_path: Path, tiny: Path, name: str, step_delay: float, paths: tuple[str, ...] = PATHS,
          **sections) -> dict[str, tuple[str, Path]]:
    started = {}
    for path in paths:
        config = job_file(tmp_path / path, tiny, name, **sections)
        started[path] = (submit(path, config, step_delay), config.parent / "runs" / f"jobgen-test-{name}")
    return started


def test_a_preempted_job_comes_back_by_itself_and_finishes_exactly(tmp_path: Path, tiny: Path, reference: dict) -> None:
    jobs = start(tmp_path, tiny, "preempt", step_delay=2, paths=("sbatch",))
    for _, run_dir in jobs.values():
        wait_for_step(run_dir, 2)
    preempted_at = time.time()
    preempt_everything()
    for job_id, _ in jobs.values():
        release_when_requeued(job_id, restarts=1)
    for path, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "COMPLETED", path
        first, second = segments(run_dir)
        assert first["outcome"] == "preempted" and second["outcome"] == "completed", path
        # Resumed from the checkpoint taken at the signal: no step lost, none trained twice.
        assert second["first_step"] == first["last_step"] >= 2, path
        assert (run_dir / "output" / "checkpoints").exists()
        assert_every_step_trained_once(run_dir)
        assert_bitwise_equal(run_dir, reference)
        assert job_fields(job_id)["Restarts"] == "1"
        report = jobgen("status", str(run_dir), "--json")
        assert json.loads(report.stdout)["segments"][0]["outcome"] == "preempted"
        print(f"{path}: preempted at step {first['last_step']}, {time.time() - preempted_at:.0f} s to finish")


def test_a_job_at_its_time_limit_checkpoints_requeues_and_finishes_exactly(tmp_path: Path, tiny: Path, reference: dict) -> None:
    # Slurm sends the warning 60 s before the end (it may come up to a minute early), so each
    # segment trains for between 0.5 and 1.5 minutes; 12 steps of 10 s need at least two segments.
    jobs = start(tmp_path, tiny, "timelimit", step_delay=10, paths=("jobgen-submit",),
                 resources={"time_limit": "00:02:30"}, requeue={"warning_seconds": 60, "max_restarts": 5})
    for path, (job_id, run_dir) in jobs.items():
        released = 0
        while (fields := job_fields(job_id)).get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
            # Each segment may end in a requeue: release it. A loaded machine's poll may miss one
            # (Slurm starts it by itself after its delay), so Slurm's own count is what is checked.
            if is_requeued(job_id, released + 1):
                released = int(fields.get("Restarts", released + 1))
                release_when_requeued(job_id, released)
            time.sleep(1)
        assert job_fields(job_id)["JobState"] == "COMPLETED", path
        restarts = int(job_fields(job_id)["Restarts"])
        history = segments(run_dir)
        # The warning must have stopped the job at least once: a run that fits in one segment
        # proves nothing about the time limit.
        assert len(history) >= 2 and restarts == len(history) - 1, (path, history)
        assert [s["outcome"] for s in history[:-1]] == ["time_limit"] * (len(history) - 1) and history[-1]["outcome"] == "completed"
        for before, after in zip(history, history[1:]):
            assert after["first_step"] == before["last_step"], path
        assert_every_step_trained_once(run_dir)
        assert_bitwise_equal(run_dir, reference)


def test_a_job_preempted_more_often_than_max_restarts_stops_and_says_so(tmp_path: Path, tiny: Path) -> None:
    jobs = start(tmp_path, tiny, "bound", step_delay=2, paths=("sbatch",), requeue={"max_restarts": 1})
    for _, run_dir in jobs.values():
        wait_for_step(run_dir, 2)
    preempt_everything()
    for job_id, _ in jobs.values():
        release_when_requeued(job_id, restarts=1)
    for _, run_dir in jobs.values():
        stopped_at = segments(run_dir)[0]["last_step"]
        wait_for(lambda: max(trained_steps(run_dir), default=0) > stopped_at, "a step of the second segment")
    preempt_everything()
    for path, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "FAILED", path
        history = segments(run_dir)
        assert [s["outcome"] for s in history] == ["preempted", "restarts_exhausted"], path
        log = jobgen("logs", str(run_dir)).stdout if path == "jobgen-submit" else (run_dir.parent.parent / f"jobgen-test-bound-{job_id}.out").read_text()
        assert "not requeued: the job was already restarted 1 times (requeue.max_restarts is 1)" in log, path
        assert job_fields(job_id)["Restarts"] == "1"


def test_a_node_lost_without_warning_resumes_losing_at_most_one_save_interval(tmp_path: Path, tiny: Path, reference: dict) -> None:
    """`scontrol update State=DOWN`: Slurm cancels the job on every node and requeues it.

    On this one-machine cluster the "lost" node's slurmd still answers, so the cancel reaches
    every rank as SIGTERM and the job usually commits a checkpoint at the signal (0 steps lost);
    where a node really vanishes, its ranks cannot join that save and the last periodic
    checkpoint is used. Either way no more than one save interval may be lost.
    """
    jobs = start(tmp_path, tiny, "nodelost", step_delay=2, paths=("jobgen-submit",))
    for _, run_dir in jobs.values():
        wait_for_step(run_dir, SAVE_INTERVAL + 2)
    lost_at_step = {}
    for path, (job_id, run_dir) in jobs.items():
        second_node = node_names(job_fields(job_id)["NodeList"])[1]
        lost_at_step[path] = max(trained_steps(run_dir))
        subprocess.run(["scontrol", "update", f"NodeName={second_node}", "State=DOWN", "Reason=jobgen-test"], check=True)
    for job_id, _ in jobs.values():
        release_when_requeued(job_id, restarts=1)
    for path, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "COMPLETED", path
        first, second = segments(run_dir)
        # The batch shell is killed with the job, or records the cancel's SIGTERM first.
        assert first["outcome"] in ("killed by the scheduler", "terminated"), path
        resumed = second["first_step"]
        assert lost_at_step[path] - resumed <= SAVE_INTERVAL, (path, resumed, lost_at_step)
        assert (run_dir / "segments.jsonl").read_text().count('"event": "start"') == 2
        assert sorted(set(trained_steps(run_dir))) == list(range(1, MAX_STEPS + 1))
        assert_bitwise_equal(run_dir, reference)


def test_a_job_that_fails_for_another_reason_is_not_requeued(tmp_path: Path, tiny: Path) -> None:
    # A folder the login node cannot see: `jobgen submit` only warns, and the nodes find no file.
    missing = "/jobgen-test-not-mounted-here/missing.json"
    jobs = start(tmp_path, tiny, "fails", step_delay=0, training={"data": missing})
    for path, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "FAILED", path
        assert job_fields(job_id)["Restarts"] == "0", path
        assert [s["outcome"] for s in segments(run_dir)] == ["failed"], path
        node_log = (run_dir / "logs" / f"{job_id}-node0.out").read_text()
        assert "jobgen-train: error:" in node_log and "missing.json" in node_log, path
        # The trainer's one line reaches the batch log, on both paths.
        assert f"jobgen: training failed: training.data: file '{missing}' does not exist; not requeued" in jobgen("logs", str(run_dir)).stdout, path


def test_a_job_slurm_requeues_by_itself_past_max_restarts_does_not_start_again(tmp_path: Path) -> None:
    """Slurm requeues a job without asking it (a lost node, `scontrol requeue`): the bound holds too.

    The job (a probe whose nodes then sleep) allows no restart; requeued once, its next start must
    stop before any node runs and end FAILED with the reason.
    """
    jobs = {}
    for path in PATHS:
        folder = tmp_path / path
        folder.mkdir()
        config = folder / "job.yaml"
        config.write_text(yaml.safe_dump({
            "name": "jobgen-test-bound-slurm",
            "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00", "partition": "debug", "exclusive": True},
            "launch": {"procs_per_node": 1, "entrypoint": "jobgen-probe"},
            "environment": {"setup": ['echo ran >> "$JOBGEN_RUN_DIR/node-$NODE_RANK-started"', "sleep 300"]},
            "training": {"model": "unused", "data": "unused"},
            "requeue": {"max_restarts": 0},
        }))
        jobs[path] = (submit(path, config, step_delay=0), folder / "runs" / "jobgen-test-bound-slurm")
    for job_id, run_dir in jobs.values():
        # Both nodes, not the last one alone: node 0's set-up may run after node 1's, and a requeue
        # before it ran would leave no record of its first start.
        wait_for(lambda: all((run_dir / f"node-{node}-started").exists() for node in (0, 1)), f"job {job_id}'s nodes to start")
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    for job_id, _ in jobs.values():
        release_when_requeued(job_id, restarts=1)
    for path, (job_id, run_dir) in jobs.items():
        assert wait_until_done(job_id) == "FAILED", path
        last = segments(run_dir)[-1]
        assert (last["restart"], last["outcome"]) == (1, "restarts_exhausted"), path
        log = jobgen("logs", str(run_dir)).stdout if path == "jobgen-submit" else (run_dir.parent.parent / f"jobgen-test-bound-slurm-{job_id}.out").read_text()
        assert "not started: this is restart 1 of the job, and requeue.max_restarts is 0" in log, path
        for node in (0, 1):
            assert (run_dir / f"node-{node}-started").read_text() == "ran\n", "a node started again past the bound"
