"""Separate hosts (tests/cluster/hosts.py) are what a real cluster's nodes are to each other."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from tests.cluster.hosts import DECOY_INTERFACE, REAL_INTERFACE
from tests.helpers import jobgen
from tests.test_launchers import mpi  # noqa: F401 (a fixture)
from tests.test_pbs_scripts import probe_job, stand_in_pbs  # noqa: F401 (stand_in_pbs: a fixture)
from tests.test_slurm_submit import probe_records


def on(host, *argv: str) -> str:
    done = host.run(list(argv), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_each_host_has_its_own_name_and_its_name_is_127_0_1_1_there(separate_hosts) -> None:
    host1, host2 = separate_hosts.hosts
    assert (on(host1, "hostname"), on(host2, "hostname")) == ("host1", "host2")
    assert on(host1, "getent", "hosts", "host1").split()[0] == "127.0.1.1"
    assert on(host2, "getent", "hosts", "host1").split()[0] == host1.address
    # The machine's own /etc/hosts is not touched.
    assert "host1" not in open("/etc/hosts").read()


def test_hosts_reach_each_other_by_name_over_ssh_only_on_the_real_interface(separate_hosts) -> None:
    host1, host2 = separate_hosts.hosts
    assert on(host1, "ssh", *separate_hosts.ssh_options, "host2", "hostname") == "host2"
    interfaces = on(host1, "ip", "-o", "link", "show").splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in interfaces]
    assert sorted(names[1:3]) == [DECOY_INTERFACE, f"{DECOY_INTERFACE}p"] and names[3] == REAL_INTERFACE, names
    assert f"dev {REAL_INTERFACE}" in on(host1, "ip", "-4", "route", "get", host2.address)
    # The private network is not this machine's.
    assert subprocess.run(["ip", "-4", "-o", "addr", "show", "to", f"{host1.address}/32"], capture_output=True, text=True).stdout == ""


# --- A job across them --------------------------------------------------------------------------


def run_on_first_host(separate_hosts, tmp_path: Path, job: dict, env: dict[str, str], timeout: int = 180,
                      launcher: str = "ssh") -> subprocess.CompletedProcess:
    """The PBS script of `job`, started on host1 as MoM would (the stand-in PBS's variables, a
    node file naming host1 and host2); its nodes are started by `launcher` on each host."""
    job["launch"].update(launcher=launcher, **({"ssh_options": separate_hosts.ssh_options} if launcher == "ssh" else {}))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    script = tmp_path / "job.pbs.sh"
    assert jobgen("render", "-s", "pbs", str(config), "-o", str(script)).returncode == 0
    (tmp_path / "nodefile").write_text("".join(f"{host.name}\n" for host in separate_hosts.hosts))
    full_env = {**os.environ, **env, "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path)}
    return separate_hosts[0].run(["bash", str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_stand_in_pbs_ssh_gloo_ranks_on_separate_hosts_reach_each_other(separate_hosts, tmp_path: Path, stand_in_pbs: dict) -> None:
    # Each host's name is 127.0.1.1 on itself and its first interface routes nowhere: gloo must be
    # told the interface toward the master, or rank 1 fails with connectFullMesh ... 127.0.1.1.
    result = run_on_first_host(separate_hosts, tmp_path, probe_job(2, 1), stand_in_pbs)
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, jobgen("logs", str(run_dir), "--node", "1").stdout[-3000:]
    records = probe_records(run_dir)
    assert [(record["hostname"], record["all_reduce_sum"]) for record in records] == [("host1", 3), ("host2", 3)]
    assert [record["GLOO_SOCKET_IFNAME"] for record in records] == [REAL_INTERFACE, REAL_INTERFACE]
    for rank, host in enumerate(("host1", "host2")):
        assert (f"jobgen: node {rank} ({host}): sockets on {REAL_INTERFACE}, the interface toward host1 "
                "(set launch.socket_ifname to choose)") in jobgen("logs", str(run_dir), "--node", str(rank)).stdout


def test_stand_in_pbs_ssh_an_interface_the_submitting_shell_names_is_kept(separate_hosts, tmp_path: Path, stand_in_pbs: dict) -> None:
    # The nodes' own choice would be eth1 too: only the missing line tells that it was not made.
    result = run_on_first_host(separate_hosts, tmp_path, probe_job(2, 1), {**stand_in_pbs, "GLOO_SOCKET_IFNAME": REAL_INTERFACE})
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, jobgen("logs", str(run_dir), "--node", "1").stdout[-3000:]
    assert [record["GLOO_SOCKET_IFNAME"] for record in probe_records(run_dir)] == [REAL_INTERFACE, REAL_INTERFACE]
    assert "sockets on" not in jobgen("logs", str(run_dir), "--node", "1").stdout


def test_stand_in_pbs_mpiexec_starts_each_node_on_its_own_host(separate_hosts, tmp_path: Path, stand_in_pbs: dict, mpi) -> None:
    # mpiexec reaches the other host with ssh (a user's ~/.ssh/config, here a wrapper naming the
    # fixture's), and its daemons call back over the one interface of each host that routes.
    wrapper = tmp_path / "sshbin"
    wrapper.mkdir()
    (wrapper / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh {" ".join(separate_hosts.ssh_options)} "$@"\n')
    (wrapper / "ssh").chmod(0o755)
    env = {**stand_in_pbs, **mpi.env, "PATH": f"{wrapper}:{mpi.env['PATH']}"}
    job = probe_job(2, 1)
    result = run_on_first_host(separate_hosts, tmp_path, job, env, launcher="mpiexec")
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, result.stdout[-3000:] + jobgen("logs", str(run_dir), "--node", "1").stdout[-3000:]
    records = probe_records(run_dir)
    assert [(record["hostname"], record["all_reduce_sum"]) for record in records] == [("host1", 3), ("host2", 3)]
