"""Separate hosts (tests/cluster/hosts.py) are what a real cluster's nodes are to each other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.hosts import DECOY_INTERFACE, REAL_INTERFACE, link_down, link_up
from tests.helpers import jobgen
from tests.test_launchers import mpi  # noqa: F401 (a fixture)
from tests.test_pbs_scripts import probe_job, stand_in_pbs  # noqa: F401 (stand_in_pbs: a fixture)
from tests.test_slurm_submit import probe_records
from tests.train.test_health_hang_units import STEPPING_RANK, SUPERVISOR


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


LISTEN = ("import sys, time\n"
          "from jobgen.train.reachability import Listener\n"
          "listener = Listener.toward(sys.argv[1])\n"
          "print(*listener.address, flush=True)\n"
          "time.sleep(600)\n")
PROBE = ("import json, sys, time\n"
         "from jobgen.train.reachability import unanswered\n"
         "started = time.monotonic()\n"
         "silent = unanswered({1: (sys.argv[1], int(sys.argv[2]))})\n"
         "print(json.dumps([sorted(silent), round(time.monotonic() - started, 2)]))\n")


def test_a_node_answers_the_hang_supervisors_probe_stopped_or_not_and_stops_answering_when_its_link_goes_down(
        separate_hosts) -> None:
    # What the hang supervisors tell a powered-off or cut-off node by (jobgen.train.reachability):
    # its listener, on the interface toward the master, answers while the host is on the network,
    # even with its process stopped (the kernel answers), and nothing comes back once the link is down.
    host1, host2 = separate_hosts.hosts
    listener = host2.popen([sys.executable, "-c", LISTEN, host1.address], stdout=subprocess.PIPE, text=True)
    try:
        address, port = listener.stdout.readline().split()
        assert address == host2.address  # not the decoy interface, which routes nowhere

        def probe() -> tuple[list[int], float]:
            return tuple(json.loads(on(host1, sys.executable, "-c", PROBE, address, port)))

        assert probe()[0] == []
        listener.send_signal(signal.SIGSTOP)
        assert probe()[0] == []
        link_down(host2)
        try:
            silent, took = probe()
        finally:
            link_up(host2)
        assert silent == [1] and took <= 2.5, (silent, took)
        assert probe()[0] == []
    finally:
        listener.kill()
        listener.wait()


@pytest.mark.parametrize("lost, master", [(1, "address"), (0, "name")], ids=["worker", "master-by-its-name"])
def test_a_hang_supervisor_names_a_powered_off_peer_as_unreachable_within_15_s_not_after_the_60_s_floor(
        separate_hosts, tmp_path: Path, lost: int, master: str) -> None:
    # Two real supervisors, node 0 on host1 and node 1 on host2, each with a stepping rank (the
    # ranks keep step with each other: one waits while the other is gone). The lost node's host
    # loses its link, then its job's processes are killed (its sshd, which other tests use, is
    # kept): nothing it published says it stopped, so before the probes the other waited for the
    # 60 s floor and the node's silence. Now it is named in about the quick floor (10 s), as not
    # answering. The master by its name, as PBS and Torque give it: 127.0.1.1 on host1 itself, where
    # node 0 once listened for probes, so that host2's probes asked host2 and a powered-off master
    # was named only after the floor.
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    peers = run_dir / "pids"
    nodes = []
    for rank, host in enumerate(separate_hosts.hosts):
        env = dict(os.environ, JOBGEN_RUN_DIR=str(run_dir), JOBGEN_JOB_ID="21", JOBGEN_RESTART_COUNT="0",
                   NODE_RANK=str(rank), NNODES="2", JOBGEN_NODES="host1 host2",
                   MASTER_ADDR=separate_hosts.hosts[0].address if master == "address" else "host1")
        for key in ("JOBGEN_HEARTBEAT_DIR", "JOBGEN_HANG_SECONDS"):
            env.pop(key, None)
        nodes.append(host.popen([sys.executable, "-c", SUPERVISOR, "0", STEPPING_RANK, json.dumps({"PUBLISH_EVERY": 5.0}),
                                 str(peers)], env=env, stdout=subprocess.PIPE, text=True))
    ranks = [int(node.stdout.readline()) for node in nodes]
    peers.write_text(" ".join(map(str, ranks)))
    host, other = separate_hosts.hosts[lost], 1 - lost
    try:
        time.sleep(12)  # steady training: the step times known, each node's summary read with its address
        summary = json.loads((run_dir / "heartbeat" / f"node-{lost}.json").read_text())
        assert summary["probe"][0] == host.address, summary
        off_at = time.time()
        link_down(host)
        for pid in (ranks[lost], nodes[lost].pid):
            os.kill(pid, signal.SIGKILL)
        assert nodes[other].wait(timeout=60) == 0  # its rank ended by its supervisor
    finally:
        link_up(host)
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in nodes:
            node.kill()
            node.wait()
    hang = json.loads((run_dir / "hang.json").read_text())
    assert (hang["cause"], hang["nodes"], hang["ranks"], hang["node_ranks"]) == ("unreachable", f"node{lost}", [lost], [lost]), hang
    assert f"node node{lost} (rank {lost}) does not answer on the network (powered off, or cut off)" in hang["message"], hang
    assert hang["at"] - off_at <= 15, hang
    print(f"node {lost} powered off: named by the hang supervisor as not answering {hang['at'] - off_at:.1f} s after")
