"""jobgen's Slurm jobs on a Slurm cluster whose nodes are separate hosts (tests/cluster/slurm_hosts.py):
node names that resolve nowhere (only NodeAddr reaches a node), hostnames that are 127.0.1.1 on
themselves, a first interface that routes nowhere, and a run folder on a network file system that
each node mounts on its own."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from tests.cluster.hosts import REAL_INTERFACE
from tests.test_pbs_scripts import probe_job


def test_slurm_nodes_are_separate_hosts_whose_names_resolve_nowhere(slurm_on_hosts) -> None:
    ran = slurm_on_hosts.on_login(["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", "echo $SLURMD_NODENAME $(hostname)"])
    assert ran.returncode == 0, ran.stderr
    assert sorted(ran.stdout.splitlines()) == ["cn001 host1", "cn002 host2"]
    for host in slurm_on_hosts.hosts:
        assert host.run(["getent", "hosts", "cn001"], capture_output=True).returncode != 0


def submit(cluster, name: str, job: dict) -> tuple[str, Path]:
    """`jobgen submit` of `job` on the login node, from the shared folder; the job id and the run
    directory as this machine sees it (the file server's folder)."""
    job["name"] = name
    (cluster.served / name).mkdir()
    (cluster.served / name / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.on_login([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", f"{name}/job.yaml"])
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
    first = slurm_on_hosts.hosts[0].address
    assert summary == [(str(rank), f"host{rank // 2 + 1}", f"cn00{rank // 2 + 1}", first, REAL_INTERFACE, 10)
                       for rank in range(4)]
