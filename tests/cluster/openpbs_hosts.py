"""Pytest plugin: the `openpbs_on_hosts` fixture, a real OpenPBS complex whose nodes are separate hosts.

The OpenPBS server of pbs-up.sh runs its MoM, with four vnodes, on one kernel. Here five hosts of
tests/cluster/hosts.py (own network namespace, address, hostname, a Debian /etc/hosts and a first
interface that routes nowhere) run OpenPBS 23.06 as a cluster does: host1 is the server host
(pbs_server with its PostgreSQL datastore, pbs_sched, pbs_comm) and the login node jobs are
submitted from; host2 to host5 are the compute nodes, a pbs_mom each, which reach each other
(pbsdsh's tasks) through host1's pbs_comm: a 2-node job leaves two free, where the server runs a
job again when one of its nodes went down, and a 2-node job with two spares fits. Every host has its own /etc/pbs.conf and PBS_HOME, files
of this fixture mounted over the machine's in the host's mount namespace, as are /tmp and the
datastore's socket folder, so nothing of the machine's own OpenPBS server is touched; the init
script's first start (pbs_habitat) fills each PBS_HOME and creates host1's datastore.
The shared folder (submit folder, run directories) is host1's, mounted by every host with sshfs as
in tests/cluster/slurm_hosts.py. Jobs are submitted and run as root, as on the machine's server
(`acl_roots = root`).

A compute host can fail as a machine does (`OpenPbsOnHosts.power_off`: its link down, then every
process of it killed) and come back as after a reboot (`power_on`); the timeouts that decide how
soon OpenPBS notices are short here (see MAX_POLL_DOWNTIME).

host1's /etc/hosts names host1 by its address on the cluster network, not Debian's 127.0.1.1, as
a PBS admin sets up the server host (the MoMs must reach the server and pbs_comm at the address
its name gives). The compute hosts keep Debian's line, which is what jobgen has to live with, and
list their own address last, as DNS would give it for a reverse lookup (pbs_mom looks up the name
of its own address; without it the MoM refused every job: "Failed to get fullhostname from
10.231.0.11"): their own name is still 127.0.1.1 on themselves.

The hosts share the machine's process table: a host's daemons are stopped with its namespace
(`ip netns pids`), never by name. Needs root, OpenPBS built by ../shared/schedulers/pbs-up.sh
(scripts/test runs it), sshfs and openssh-server. Register with
``pytest_plugins = ["tests.cluster.openpbs_hosts"]``.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import hosts as separate
from tests.cluster.pbs_servers import _bring_up

PBS = Path("/opt/pbs")
HOME = "/var/spool/pbs"  # PBS_HOME, as pbs-up.sh builds it
SOCKETS = "/var/run/postgresql"  # where pbs-up.sh's init script has the datastore put its socket
COMPUTE = ("host2", "host3", "host4", "host5")
PORTS = "PBS_BATCH_SERVICE_PORT=15001\nPBS_MOM_SERVICE_PORT=15002\nPBS_MANAGER_SERVICE_PORT=15003\n"
SERVER_SETTINGS = """\
set server acl_roots = root
set server flatuid = True
set server job_history_enable = True
set server scheduler_iteration = 10
""" + "".join(f"create node {name}\nset node {name} resources_available.ncpus = 4\n" for name in COMPUTE)


def pbs_conf(host: str, address: str) -> str:
    """The host's /etc/pbs.conf: the server's daemons on host1, a MoM on each compute host.

    PBS_LEAF_NAME is the host's address on the cluster network: without it a leaf whose name is
    127.0.1.1 registers every address of its host with pbs_comm, loopback's among them, and
    pbs_comm, finding 127.0.1.1 already taken by the other MoM, drops one for the other in turn
    (seen here: neither MoM ever came up), as a PBS admin of Debian nodes finds out.

    PBS_TMPDIR is the host's own /tmp: qsub's background daemon listens on a socket named after the
    server and the user (`pbs_default_0____`) in /var/tmp by default, which every host shares with the
    machine here, and a host's qsub talked to the daemon of the machine's own server."""
    server = host == "host1"
    starts = "".join(f"PBS_START_{d}={int(server)}\n" for d in ("SERVER", "SCHED", "COMM")) + f"PBS_START_MOM={int(not server)}\n"
    return (f"PBS_EXEC={PBS}\nPBS_HOME={HOME}\nPBS_SERVER=host1\nPBS_CORE_LIMIT=unlimited\nPBS_SCP=/usr/bin/scp\n"
            f"PBS_TMPDIR=/tmp\nPBS_LEAF_NAME={address}\nPBS_LEAF_ROUTERS=host1:17201\nPBS_COMM_NAME=host1:17201\n{starts}{PORTS}")


# A compute node that powers off, as OpenPBS meets it, in seconds, shortened for the tests:
# - TPP (every daemon's link to pbs_comm) notices a peer gone silent by TCP keepalive and
#   TCP_USER_TIMEOUT: 30 s + 3 x 10 s and 60 s by default (src/lib/Libtpp/tpp_util.c), or what
#   PBS_TCP_KEEPALIVE says (enable,idle,interval,probes,user timeout in ms). pbs_comm and pbs_mom
#   replace their environment with PBS_HOME/pbs_environment before they read it (setup_env), so it
#   goes there, after pbs_postinstall has written the file (pbs_habitat runs pbs_postinstall only
#   on an empty PBS_HOME).
# - `$max_poll_downtime`: how long a mother superior waits, once it has lost a sister MoM, before
#   it kills the job (src/resmom/mom_comm.c; 300 s by default).
# - `$min_check_poll` / `$max_check_poll`: the MoM looks at its jobs (and kills one that lost a
#   sister) every 10 s at first, then up to every 120 s (src/resmom/mom_main.c).
MAX_POLL_DOWNTIME = 10
TCP_KEEPALIVE = "PBS_TCP_KEEPALIVE=1,5,2,3,10000\n"
MOM_CONFIG = ("$clienthost host1\n$restrict_user False\n$restrict_user_maxsysid 999\n$usecp *:/ /\n"
              f"$max_poll_downtime {MAX_POLL_DOWNTIME}\n$min_check_poll 2\n$max_check_poll 5\n")


@dataclass(frozen=True)
class OpenPbsOnHosts(separate.ComplexOnHosts):
    complex_hosts: separate.ServerHosts | None = None  # to give a host its mounts again (power_on)
    NAME = "OpenPBS"
    BIN_DIRS = (f"{PBS}/bin", f"{PBS}/sbin")
    # TMPDIR and PBS_TMPDIR outrank pbs.conf's PBS_TMPDIR: the host's own /tmp whatever they were.
    HOST_ENV = ("TMPDIR=/tmp", "PBS_TMPDIR=/tmp")

    def host(self, name: str) -> separate.Host:
        return next(host for host in self.hosts if host.name == name)

    def node_state(self, name: str) -> str:
        """The node's state as `pbsnodes` says it on the server host (free, job-busy, down...)."""
        return separate.node_states(self.run("host1", ["pbsnodes", name], timeout=30).stdout).get(name, "")

    # Faults, as real nodes meet them. Each host's processes are those of its namespace.
    def power_off(self, name: str) -> float:
        """Compute host `name` fails as a machine does: link down, then every process of it killed
        (pbs_mom, the job's ranks, sshd, the sshfs mount, the keeper). Returns the time of it."""
        at = time.time()
        separate.power_off(self.host(name))
        return at

    def kill_mom(self, name: str) -> float:
        """Compute host `name`'s pbs_mom dies alone; its ranks, network and mount live on. Returns
        the time of it."""
        return separate.kill_daemon(self.host(name), "pbs_mom")

    def power_on(self, name: str) -> None:
        """Compute host `name` back as after a reboot: what is left of it killed, its link up, sshd,
        its mounts (PBS_HOME, /tmp, the socket folder, /etc/pbs.conf, the shared folder) and pbs_mom
        started afresh; returns once the server has the node free again."""
        assert self.complex_hosts is not None and name in COMPUTE, name
        host, state = self.host(name), self.complex_hosts.state
        separate.kill_every_process_of(host)
        separate.link_up(host)
        separate.start_sshd(host, state)  # ended with the host's namespace at the end of the session
        self.complex_hosts.keep(host, binds=_binds(state, host))  # updates self.keepers: the same dict
        _start_daemons(self, state, host)
        separate.wait_for_daemons(lambda: self.node_state(name) == "free", f"{name} free again", state, "OpenPBS", timeout=120)


def _nodes_free(cluster: OpenPbsOnHosts) -> bool:
    states = separate.node_states(cluster.run("host1", ["pbsnodes", "-a"], timeout=30).stdout)
    return all(states.get(name) == "free" for name in COMPUTE)


@pytest.fixture(scope="session")
def openpbs_on_hosts():
    """OpenPBS on host1 (server, scheduler, comm: the login node) and host2..host5 (a MoM each),
    with a shared folder on sshfs; all stopped and deleted at the end of the session."""
    _bring_up("pbs-up.sh", PBS / "bin")  # builds OpenPBS if it is not yet
    with separate.server_hosts("OpenPBS", 1 + len(COMPUTE), "p") as complex_hosts:
        cluster = OpenPbsOnHosts(complex_hosts.hosts, complex_hosts.keepers, complex_hosts.shared, complex_hosts.served,
                                 complex_hosts)
        try:
            yield _start(complex_hosts, cluster)
        finally:
            for name in reversed(complex_hosts.keepers):  # stopped, not killed: a killed datastore leaves its shared memory
                cluster.run(name, ["/etc/init.d/pbs", "stop"])


def _binds(state: Path, host: separate.Host) -> tuple[tuple[Path, str], ...]:
    """The host's own PBS_HOME, /tmp, datastore socket folder and /etc/pbs.conf, over the machine's."""
    return ((state / "home" / host.name, HOME), (state / "tmp" / host.name, "/tmp"), (state / "sockets" / host.name, SOCKETS),
            (state / f"{host.name}.pbs.conf", "/etc/pbs.conf"))


def _start_daemons(cluster: OpenPbsOnHosts, state: Path, host: separate.Host) -> None:
    """The host's OpenPBS daemons by its init script (its first start fills PBS_HOME), and a MoM's
    configuration, read again by SIGHUP."""
    started = cluster.run(host.name, ["/etc/init.d/pbs", "start"], timeout=300)
    with open(state / f"{host.name}.start.log", "a") as log:
        log.write(started.stdout + started.stderr)
    if started.returncode != 0:
        pytest.fail(f"/etc/init.d/pbs start on {host.name}: {started.stdout}{started.stderr}\n"
                    f"{separate.daemon_logs(state)}", pytrace=False)
    if host.name in COMPUTE:
        (state / "home" / host.name / "mom_priv" / "config").write_text(MOM_CONFIG)
        cluster.run(host.name, ["sh", "-c", f"kill -HUP $(cat {HOME}/mom_priv/mom.lock)"])


def _start(complex_hosts: separate.ServerHosts, cluster: OpenPbsOnHosts) -> OpenPbsOnHosts:
    state = complex_hosts.state
    for host in complex_hosts.hosts[1:]:  # what DNS would answer for its address; its name is still 127.0.1.1 first
        host.hosts_file.write_text(host.hosts_file.read_text() + f"{host.address}\t{host.name}\n")
    for host in complex_hosts.hosts:
        home, tmp, sockets, conf = (folder for folder, _ in _binds(state, host))
        for folder, mode in ((home, 0o755), (tmp, 0o1777), (sockets, 0o2775)):
            folder.mkdir(parents=True)
            folder.chmod(mode)
        shutil.chown(sockets, "postgres", "postgres")
        conf.write_text(pbs_conf(host.name, host.address))
        complex_hosts.keep(host, binds=_binds(state, host))
        # What pbs_habitat's first run does to an empty PBS_HOME, so that pbs_environment exists.
        made = cluster.run(host.name, ["sh", "-c", f'exec {PBS}/libexec/pbs_postinstall server "$({PBS}/bin/qstat --version | sed "s/^.* = //")" '
                                                   f'{PBS} {HOME} "" sameconf'], timeout=120)
        if made.returncode != 0 or not (home / "pbs_environment").exists():
            pytest.fail(f"pbs_postinstall on {host.name}: {made.stdout}{made.stderr}", pytrace=False)
        with open(home / "pbs_environment", "a") as environment:
            environment.write(TCP_KEEPALIVE)
    for host in complex_hosts.hosts:  # host1 first: the MoMs register with its pbs_comm
        _start_daemons(cluster, state, host)
    separate.wait_for_daemons(lambda: cluster.run("host1", ["qstat", "-B"], timeout=30).returncode == 0,
                              "pbs_server answering", state, "OpenPBS")
    configured = cluster.run("host1", ["qmgr"], input=SERVER_SETTINGS)
    if configured.returncode != 0:
        pytest.fail(f"qmgr on host1: {configured.stdout}{configured.stderr}", pytrace=False)
    separate.wait_for_daemons(lambda: _nodes_free(cluster), f"{', '.join(COMPUTE)} free", state, "OpenPBS", timeout=90)
    return cluster
