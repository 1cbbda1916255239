"""What a node's setup line can say with its exit status (docs/exit-codes.md), through a real
local run of the batch script (two simulated nodes, jobgen-probe: seconds, no model); and, on the
Slurm test cluster, that a job left without enough nodes to exclude its bad ones says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, tiny_model

VENV_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def probe_job(folder: Path, name: str, setup: list[str], **resources) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00", **resources},
        "launch": {"procs_per_node": 1, "entrypoint": "jobgen-probe"},
        "environment": {"setup": setup},
        "training": {"model": "unused", "data": "unused"},
    }))
    return path


def outcomes(run_dir: Path) -> list[str]:
    from jobgen.rundir.status import pair_segments

    return [s["outcome"] for s in pair_segments([json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()])]


def run_local(folder: Path, setup: list[str]) -> tuple[Path, str]:
    config = probe_job(folder, "kinds", setup)
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", str(config)], cwd=folder,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True, timeout=300)
    return folder / "runs" / "kinds", out.stdout + out.stderr


def test_a_setup_line_exiting_75_is_a_node_failure_that_names_and_excludes_the_node(tmp_path: Path) -> None:
    run_dir, output = run_local(tmp_path, ['if [[ $NODE_RANK == 1 ]]; then exit 75; fi'])
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert outcomes(run_dir) == ["node_failed"], output
    log = jobgen("logs", str(run_dir)).stdout
    assert f"jobgen: node failure: node(s) {host} exited 75 (node failure)" in log
    assert (run_dir / "excluded-nodes").read_text().split() == [host]
    # Each node says so in a file of its own (appends of several nodes to one file can be lost on NFS).
    assert [(p.name, p.read_text()) for p in (run_dir / "node-exits").iterdir()] == [("1", f"75 {host}\n")]
    assert (f"failures attributed to (a local run's nodes are all this machine: not kept out): {host}"
            in jobgen("status", str(run_dir)).stdout)


def test_a_setup_line_exiting_79_says_do_not_requeue(tmp_path: Path) -> None:
    run_dir, output = run_local(tmp_path, ['if [[ $NODE_RANK == 1 ]]; then exit 79; fi'])
    assert outcomes(run_dir) == ["failed"], output
    log = jobgen("logs", str(run_dir)).stdout
    assert "s setup exited 79: do not requeue" in log and "not requeued" in log
    assert not (run_dir / "excluded-nodes").exists()


@pytest.mark.usefixtures("slurm_cluster")
def test_a_slurm_job_that_cannot_be_placed_without_its_excluded_nodes_says_so(tmp_path: Path) -> None:
    from tests.test_slurm_requeue import job_fields, wait_until_done

    config = probe_job(tmp_path, "jobgen-test-unplaceable", ['if [[ $NODE_RANK == 1 ]]; then exit 75; fi'],
                       partition="debug", exclusive=True)
    run_dir = tmp_path / "runs" / "jobgen-test-unplaceable"
    run_dir.mkdir(parents=True)
    (run_dir / "excluded-nodes").write_text("node1\nnode2\nnode3\n")  # from this run's earlier failures
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(config)], cwd=tmp_path,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
    assert wait_until_done(job_id, timeout=900) == "FAILED"
    assert job_fields(job_id)["Restarts"] == "0"
    log = jobgen("logs", str(run_dir)).stdout
    assert "jobgen: not requeued: the job needs 2 nodes but partition debug has " in log
    assert "usable ones left after excluding node1,node2,node3" in log
    assert not (run_dir / "job.slurm-continuation.sh").exists()



@pytest.mark.usefixtures("slurm_cluster")
def test_a_slurm_job_failing_the_same_way_at_every_start_stops_as_a_restart_storm(tmp_path: Path) -> None:
    """Every node fails its setup (exit 75): each segment is continued without its node, never
    getting a step further. The second such segment in a row stops the job, with its own exit
    status, instead of spending the rest of requeue.max_restarts on allocations."""
    from tests.test_slurm_requeue import job_fields, wait_for, wait_until_done

    config = probe_job(tmp_path, "jobgen-test-storm", ["exit 75"], nodes=1, partition="debug")
    job = yaml.safe_load(config.read_text())
    job["requeue"] = {"max_restarts": 5, "max_restarts_without_progress": 2}
    config.write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "runs" / "jobgen-test-storm"
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(config)], cwd=tmp_path,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

    def ended_for_good() -> bool:
        return (run_dir / "segments.jsonl").exists() and outcomes(run_dir)[-1:] == ["restart_storm"]
    wait_for(ended_for_good, "the second segment to stop the job", timeout=600)
    last_job = json.loads((run_dir / "segments.jsonl").read_text().splitlines()[-1])["job_id"]
    assert wait_until_done(last_job) == "FAILED"
    assert job_fields(last_job)["ExitCode"] == "77:0"
    assert outcomes(run_dir) == ["node_failed", "restart_storm"]
    excluded = (run_dir / "excluded-nodes").read_text().split()
    assert len(excluded) == 2
    log = jobgen("logs", str(run_dir)).stdout
    assert ("jobgen: not requeued: a restart storm: 2 segments in a row ended without a first complete checkpoint "
            f"(node_failed, node_failed; nodes named: {' '.join(sorted(excluded))}; requeue.max_restarts_without_progress is 2)") in log, log
    assert "restart_storm" in jobgen("status", str(run_dir)).stdout
    assert not [j for j in subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True).stdout.split()
                if j == "jobgen-test-storm"]  # no third continuation waits


def test_a_probe_that_completes_says_what_it_found_not_a_training_step(tmp_path: Path) -> None:
    run_dir, output = run_local(tmp_path, [])
    assert outcomes(run_dir) == ["completed"], output
    assert "training completed" not in output
    found = json.loads((run_dir / "trainer-exit.json").read_text())["message"]
    assert f"jobgen: probe completed: {found}\n" in output, output


def test_a_node_whose_processes_all_vanish_is_a_node_failure_that_names_and_excludes_it(tmp_path: Path) -> None:
    """Node 1's processes (its torchrun and its rank) are all killed at once (SIGKILL, as when a
    node goes down) while the job trains the tiny model: node 1 leaves no record of its end, node
    0's torchrun records that its rank failed or its launcher ended it, and the segment is a node
    failure naming node 1, not a failure of the job."""
    from tests.processes import signal_all, with_environment
    from tests.test_slurm_requeue import trained_steps, wait_for

    tiny_model(tmp_path / "tiny")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "name": "kinds",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": "tiny/model", "data": "tiny/data.json", "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": 40, "save_interval": 4},
    }))
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", str(config)], cwd=tmp_path,
                              env={**os.environ, "PATH": VENV_PATH, "JOBGEN_DEBUG_STEP_DELAY": "0.5"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "kinds"
    job_id = "-"
    try:
        wait_for(lambda: len(trained_steps(run_dir)) >= 2 or submit.poll() is not None, "step 2", timeout=240)
        job_id = json.loads((run_dir / "submissions.jsonl").read_text().splitlines()[-1])["job_id"]
        node1 = set(with_environment("JOBGEN_JOB_ID", job_id)) & set(with_environment("NODE_RANK", "1"))
        assert node1, "node 1 has no processes"
        signal_all(sorted(node1), 9)
        output, _ = submit.communicate(timeout=180)
    finally:
        if submit.poll() is None:
            signal_all(with_environment("JOBGEN_JOB_ID", job_id) + [submit.pid], 9)
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert outcomes(run_dir) == ["node_failed"], output
    assert (f"jobgen: node failure: node(s) {host} lost: all of its processes ended at once without a status (killed, "
            "or the node went down), and the other nodes' ranks failed for want of it") in output, output
    assert (run_dir / "excluded-nodes").read_text().split() == [host]
    # Node 0's record of the segment (under each of its names); node 1 left none.
    (segment,) = (run_dir / "node-ends").iterdir()
    records = {p.name: p.read_text() for p in segment.iterdir()}
    assert segment.name == f"{job_id}-0" and set(records) == {f"0.{look}" for look in range(6)}, records
    assert set(records.values()) <= {f"1 {host} run\n", f"143 {host} run\n"}, records


def test_a_node_whose_setup_fails_otherwise_is_a_failure_of_the_job_not_a_lost_node(tmp_path: Path) -> None:
    run_dir, output = run_local(tmp_path, ['if [[ $NODE_RANK == 1 ]]; then exit 3; fi'])
    assert outcomes(run_dir) == ["failed"], output
    assert "lost" not in output and not (run_dir / "excluded-nodes").exists()
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    (segment,) = (run_dir / "node-ends").iterdir()
    assert (segment / "1.0").read_text() == (segment / "1.5").read_text() == f"3 {host} setup\n"
