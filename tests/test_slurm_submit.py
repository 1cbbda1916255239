"""`jobgen submit` and hand-submitted `sbatch` scripts on the real Slurm test cluster.

Jobs run `jobgen-probe`: every rank records its variables and joins one all_reduce, so these
tests check the wiring a fine-tune depends on in seconds. The trainer itself runs on the
cluster in tests/test_slurm_requeue.py.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, jobgen

pytestmark = pytest.mark.usefixtures("slurm_cluster")

# The venv's torchrun and jobgen-probe must be on the nodes' PATH; sbatch passes the environment.
ENV = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def probe_job(folder: Path, name: str, nodes: int, procs: int, **resources) -> Path:
    job = {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": nodes, "gpus_per_node": 0, "time_limit": "00:05:00", **resources},
        "launch": {"procs_per_node": procs, "entrypoint": "jobgen-probe"},
        "training": {"model": "unused", "data": "unused"},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def scontrol_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return next((t.split("=", 1)[1] for t in out.split() if t.startswith("JobState=")), "GONE")


def wait_until_finished(job_id: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = scontrol_state(job_id)
        if state in FINISHED or state == "GONE":
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {scontrol_state(job_id)} after {timeout} s")


def submit_by_hand(config: Path) -> str:
    """What a user does: render, review, sbatch."""
    script = config.with_suffix(".sbatch")
    assert jobgen("render", "-s", "slurm", str(config), "-o", str(script)).returncode == 0
    out = subprocess.run(["sbatch", "--parsable", str(script)], cwd=config.parent, capture_output=True, text=True, env={**os.environ, **ENV})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def submit_with_jobgen(config: Path) -> str:
    result = jobgen("submit", "-s", "slurm", str(config), cwd=config.parent, env=ENV)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def node_addr(node: str) -> str:
    shown = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, check=True).stdout
    return shown.split("NodeAddr=", 1)[1].split()[0]


def probe_records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"), key=lambda p: int(p.stem[5:]))]


@pytest.mark.parametrize("example", sorted((REPO / "examples" / "sbatch").glob("*.sbatch")), ids=lambda p: p.stem)
def test_every_rendered_example_passes_sbatch_test_only(example: Path, tmp_path: Path) -> None:
    result = subprocess.run(["sbatch", "--test-only", str(example)], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


def test_the_master_is_the_first_nodes_node_addr_or_its_name_where_scontrol_does_not_say(tmp_path: Path) -> None:
    # The script's own lines, run against the test cluster: node1's NodeAddr is 127.0.0.1.
    result = jobgen("render", "-s", "slurm", str(probe_job(tmp_path, "addr", 2, 1)))
    assert result.returncode == 0, result.stderr
    # The hosts block's address lookup (a host's NodeAddr, from scontrol), then the lines that use it.
    lookup = result.stdout[result.stdout.index("jobgen_address_of() {\n"):]
    lookup = lookup[: lookup.index("\n}\n") + 3]
    assert "scontrol show node" in lookup, lookup
    lines = [line for line in result.stdout.splitlines() if line.startswith(("jobgen_master_addr=", "export MASTER_ADDR="))]
    assert len(lines) == 3 and "jobgen_address_of" in lines[1], lines  # empty, from the lookup, the export
    for first, master in [("node1", "127.0.0.1"), ("not-a-node", "not-a-node")]:
        shown = subprocess.run(["bash", "-c", f"set -eo pipefail; JOBGEN_HOSTS=({first} node2)\n{lookup}" + "\n".join(lines) + '\necho "$MASTER_ADDR"'],
                               capture_output=True, text=True, timeout=30)
        assert (shown.returncode, shown.stdout.strip()) == (0, master), shown.stderr


@pytest.mark.parametrize("nodes,procs", [(2, 1), (3, 1), (2, 2)])
def test_every_rank_is_wired_and_reaches_the_others(tmp_path: Path, nodes: int, procs: int) -> None:
    # Through `jobgen submit`; the 2x2 job by hand with `sbatch` too, and the two must start the same
    # processes with the same variables (jobgen submit hands submitit the rendered script unchanged).
    paths = ("jobgen submit", "sbatch") if (nodes, procs) == (2, 2) else ("jobgen submit",)
    seen = {}
    for path in paths:
        folder = tmp_path / path.replace(" ", "-")
        folder.mkdir()
        config = probe_job(folder, f"wire-{nodes}x{procs}", nodes, procs)
        job_id = submit_by_hand(config) if path == "sbatch" else submit_with_jobgen(config)
        assert wait_until_finished(job_id) == "COMPLETED", path
        run_dir = folder / "runs" / f"jobgen-test-wire-{nodes}x{procs}"
        records = probe_records(run_dir)
        assert_wired(records, nodes, procs)
        segments = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
        assert segments[-1]["event"] == "end" and segments[-1]["outcome"] == "completed"
        # cpus too: on node1..4 a job's CPUs map onto this machine's two by where Slurm placed them.
        varying = {"MASTER_PORT", "JOBGEN_JOB_ID", "SLURM_JOB_ID", "SLURMD_NODENAME", "MASTER_ADDR", "cpus"}
        seen[path] = [{k: v for k, v in r.items() if k not in varying} for r in records]
    assert all(variables == seen["jobgen submit"] for variables in seen.values())


def assert_wired(records: list[dict], nodes: int, procs: int) -> None:
    world = nodes * procs
    assert len(records) == world
    master_node = records[0]["SLURMD_NODENAME"]
    # The master is the first node's NodeAddr, which the other nodes reach, not its NodeName
    # (127.0.0.1 here: tests/cluster/slurm-cluster.sh declares it so, and the names are not).
    master_addr = node_addr(master_node)
    assert master_addr == "127.0.0.1"
    for rank, record in enumerate(records):
        assert record["RANK"] == str(rank)
        assert record["LOCAL_RANK"] == str(rank % procs)
        assert record["WORLD_SIZE"] == str(world)
        assert record["NODE_RANK"] == str(rank // procs) == record["SLURM_NODEID"]
        assert record["NNODES"] == str(nodes)
        assert record["MASTER_ADDR"] == master_addr
        assert record["all_reduce_sum"] == world * (world + 1) / 2
    assert len({r["SLURMD_NODENAME"] for r in records}) == nodes, "two node ranks ran on one node"


def test_two_jobs_sharing_nodes_get_different_master_ports(tmp_path: Path) -> None:
    configs = [probe_job(tmp_path / name, "share", 2, 1) for name in ("a", "b") if (tmp_path / name).mkdir() is None]
    job_ids = [submit_with_jobgen(config) for config in configs]
    assert [wait_until_finished(job_id) for job_id in job_ids] == ["COMPLETED", "COMPLETED"]
    ports = {probe_records(c.parent / "runs" / "jobgen-test-share")[0]["MASTER_PORT"] for c in configs}
    assert len(ports) == 2


def test_dry_run_prints_the_submission_and_submits_nothing(tmp_path: Path) -> None:
    config = probe_job(tmp_path, "dry", 2, 1)
    before = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout
    result = jobgen("submit", "-s", "slurm", "--dry-run", str(config), cwd=tmp_path, env=ENV)
    assert result.returncode == 0, result.stderr
    # What sbatch would get is the rendered script itself (tests/test_submitted_script.py
    # checks that for every example and site, and against what Slurm stored).
    assert result.stdout == jobgen("render", "-s", "slurm", str(config), cwd=tmp_path).stdout
    assert "#SBATCH --nodes=2" in result.stdout and "srun --nodes=\"$NNODES\"" in result.stdout
    assert subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True).stdout == before
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "override,slurm_says",
    [
        ("resources.partition=nope", "Invalid partition name specified"),
        ("resources.nodes=5", "Node count specification invalid"),
        ("resources.account=bogus", "account 'bogus' does not exist on this cluster"),
    ],
)
def test_the_cluster_refusing_a_job_gives_its_own_message_in_one_line(tmp_path: Path, override: str, slurm_says: str) -> None:
    config = probe_job(tmp_path, "refused", 2, 1)
    result = jobgen("submit", "-s", "slurm", str(config), "--set", override, cwd=tmp_path, env=ENV)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("jobgen: error: Slurm refused the job:")
    assert slurm_says in errors[0]
    assert "Traceback" not in result.stderr


def test_no_slurm_installed_says_so(tmp_path: Path) -> None:
    config = probe_job(tmp_path, "noslurm", 1, 1)
    result = jobgen("submit", "-s", "slurm", str(config), cwd=tmp_path, env={"PATH": str(Path(sys.executable).parent)})
    assert result.returncode == 2
    assert "'sbatch' is not on PATH: Slurm submission needs a Slurm login node" in result.stderr


def test_status_logs_and_cancel_follow_a_running_job(tmp_path: Path) -> None:
    config = probe_job(tmp_path, "follow", 2, 1)
    data = yaml.safe_load(config.read_text())
    data["environment"] = {"setup": ["echo node-log-line", "sleep 300"]}
    config.write_text(yaml.safe_dump(data))
    job_id = submit_with_jobgen(config)
    run_dir = tmp_path / "runs" / "jobgen-test-follow"
    deadline = time.time() + 60
    while scontrol_state(job_id) != "RUNNING" or not (run_dir / "logs" / f"{job_id}-node1.out").exists():
        assert time.time() < deadline, "the job did not start"
        time.sleep(0.5)

    status = json.loads(jobgen("status", job_id, "--json").stdout)
    assert status["scheduler_state"]["state"] == "RUNNING"
    assert status["run_dir"] == str(run_dir)
    assert status["segments"][0]["outcome"] == "running or lost"
    table = jobgen("status", str(run_dir)).stdout
    assert f"job {job_id}  RUNNING" in table

    deadline = time.time() + 20
    while "node-log-line" not in jobgen("logs", job_id, "--node", "1").stdout:
        assert time.time() < deadline, "node 1's log never showed its setup line"
        time.sleep(0.5)
    assert f"jobgen: job {job_id} (restart 0)" in jobgen("logs", job_id).stdout
    assert_logs_follow(job_id, run_dir / "logs" / f"{job_id}-node1.out")

    assert jobgen("cancel", job_id).returncode == 0
    assert wait_until_finished(job_id, 60) == "CANCELLED"
    assert "CANCELLED" in jobgen("status", job_id).stdout


def assert_logs_follow(job_id: str, log: Path) -> None:
    """`jobgen logs -f --node 1` prints node 1's log so far, then what is appended to it."""
    command = [sys.executable, "-m", "jobgen.cli", "logs", "-f", job_id, "--node", "1"]
    follower = subprocess.Popen(command, stdout=subprocess.PIPE, env={**os.environ, **ENV})
    try:
        assert "node-log-line" in read_until(follower, "node-log-line", 20)
        with log.open("a") as appended:
            appended.write("appended-while-following\n")
        assert "appended-while-following" in read_until(follower, "appended-while-following", 20)
    finally:
        follower.kill()
        follower.wait()


def read_until(process: subprocess.Popen, text: str, seconds: float) -> str:
    seen = ""
    deadline = time.time() + seconds
    while text not in seen:
        assert time.time() < deadline, f"{text!r} never came; got {seen!r}"
        ready, _, _ = select.select([process.stdout], [], [], 0.5)
        if ready:
            seen += os.read(process.stdout.fileno(), 65536).decode(errors="replace")
    return seen


def test_a_second_submission_into_a_busy_run_directory_is_refused(tmp_path: Path) -> None:
    config = probe_job(tmp_path, "busy", 1, 1)
    data = yaml.safe_load(config.read_text())
    data["environment"] = {"setup": ["sleep 300"]}
    config.write_text(yaml.safe_dump(data))
    job_id = submit_with_jobgen(config)
    try:
        again = jobgen("submit", "-s", "slurm", str(config), cwd=tmp_path, env=ENV)
        assert again.returncode == 2
        assert f"job {job_id} of run directory" in again.stderr and "jobgen cancel" in again.stderr
    finally:
        subprocess.run(["scancel", job_id])
