"""Pytest plugin: the `torque_on_hosts` fixture, a real Torque complex whose nodes are separate hosts.

The Torque server of torque-up.sh runs its two MoMs on one kernel at 127.0.0.1. Here five hosts
of tests/cluster/hosts.py (own network namespace, address, hostname, a Debian /etc/hosts and a
first interface that routes nowhere) run Torque 6.1.3 as a cluster does: host1 is the server
host (pbs_server, pbs_sched) and the login node jobs are submitted from; host2 to host5 are the
compute nodes, a pbs_mom each (a 2-node job and two spares, or a spare and a host for its
continuation). Every host has its own trqauthd and its own TORQUE_HOME: a folder
of this fixture mounted over /var/spool/torque in the host's mount namespace, as /tmp is (where
trqauthd puts its socket), so nothing of the machine's own Torque server is touched. The shared
folder (submit folder, run directories) is host1's, mounted by every host with sshfs as in
tests/cluster/slurm_hosts.py; jobs run as the Torque test user.

host1's /etc/hosts names host1 by its address on the cluster network, not Debian's 127.0.1.1:
Torque's server and scheduler check a peer's address against the server's name, and with that
line the scheduler refuses the server (jobs stay queued) and the server its own host's MoM ("bad
attempt to connect from 127.0.0.1 (address not trusted)"), so a Torque admin fixes the line on
the server host. The compute hosts keep Debian's line, which is what jobgen has to live with.

The hosts share the machine's process table: a host's daemons are stopped with its namespace
(`ip netns pids`), never by name, since `pkill pbs_mom` on a host stops every MoM of the machine,
the Torque test server's and OpenPBS's (seen while this was built).

Needs root, Torque built by ../shared/schedulers/torque-up.sh (scripts/test runs it), sshfs and
openssh-server. Register with ``pytest_plugins = ["tests.cluster.torque_hosts"]``.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import hosts as separate
from tests.cluster.pbs_servers import _bring_up, _venv_for, _workspace

TORQUE = Path("/opt/torque")
HOME = "/var/spool/torque"  # TORQUE_HOME, as torque-up.sh builds it
COMPUTE = ("host2", "host3", "host4", "host5")
JOB_EXIT_WAIT_TIME = 20  # seconds; Torque's default is 600
SERVER_SUBFOLDERS = ("accounting", "acl_groups", "acl_hosts", "acl_svr", "acl_users", "arrays", "credentials",
                     "disallowed_types", "hostlist", "jobs", "queues")
# allow_node_submit: a job's continuation (at its walltime, or without a lost node) is submitted
# from its node 0, a compute host, which Torque otherwise refuses ("ruserok failed validating").
SERVER_SETTINGS = """\
create queue batch queue_type = execution
set server scheduling = True
set server default_queue = batch
set server keep_completed = 600
set server query_other_jobs = True
set server scheduler_iteration = 10
set server allow_node_submit = True
set server node_check_rate = 45
set queue batch resources_default.walltime = 01:00:00
set queue batch resources_default.nodes = 1
set queue batch enabled = True
set queue batch started = True
""" + "".join(f"create node {name} np=2\n" for name in COMPUTE)


@dataclass(frozen=True)
class TorqueOnHosts(separate.ComplexOnHosts):
    user: str
    venv: Path  # jobgen for `user`
    complex_hosts: separate.ServerHosts | None = None  # to give a host its mounts again (power_on)
    NAME = "Torque"
    BIN_DIRS = (f"{TORQUE}/bin", f"{TORQUE}/sbin")

    def as_user(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """`argv` run by the job user on host1, the login node, in `cwd`, with jobgen on PATH."""
        variables = {"HOME": pwd.getpwnam(self.user).pw_dir, "PATH": f"{TORQUE}/bin:{self.venv}/bin:/usr/bin:/bin", **(env or {})}
        return self.run("host1", ["runuser", "-u", self.user, "--", "env", "-i", *(f"{k}={v}" for k, v in variables.items()),
                                  "sh", "-c", 'cd "$0" && exec "$@"', str(cwd), *argv], timeout=timeout)

    def host(self, name: str) -> separate.Host:
        return next(host for host in self.hosts if host.name == name)

    def node_state(self, name: str) -> str:
        """The node's state as `pbsnodes` says it on the server host (free, job-exclusive, down...)."""
        return separate.node_states(self.run("host1", ["pbsnodes", name], timeout=30).stdout).get(name, "")

    def jobgen_on_host1(self, argv: list[str]) -> subprocess.CompletedProcess:
        return self.as_user(["jobgen", *argv], cwd=self.shared)

    def power_off(self, name: str) -> float:
        """Compute host `name` fails as a machine does: link down, then every process of it killed
        (pbs_mom, trqauthd, the job's ranks, sshd, the sshfs mount, the keeper). Returns the time of it."""
        at = time.time()
        separate.power_off(self.host(name))
        return at

    def kill_mom(self, name: str) -> float:
        """Compute host `name`'s pbs_mom dies alone; its ranks, network and mount live on. Returns
        the time of it."""
        return separate.kill_daemon(self.host(name), "pbs_mom")

    def power_on(self, name: str) -> None:
        """Compute host `name` back as after a reboot: its link up, sshd, its mounts, trqauthd and
        pbs_mom started afresh; returns once the server has the node free again."""
        assert self.complex_hosts is not None and name in COMPUTE, name
        host, state, since = self.host(name), self.complex_hosts.state, time.time()
        separate.kill_every_process_of(host)
        separate.link_up(host)
        separate.start_sshd(host, state)  # ended with the host's namespace at the end of the session
        self.complex_hosts.keep(host, binds=_binds(state, host))  # updates self.keepers: the same dict
        _start_trqauthd(self, state, host)
        started = self.run(name, ["pbs_mom"])
        assert started.returncode == 0, started.stdout + started.stderr
        # The server may not have noticed the power-off yet (it still says free): free by a report
        # of the new MoM's (the server's rectime of it) is free again.
        separate.wait_for_daemons(lambda: self.node_state(name) == "free" and self.reported_since(name) >= since,
                                  f"{name} free again", state, "Torque", timeout=180)

    def reported_since(self, name: str) -> float:
        """When the server last had a status report of the node's MoM (its `rectime`), 0 if never."""
        shown = self.run("host1", ["pbsnodes", name], timeout=30).stdout
        found = re.search(r"\brectime=(\d+)", shown)
        return float(found.group(1)) if found else 0.0


def _torque_home(home: Path) -> None:
    """An empty TORQUE_HOME as `make install` lays it out, for a server named host1."""
    folders = {"aux": 0o755, "checkpoint": 0o1777, "spool": 0o1777, "undelivered": 0o1777, "mom_logs": 0o755,
               "server_logs": 0o755, "sched_logs": 0o755, "job_logs": 0o755, "client_logs": 0o755, "mom_priv": 0o751,
               "mom_priv/jobs": 0o751, "server_priv": 0o750, "sched_priv": 0o750, "sched_priv/accounting": 0o755,
               **{f"server_priv/{name}": 0o750 for name in SERVER_SUBFOLDERS}}
    for folder, mode in folders.items():
        (home / folder).mkdir(parents=True, exist_ok=True)
        (home / folder).chmod(mode)
    for name in ("sched_config", "holidays", "resource_group", "dedicated_time"):
        shutil.copy(Path(HOME) / "sched_priv" / name, home / "sched_priv" / name)
    shutil.copy(Path(HOME) / "pbs_environment", home / "pbs_environment")
    (home / "server_name").write_text("host1\n")
    # $job_exit_wait_time: how long a mother superior waits for every sister to confirm a job's end
    # before it finishes the job anyway (600 s by default): a sister that powered off never does.
    # $status_update_time: the MoM reports every 5 s (45 by default), so that the server's node_check_rate
    # (45 s here, 150 by default) can mark a host that powered off down within 90 s, not 300; 45, not less:
    # a MoM busy with a dead sister was once marked down at 20 s while healthy.
    (home / "mom_priv" / "config").write_text(f"$pbsserver host1\n$usecp *:/ /\n$job_exit_wait_time {JOB_EXIT_WAIT_TIME}\n"
                                              "$status_update_time 5\n")


def _nodes_free(cluster: TorqueOnHosts) -> bool:
    states = separate.node_states(cluster.run("host1", ["pbsnodes", "-a"], timeout=30).stdout)
    if all(states.get(name) == "free" for name in COMPUTE):
        return True
    # A node the server created before its MoM first reported is marked offline (seen here:
    # "down,offline,MOM-list-not-sent"); clearing the mark is what an admin does after set-up.
    cluster.run("host1", ["pbsnodes", "-c", *COMPUTE], timeout=30)
    return False


@pytest.fixture(scope="session")
def torque_on_hosts():
    """Torque on host1 (server, scheduler: the login node) and host2..host5 (a MoM each), with a
    shared folder on sshfs; all stopped and deleted at the end of the session."""
    _bring_up("torque-up.sh", TORQUE / "bin")  # builds Torque if it is not yet
    with separate.server_hosts("Torque", 1 + len(COMPUTE), "t") as complex_hosts:
        user = os.environ.get("TORQUE_JOB_USER", "tquser")
        workspace = _workspace("torque-hosts", user)
        try:
            yield _start(complex_hosts, user, workspace)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)


def _binds(state: Path, host: separate.Host) -> tuple[tuple[Path, str], ...]:
    """The host's own TORQUE_HOME and /tmp (trqauthd's socket), folders of the fixture's state."""
    return (state / "home" / host.name, HOME), (state / "tmp" / host.name, "/tmp")


def _start_trqauthd(cluster: TorqueOnHosts, state: Path, host: separate.Host) -> None:
    (state / "tmp" / host.name / "trqauthd-unix").unlink(missing_ok=True)  # a powered-off host's, left behind
    subprocess.Popen(cluster.command(host.name, ["trqauthd", "-F"]), cwd="/", stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=open(state / f"{host.name}.trqauthd.log", "a"), start_new_session=True)
    separate.wait_for_daemons(lambda: (state / "tmp" / host.name / "trqauthd-unix").exists(), f"trqauthd on {host.name}",
                              state, "Torque")


def _start(complex_hosts: separate.ServerHosts, user: str, workspace: Path) -> TorqueOnHosts:
    state, hosts = complex_hosts.state, complex_hosts.hosts
    for host in hosts:
        _torque_home(state / "home" / host.name)
        (state / "tmp" / host.name).mkdir(parents=True)
        (state / "tmp" / host.name).chmod(0o1777)
        complex_hosts.keep(host, binds=_binds(state, host))
    cluster = TorqueOnHosts(hosts, complex_hosts.keepers, complex_hosts.shared, complex_hosts.served, user,
                            _venv_for(user, workspace), complex_hosts)
    for host in hosts:
        _start_trqauthd(cluster, state, host)
    created = cluster.run("host1", ["pbs_server", "-t", "create"], input="y\n")
    if created.returncode != 0:
        pytest.fail(f"pbs_server -t create on host1: {created.stdout}{created.stderr}\n{separate.daemon_logs(state)}",
                    pytrace=False)
    separate.wait_for_daemons(lambda: cluster.run("host1", ["qstat", "-B"], timeout=30).returncode == 0,
                              "pbs_server answering", state, "Torque")
    configured = cluster.run("host1", ["qmgr"], input=SERVER_SETTINGS)
    if configured.returncode != 0:
        pytest.fail(f"qmgr on host1: {configured.stdout}{configured.stderr}", pytrace=False)
    for host, daemon in (("host1", "pbs_sched"), *((name, "pbs_mom") for name in COMPUTE)):
        started = cluster.run(host, [daemon])  # each daemonizes itself
        if started.returncode != 0:
            pytest.fail(f"{daemon} on {host}: {started.stdout}{started.stderr}\n{separate.daemon_logs(state)}", pytrace=False)
    separate.wait_for_daemons(lambda: _nodes_free(cluster), f"{', '.join(COMPUTE)} free", state, "Torque", timeout=90)
    return cluster
