"""Pytest plugin: the `slurm_on_hosts` fixture, a real Slurm cluster whose nodes are separate hosts.

The Slurm test cluster of slurm-cluster.sh runs ten slurmd on one kernel, at 127.0.0.1, with node
names that /etc/hosts resolves. Here each node is a separate host of tests/cluster/hosts.py (its
own network namespace, address, hostname, a Debian /etc/hosts and a first interface that routes
nowhere) and runs its own slurmd: cn001..cn004 on host2..host5. host1 runs slurmctld, is the
login node and serves the shared folder, and runs no slurmd, so that any compute node can fail as
a real one does (`SlurmOnHosts.power_off`: its link down, then every process of it killed) while
the controller lives on. The NodeNames resolve nowhere, as on clusters whose node names are only
Slurm's: NodeAddr is the way to reach a node. SlurmdTimeout is 30 s: a silent node is DOWN then. The shared folder (run directories, the model, the data) is a folder of
host1 that every host mounts on its own with sshfs, at one path: each mount caches attributes
and missing names for a few seconds and its locks hold within that mount only, as NFS with local
locks. A host's processes all share one mount namespace, kept by a process that sleeps in it.

Needs root, Debian's slurm-wlm, munge, sshfs and openssh-server, and a running munged (started
here if none answers); without them the tests are skipped, except under CI=true.

Register with ``pytest_plugins = ["tests.cluster.slurm_hosts"]``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster import hosts as separate
from tests.helpers import cannot_run

NODE_NAMES = ("cn001", "cn002", "cn003", "cn004")  # Slurm's names, on host2..host5; no host resolves them
CACHE_SECONDS = separate.CACHE_SECONDS
LOGIN = 0  # host1: slurmctld, the file server, and where users submit


@dataclass(frozen=True)
class SlurmHost:
    """A separate host whose processes share one mount namespace (its sshfs mount)."""

    host: separate.Host
    keeper: int  # pid of the process that holds the host's namespaces

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def address(self) -> str:
        return self.host.address

    def command(self, argv: list[str], cwd: Path | None = None) -> list[str]:
        # A cwd given to subprocess (or nsenter's --wd) is opened before the host's mounts are.
        enter = ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd)] if cwd else []
        return ["nsenter", "-t", str(self.keeper), "--net", "--uts", "--mount", "--", *enter, *argv]

    def run(self, argv: list[str], cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv, cwd), **kwargs)


@dataclass
class SlurmOnHosts:
    hosts: list[SlurmHost]  # host1 (the controller and login node), then one host per node
    node_names: tuple[str, ...]
    shared: Path  # the path every host mounts the shared folder at
    served: Path  # the same folder on this machine's disk (what the file server serves)
    env: dict[str, str]  # SLURM_CONF and PATH for commands run on a host
    state: Path
    ssh_options: list[str]
    servers: list[subprocess.Popen]  # each host's sshd

    @property
    def login(self) -> SlurmHost:
        return self.hosts[LOGIN]

    def node(self, name: str) -> SlurmHost:
        """The host that runs Slurm node `name`."""
        return self.hosts[1 + self.node_names.index(name)]

    def on_login(self, argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        """`argv` on the login node with the cluster's environment, in the shared folder."""
        return self.login.run(argv, env={**os.environ, **self.env, **kwargs.pop("env", {})}, cwd=self.shared, capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def node_state(self, name: str) -> str:
        """Slurm's state of node `name` as scontrol says it (IDLE, ALLOCATED, DOWN+NOT_RESPONDING...)."""
        shown = self.on_login(["scontrol", "-o", "show", "node", name]).stdout
        return next((word.split("=", 1)[1] for word in shown.split() if word.startswith("State=")), "")

    # Faults, as real nodes meet them. Each node's processes are those of its host's namespace.
    def power_off(self, name: str) -> float:
        """Node `name` fails as a machine does: link down, then every process of its host killed
        (slurmd, the job's ranks, sshd, the sshfs mount). Returns the time of the failure."""
        at = time.time()
        separate.power_off(self.node(name).host)
        return at

    def partition(self, name: str) -> float:
        """Node `name` cut off the network, its processes alive (a switch port or cable lost)."""
        at = time.time()
        separate.link_down(self.node(name).host)
        return at

    def kill_slurmd(self, name: str) -> float:
        """Node `name`'s slurmd dies alone; its ranks, network and mount live on."""
        return separate.kill_daemon(self.node(name).host, "slurmd")

    def power_on(self, name: str) -> None:
        """Node `name` back as after a reboot: what is left of it killed, its link up, sshd, the
        mount and slurmd started afresh; returns once Slurm has it idle again (ReturnToService=2)."""
        index = 1 + self.node_names.index(name)
        host = self.hosts[index].host
        separate.kill_every_process_of(host)
        separate.link_up(host)
        self.servers[index] = separate.start_sshd(host, self.state)
        separate.wait_for_ssh((self.login.host, host), self.ssh_options, self.servers, self.state)
        self.hosts[index] = SlurmHost(host, separate.keep(host, self.state, self.shared, self.served, self.ssh_options))
        _start(self.hosts[index], ["slurmd", "-N", name], {**os.environ, "SLURM_CONF": self.env["SLURM_CONF"]}, self.state)
        _wait_for_nodes(self, self.state, (name,))


def _munge_answers() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return encoded.returncode == 0 and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True,
                                                      timeout=10).returncode == 0


def _start_munge() -> None:
    """munged is shared by every host: its socket is a file, which namespaces of the network do
    not separate. slurm-cluster.sh starts it in a test run; here only when none answers."""
    if _munge_answers():
        return
    Path("/run/munge").mkdir(exist_ok=True)
    subprocess.run(["chown", "-R", "munge:munge", "/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"], check=True)
    subprocess.run(["runuser", "-u", "munge", "--", "munged", "--force"], check=True, timeout=30)
    deadline = time.monotonic() + 20
    while not _munge_answers():
        if time.monotonic() > deadline:
            pytest.fail("munged does not answer", pytrace=False)
        time.sleep(0.2)


def slurm_conf(state: Path, hosts: tuple[separate.Host, ...]) -> str:
    machine = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    layout = " ".join(word for word in machine.split() if not word.startswith("NodeName="))
    nodes = "".join(f"NodeName={name} NodeHostname={host.name} NodeAddr={host.address} {layout}\n"
                    for name, host in zip(NODE_NAMES, hosts[1:]))
    return f"""# Written by tests/cluster/slurm_hosts.py: nodes on separate hosts.
ClusterName=jobgen-hosts
SlurmctldHost={hosts[LOGIN].name}({hosts[LOGIN].address})
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
FirstJobId=70000
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation={state}/state
SlurmctldPidFile={state}/slurmctld.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdSpoolDir={state}/spool/%n
SlurmdPidFile={state}/slurmd-%n.pid
SlurmdLogFile={state}/slurmd-%n.log
MessageTimeout=10
SlurmdTimeout=30
MinJobAge=300
# A continuation (--dependency=afterany on the ended job) is free to start only once that job is
# gone, which no scheduling event follows: it waited for the next periodic pass, 48 s once (the
# main scheduler's sched_interval is 60 s, backfill's bf_interval 30 s). As the Slurm test cluster:
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=30
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def _logs(state: Path) -> str:
    return "".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(state.glob("*.log")))


def _start(node: SlurmHost, argv: list[str], env: dict[str, str], state: Path) -> None:
    started = node.run(argv, env=env, capture_output=True, text=True, timeout=60)
    if started.returncode != 0:
        pytest.fail(f"{' '.join(argv)} on {node.name} exited {started.returncode}: {started.stderr}\n{_logs(state)}",
                    pytrace=False)


def _wait_for_nodes(cluster: SlurmOnHosts, state: Path, names: tuple[str, ...] = NODE_NAMES) -> None:
    deadline = time.monotonic() + 60
    while True:
        listed = cluster.on_login(["sinfo", "-N", "-h", "-o", "%N %t"], timeout=30)
        states = dict(line.split() for line in listed.stdout.splitlines() if len(line.split()) == 2)
        if listed.returncode == 0 and all(states.get(name) == "idle" for name in names):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the Slurm nodes on separate hosts are not idle ({listed.stdout}{listed.stderr}):\n{_logs(state)}",
                        pytrace=False)
        time.sleep(0.5)


@pytest.fixture(scope="session")
def slurm_on_hosts():
    """Slurm (slurmctld on host1, a slurmd on each of host2..host5) over separate hosts, with a
    shared folder on sshfs; all stopped and deleted at the end of the session. Partitions as the
    Slurm test cluster's: `debug` (default; preempted and requeued after GraceTime=30 s) and
    `high`, whose exclusive jobs preempt it."""
    if os.geteuid() != 0:
        cannot_run("Slurm on separate hosts needs root (network namespaces, FUSE mounts, slurmd)")
    for tool in ("slurmctld", "slurmd", "munged", "sshfs", "nsenter", "ip"):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None:
            cannot_run(f"{tool} not installed: apt-get install -y slurm-wlm munge sshfs openssh-server iproute2 (scripts/test does it)")
    _start_munge()
    # Not under pytest's tmp_path: its cleanup would walk the mounts.
    state = Path(tempfile.mkdtemp(prefix="jobgen-slurm-hosts-", dir="/var/tmp"))
    state.chmod(0o755)
    served, shared = state / "served", state / "shared"
    for folder in (served, shared, state / "state", *(state / "spool" / name for name in NODE_NAMES)):
        folder.mkdir(parents=True)
    served.chmod(0o777)
    prefix = f"{separate.PREFIX}{os.getpid()}s-"
    separate.delete_leftovers(prefix)
    servers: list[subprocess.Popen] = []
    keepers: list[int] = []
    cluster = None
    try:
        hosts = separate.make_hosts(state, 1 + len(NODE_NAMES), prefix)
        options = separate.ssh_setup(state, hosts)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        servers = [separate.start_sshd(host, state) for host in hosts]
        separate.wait_for_ssh(hosts, options, servers, state)
        conf = state / "slurm.conf"
        conf.write_text(slurm_conf(state, hosts))
        nodes = [SlurmHost(host, separate.keep(host, state, shared, served, options)) for host in hosts]
        keepers = [node.keeper for node in nodes]
        env = {"SLURM_CONF": str(conf), "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        cluster = SlurmOnHosts(nodes, NODE_NAMES, shared, served, env, state, options, servers)
        daemon_env = {**os.environ, "SLURM_CONF": str(conf)}
        _start(nodes[LOGIN], ["slurmctld", "-c"], daemon_env, state)
        for name, node in zip(NODE_NAMES, nodes[1:]):
            _start(node, ["slurmd", "-N", name], daemon_env, state)
        _wait_for_nodes(cluster, state)
        yield cluster
    finally:
        for server in servers:
            server.terminate()
        # Deleting a host's namespace kills what runs in it: slurmd, slurmctld, jobs, sshfs.
        separate.delete_leftovers_of(prefix)
        for keeper in keepers + [node.keeper for node in (cluster.hosts if cluster else [])]:
            try:
                os.kill(keeper, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(state, ignore_errors=True)
