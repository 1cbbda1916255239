"""Pytest plugin: the `separate_hosts` fixture, nodes that are separate hosts on this machine.

Every other test runs every "node" on one kernel, at 127.0.0.1, with one /etc/hosts. Here each
host is a network namespace with its own address on a private network (10.231.0.0/24) whose
bridge exists only inside a namespace of this fixture (no address of it is on this machine's own
network), and its processes run in their own UTS and mount namespaces: their own hostname and an
/etc/hosts as Debian writes it (``127.0.1.1 <own name>``), which lists the other hosts too. So a
node that advertises "my hostname's address" tells the others 127.0.1.1, as on a real cluster.
Each host has a second interface, listed before the real one, that routes nowhere (a veth pair
with both ends in the host): "the first interface" is the wrong one.

An OpenSSH server runs on every host (its own session, inside the host's namespaces), with a host
key and a client key this fixture makes: `SeparateHosts.ssh_options` reaches any host by name.

Namespaces are named with this process's id, so two pytest processes can run at once; those a
killed earlier run left (their process is gone) are deleted first. Needs root; without it the
tests are skipped, except under ``CI=true`` (tests.helpers.cannot_run).

Register with ``pytest_plugins = ["tests.cluster.hosts"]``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

import pytest

from tests.helpers import REPO, cannot_run

NETWORK = "10.231.0"  # /24, inside the fixture's namespaces only
DECOY_NETWORK = "10.232.0"  # the interface that routes nowhere
PREFIX = "jgh"  # every namespace: jgh<pid>-...
REAL_INTERFACE = "eth1"
DECOY_INTERFACE = "eth0"
CACHE_SECONDS = 3  # each sshfs mount's attribute and negative cache, as NFS's acregmin
# Run "on" a host: its hostname, and its /etc/hosts over the machine's, seen by its processes only;
# and an empty ~/.bashrc (HOST_BASHRC beside the hosts file) over the machine's, which every ssh
# session and job shell there reads: a shell that a power-off kills in the middle of it can leave a
# lock behind (pyenv's rehash lock, on a machine whose .bashrc runs `pyenv init`), and every later
# ssh into the hosts then waits on it past the fixtures' timeouts.
HOST_BASHRC = "bashrc"
ON_HOST = ('hostname "$0" && mount --bind "$1" /etc/hosts && '
           f'{{ [ ! -f "$HOME/.bashrc" ] || mount --bind "${{1%/*}}/{HOST_BASHRC}" "$HOME/.bashrc"; }} && shift && exec "$@"')


@dataclass(frozen=True)
class Host:
    name: str  # its hostname
    netns: str
    address: str  # on REAL_INTERFACE
    hosts_file: Path

    def command(self, argv: list[str]) -> list[str]:
        """`argv` as run on this host (its network, hostname and /etc/hosts)."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", ON_HOST, self.name, str(self.hosts_file), *argv]

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv), **kwargs)

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)


def link_down(host: Host) -> None:
    """The host's cluster interface down: its peers get no reset, only silence, as from a host
    that lost power or its cable."""
    _ip("-n", host.netns, "link", "set", REAL_INTERFACE, "down")


def link_up(host: Host) -> None:
    _ip("-n", host.netns, "link", "set", REAL_INTERFACE, "up")


def kill_every_process_of(host: Host) -> list[int]:
    """SIGKILL every process of the host's network namespace (its daemons, sshd, mount, the job's
    ranks, the process keeping its namespaces), as a power-off ends them: none runs a handler.
    Looked for again until none is left (a dying launcher may start one more)."""
    killed: list[int] = []
    for _ in range(20):
        pids = [int(pid) for pid in subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                                                   timeout=30).stdout.split()]
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"{host.name}: processes still running after 20 rounds of SIGKILL")


def kill_daemon(host: Host, name: str) -> float:
    """The host's daemon `name` (its pbs_mom, slurmd) dies alone, SIGKILLed; its other processes,
    network and mount live on. Returns the time of it."""
    at = time.time()
    pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True, timeout=30).stdout.split()
    daemons = [int(pid) for pid in pids if Path(f"/proc/{pid}/comm").exists()
               and Path(f"/proc/{pid}/comm").read_text().strip() == name]
    assert daemons, f"no {name} on {host.name}"
    for pid in daemons:
        os.kill(pid, signal.SIGKILL)
    return at


def training_processes_of(host: Host) -> list[int]:
    """The pids of a job's training processes (jobgen-torchrun and its ranks) on `host`."""
    found = []
    for pid in subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split():
        try:
            if b"jobgen.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def power_off(host: Host) -> list[int]:
    """A real node failure: the link first (so that no peer sees a connection reset), then every
    process of the host killed. What the host wrote to the shared file system stays."""
    link_down(host)
    return kill_every_process_of(host)


@dataclass(frozen=True)
class SeparateHosts:
    hosts: tuple[Host, ...]
    ssh_options: list[str]  # launch.ssh_options that reach every host by its name

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    """The namespace and what still runs in it (an sshd of a killed run, a node it started)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def delete_leftovers(prefix: str) -> None:
    """Namespaces of earlier runs whose process is gone (killed before its teardown), and those of
    `prefix` (this fixture's in this process: a pid used again). Another fixture's of this process
    (another prefix) are in use."""
    for name in _namespaces():
        owner = re.match(rf"{PREFIX}(\d+)\D", name)
        if name.startswith(prefix) or (owner and not Path(f"/proc/{owner[1]}").exists()):
            _delete_namespace(name)


def debian_hosts_file(own: str, others: dict[str, str]) -> str:
    """/etc/hosts as Debian's installer writes it (its own name at 127.0.1.1), with the others."""
    lines = ["127.0.0.1\tlocalhost", f"127.0.1.1\t{own}"]
    lines += [f"{address}\t{name}" for name, address in others.items()]
    lines += ["", "::1\tlocalhost ip6-localhost ip6-loopback", "ff02::1\tip6-allnodes", "ff02::2\tip6-allrouters"]
    return "\n".join(lines) + "\n"


def make_hosts(folder: Path, count: int, prefix: str) -> tuple[Host, ...]:
    """`count` hosts, host1..hostN, on one bridge in namespace PREFIX-net."""
    names = [f"host{k + 1}" for k in range(count)]
    addresses = {name: f"{NETWORK}.{10 + k}" for k, name in enumerate(names)}
    bridge = f"{prefix}net"
    _ip("netns", "add", bridge)
    _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
    _ip("-n", bridge, "link", "set", "br0", "up")
    hosts = []
    for k, name in enumerate(names):
        netns = f"{prefix}{name}"
        _ip("netns", "add", netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        # Made first, so it is the first interface after lo: up, addressed, and leads nowhere.
        _ip("-n", netns, "link", "add", DECOY_INTERFACE, "type", "veth", "peer", "name", f"{DECOY_INTERFACE}p")
        _ip("-n", netns, "addr", "add", f"{DECOY_NETWORK}.{10 + k}/24", "dev", DECOY_INTERFACE)
        for interface in (DECOY_INTERFACE, f"{DECOY_INTERFACE}p"):
            _ip("-n", netns, "link", "set", interface, "up")
        _ip("link", "add", REAL_INTERFACE, "netns", netns, "type", "veth", "peer", "name", f"p{k}", "netns", bridge)
        _ip("-n", bridge, "link", "set", f"p{k}", "master", "br0", "up")
        _ip("-n", netns, "addr", "add", f"{addresses[name]}/24", "dev", REAL_INTERFACE)
        _ip("-n", netns, "link", "set", REAL_INTERFACE, "up")
        hosts_file = folder / f"{name}.hosts"
        (folder / HOST_BASHRC).write_text("# the test hosts' ~/.bashrc (tests/cluster/hosts.py ON_HOST)\n")
        hosts_file.write_text(debian_hosts_file(name, {other: addresses[other] for other in names if other != name}))
        hosts.append(Host(name, netns, addresses[name], hosts_file))
    return tuple(hosts)


def start_sshd(host: Host, folder: Path) -> subprocess.Popen:
    """sshd on every address of `host` (it reaches itself by its own name, i.e. 127.0.1.1); in a
    session of its own, since a daemonized one started through `ip netns exec` does not stay."""
    config = folder / f"sshd-{host.name}.conf"
    config.write_text(
        f"Port 22\nListenAddress 0.0.0.0\nHostKey {folder}/host_key\nAuthorizedKeysFile {folder}/authorized_keys\n"
        f"PidFile {folder}/sshd-{host.name}.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nSubsystem sftp internal-sftp\n"
    )
    log = open(folder / f"sshd-{host.name}.log", "w")
    server = shutil.which("sshd") or "/usr/sbin/sshd"
    return host.popen([server, "-D", "-e", "-f", str(config)], stderr=log, start_new_session=True)


def ssh_setup(folder: Path, hosts: tuple[Host, ...]) -> list[str]:
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    host_key = (folder / "host_key.pub").read_text()
    (folder / "known_hosts").write_text("".join(f"{host.name},{host.address} {host_key}" for host in hosts))
    (folder / "ssh_config").write_text(
        f"Host *\n  IdentityFile {folder}/client_key\n  UserKnownHostsFile {folder}/known_hosts\n"
        "  StrictHostKeyChecking yes\n  CheckHostIP no\n"
    )
    return ["-F", str(folder / "ssh_config")]


def wait_for_ssh(hosts: tuple[Host, ...], options: list[str], servers: list[subprocess.Popen], folder: Path) -> None:
    """Until every host reaches every host (itself included) by name."""
    deadline = time.time() + 20
    for source in hosts:
        for target in hosts:
            while source.run(["ssh", *options, "-o", "BatchMode=yes", target.name, "true"],
                             capture_output=True, timeout=30).returncode != 0:
                if time.time() > deadline or any(server.poll() is not None for server in servers):
                    logs = "".join((folder / f"sshd-{host.name}.log").read_text() for host in hosts)
                    pytest.fail(f"ssh from {source.name} to {target.name} does not work: {logs}", pytrace=False)
                time.sleep(0.2)


def keep(host: Host, state: Path, mount: Path, served: Path, ssh_options: list[str],
         binds: tuple[tuple[Path, str], ...] = (), allow_other: bool = False) -> int:
    """A process holding `host`'s namespaces (network; its own hostname, /etc/hosts and mounts),
    with `binds` (folder, where) mounted over the machine's folders and the shared folder mounted
    at `mount` by sshfs through host1's sshd (`allow_other`: for users other than root too);
    returns its pid once the mount is there. Enter it with `nsenter -t PID --net --uts --mount`."""
    ready = state / f"{host.name}.mounted"
    options = [
        f"ssh_command=ssh {' '.join(ssh_options)} -o BatchMode=yes", "dir_cache=yes", f"dcache_timeout={CACHE_SECONDS}",
        f"attr_timeout={CACHE_SECONDS}", f"entry_timeout={CACHE_SECONDS}", f"negative_timeout={CACHE_SECONDS}",
    ] + (["allow_other"] if allow_other else [])
    # What a bind would hide that the host runs from (a checkout under /tmp, over which a complex
    # mounts each host's own /tmp): set aside before the binds, moved back on top after them.
    hidden = hidden_by(binds)
    stash = [state / f"{host.name}.kept-{i}" for i in range(len(hidden))]
    for folder in stash:
        folder.mkdir(exist_ok=True)
    bind = "".join(f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(aside))} && " for path, aside in zip(hidden, stash))
    bind += "".join(f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(where))} && " for folder, where in binds)
    bind += "".join(f"mkdir -p {shlex.quote(str(path))} && mount --move {shlex.quote(str(aside))} {shlex.quote(str(path))} && "
                    for path, aside in zip(hidden, stash))
    script = bind + 'sshfs -o "$0" "host1:$1" "$2" && touch "$3" && exec sleep infinity'
    # nsenter, not `ip netns exec`: that mounts a /sys of its own, without the cgroup folders
    # slurmd needs.
    keeper = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
         "sh", "-c", ON_HOST, host.name, str(host.hosts_file),
         "sh", "-c", script, ",".join(options), str(served), str(mount), str(ready)],
        stdout=subprocess.DEVNULL, stderr=open(state / f"{host.name}.keeper.log", "w"), start_new_session=True)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if keeper.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{host.name} could not mount the shared folder: {(state / f'{host.name}.keeper.log').read_text()}",
                        pytrace=False)
        time.sleep(0.1)
    # The sleeping process: the last of the keeper's chain (nsenter, unshare, sh -> sleep), once
    # the shell that touched `ready` has become it.
    while True:
        try:
            return _descendant_named(keeper.pid, "sleep")
        except (LookupError, OSError):
            if keeper.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def hidden_by(binds: tuple[tuple[Path, str], ...]) -> list[Path]:
    """The folders the hosts' processes run from (this checkout: its src and .venv; this
    interpreter's environment) that one of `binds` would mount over, outermost only."""
    needed = sorted({REPO, Path(sys.prefix).resolve()})
    covered = [path for path in needed if any(path.is_relative_to(where) for _, where in binds)]
    return [path for path in covered if not any(path != other and path.is_relative_to(other) for other in covered)]


def _descendant_named(pid: int, name: str) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        if Path(f"/proc/{child}/comm").read_text().strip() == name:
            return int(child)
        try:
            return _descendant_named(int(child), name)
        except LookupError:
            continue
    if Path(f"/proc/{pid}/comm").read_text().strip() == name:
        return pid
    raise LookupError(f"no {name} under {pid}")


@dataclass
class ServerHosts:
    """Hosts for a batch system's complex (tests/cluster/torque_hosts.py, openpbs_hosts.py): host1
    the server host and login node, the others compute hosts, each with its sshd. `keep` gives a
    host the shared folder: host1's `served`, mounted at `shared` by every host on its own."""
    state: Path  # the fixture's files, not under pytest's tmp_path: its cleanup would walk the mounts
    hosts: tuple[Host, ...]
    ssh_options: list[str]
    served: Path
    shared: Path
    keepers: dict[str, int] = field(default_factory=dict)  # host name -> pid of the process holding its namespaces

    def keep(self, host: Host, binds: tuple[tuple[Path, str], ...]) -> None:
        self.keepers[host.name] = keep(host, self.state, self.shared, self.served, self.ssh_options, binds=binds,
                                       allow_other=True)


@dataclass(frozen=True)
class ComplexOnHosts:
    """A batch system's complex running on ServerHosts: commands run on one of its hosts (its
    namespaces, with the system's commands on PATH and `HOST_ENV` set)."""
    hosts: tuple[Host, ...]
    keepers: dict[str, int]  # host name -> pid of the process holding its namespaces
    shared: Path  # the shared folder, as every host mounts it
    served: Path  # the same folder, as this machine (and host1's file server) sees it
    NAME: ClassVar[str] = ""  # the batch system, for messages
    BIN_DIRS: ClassVar[tuple[str, ...]] = ()
    HOST_ENV: ClassVar[tuple[str, ...]] = ()  # NAME=VALUE

    def command(self, host: str, argv: list[str]) -> list[str]:
        path = ":".join([*self.BIN_DIRS, "/usr/sbin:/usr/bin:/sbin:/bin"])
        return ["nsenter", "-t", str(self.keepers[host]), "--net", "--uts", "--mount", "env", f"PATH={path}",
                *self.HOST_ENV, *argv]

    def run(self, host: str, argv: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def jobgen_on_host1(self, argv: list[str]) -> subprocess.CompletedProcess:
        """`jobgen ARGV` on the server host (the login node), as the complex's job user does it."""
        return self.run("host1", [sys.executable, "-m", "jobgen.cli", *argv])


def status_segments(cluster: ComplexOnHosts, run_dir: Path) -> list[dict]:
    """`jobgen status --json`'s segments of a run of the shared folder (`run_dir` as this machine
    sees it), asked on the server host."""
    status = cluster.jobgen_on_host1(["status", str(cluster.shared / run_dir.relative_to(cluster.served)), "--json"])
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)["segments"]


def back_on_the_network(cluster, name: str, powered_off: list[str]) -> tuple[int, float]:
    """Host `name` of a PBS complex, cut off (its link down, its processes alive), on the network
    again: waits until nothing of the job's old segment runs there and the server has the node free,
    its MoM never restarted, and takes it out of `powered_off`. Returns how many training processes
    were still there before the link came up, and the seconds from then until the node was free."""
    host, state = cluster.host(name), cluster.complex_hosts.state
    left = len(training_processes_of(host))
    back_at = time.time()
    link_up(host)
    wait_for_daemons(lambda: not training_processes_of(host), f"the old segment's processes on {name} ended", state,
                     cluster.NAME, timeout=180)
    wait_for_daemons(lambda: cluster.node_state(name) == "free", f"{name} free again", state, cluster.NAME, timeout=240)
    powered_off.remove(name)
    return left, time.time() - back_at


def in_the_write_of_step_8(run_dir: Path, holder: str) -> bool:
    """Node 1 inside its (held) write of step 8's checkpoint, once node 0's host (`holder`) holds
    node 1's snapshot of step 8 in its memory."""
    token = run_dir / "output" / "checkpoints" / ".snapshot-token"
    return ((run_dir / "output" / "debug-save-pause-write-rank1").exists() and token.exists() and any(
        Path("/dev/shm").glob(f"jobgen-snapshots-*/*/{holder}/step-000008.rank-00001.of-00002.{token.read_text().strip()}")))


def run_logs(run_dir: Path) -> str:
    """The tail of each of a run's logs (the batch script's, each node's, each rank's), for a
    failure message."""
    return "".join(f"--- {path.relative_to(run_dir)}\n{path.read_text(errors='replace')[-3000:]}"
                   for path in sorted((run_dir / "logs").rglob("*")) if path.is_file())


def powered_off_hosts(cluster) -> Iterator[list[str]]:
    """A test's `powered_off` fixture: the hosts (nodes) the test powers off, powered on again
    after it, up and usable by the scheduler for the next test."""
    names: list[str] = []
    yield names
    for name in names:
        cluster.power_on(name)


@contextmanager
def server_hosts(system: str, count: int, tag: str) -> Iterator[ServerHosts]:
    """`count` hosts for `system`'s complex, deleted with everything running in them at the end.

    host1's /etc/hosts names host1 by its address on the cluster network, not Debian's 127.0.1.1:
    a PBS server checks a peer's address against its own name, and its admin fixes that line on
    the server host. The compute hosts keep Debian's line, which is what jobgen has to live with."""
    if os.geteuid() != 0:
        cannot_run(f"{system} on separate hosts needs root (network namespaces, FUSE mounts, {system}'s daemons)")
    for tool in ("sshfs", "nsenter", "ip"):
        if shutil.which(tool, path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None:
            cannot_run(f"{tool} not installed: apt-get install -y sshfs openssh-server iproute2 (scripts/test does it)")
    state = Path(tempfile.mkdtemp(prefix=f"jobgen-{system.lower()}-hosts-", dir="/var/tmp"))
    state.chmod(0o755)
    served, shared = state / "served", state / "shared"
    for folder in (served, shared):
        folder.mkdir()
    served.chmod(0o777)
    prefix = f"{PREFIX}{os.getpid()}{tag}-"
    delete_leftovers(prefix)
    servers: list[subprocess.Popen] = []
    keepers: dict[str, int] = {}
    try:
        hosts = make_hosts(state, count, prefix)
        server_host = hosts[0]
        server_host.hosts_file.write_text(server_host.hosts_file.read_text().replace(
            f"127.0.1.1\t{server_host.name}", f"{server_host.address}\t{server_host.name}"))
        options = ssh_setup(state, hosts)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        servers = [start_sshd(host, state) for host in hosts]
        wait_for_ssh(hosts, options, servers, state)
        yield ServerHosts(state, hosts, options, served, shared, keepers)
    finally:
        for server in servers:
            server.terminate()
        # Deleting a host's namespace kills what runs in it: the daemons, jobs, sshfs.
        delete_leftovers_of(prefix)
        for keeper in keepers.values():
            try:
                os.kill(keeper, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(state, ignore_errors=True)


def assert_probe_met_at_node_0(run_dir: Path, cluster) -> None:
    """What jobgen-probe's ranks of a 2-node, 2-rank-per-node job on two compute hosts of `cluster`
    (a PBS complex of these hosts) recorded: they met at node 0's name over the real interface,
    and that name, Debian's 127.0.1.1 on node 0, is node 0's own address on the other node."""
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"))]
    assert len(records) == 4, sorted(p.name for p in run_dir.rglob("*"))
    first = records[0]["hostname"]  # node 0, the rendezvous
    second = records[2]["hostname"]  # node 1: any other compute host of the complex
    compute = {host.name for host in cluster.hosts[1:]}
    assert first in compute and second in compute - {first}, (first, second)
    assert [(r["RANK"], r["NODE_RANK"], r["hostname"], r["MASTER_ADDR"], r["GLOO_SOCKET_IFNAME"], r["all_reduce_sum"])
            for r in records] == [("0", "0", first, first, REAL_INTERFACE, 10), ("1", "0", first, first, REAL_INTERFACE, 10),
                                  ("2", "1", second, first, REAL_INTERFACE, 10), ("3", "1", second, first, REAL_INTERFACE, 10)]
    own = cluster.run(first, ["getent", "hosts", first]).stdout.split()[0]
    seen = cluster.run(second, ["getent", "hosts", first]).stdout.split()[0]
    assert own == "127.0.1.1" and seen == next(h.address for h in cluster.hosts if h.name == first)


def daemon_logs(state: Path) -> str:
    """The ends of a PBS complex's logs: the fixture's own (*.log) and each host's daemons' in its
    PBS_HOME or TORQUE_HOME (state/home/HOST)."""
    found = sorted(state.glob("*.log")) + sorted(state.glob("home/*/*_logs/*"))
    return "".join(f"--- {path}\n{path.read_text(errors='replace')[-1500:]}" for path in found if path.is_file())


def wait_for_daemons(condition, what: str, state: Path, complex_name: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{complex_name} on separate hosts: {what} within {timeout} s:\n{daemon_logs(state)}", pytrace=False)
        time.sleep(0.5)


def node_states(pbsnodes_a: str) -> dict[str, str]:
    """Node name -> state, from `pbsnodes -a` (OpenPBS and Torque print it alike)."""
    states, name = {}, None
    for line in pbsnodes_a.splitlines():
        if line and not line[0].isspace():
            name = line.strip()
        elif line.strip().startswith("state = "):
            states[name] = line.split("=", 1)[1].strip()
    return states


@pytest.fixture(scope="session")
def separate_hosts(tmp_path_factory):
    """Two separate hosts, host1 and host2, each with sshd; deleted at the end of the session."""
    if os.geteuid() != 0:
        cannot_run("separate hosts need root (network namespaces: ip netns, unshare)")
    if shutil.which("ip") is None or shutil.which("sshd", path=f"{os.environ.get('PATH', '')}:/usr/sbin") is None:
        cannot_run("separate hosts need iproute2 and OpenSSH: apt-get install -y iproute2 openssh-server openssh-client (scripts/test does it)")
    folder = tmp_path_factory.mktemp("hosts")
    prefix = f"{PREFIX}{os.getpid()}-"
    delete_leftovers(prefix)
    servers: list[subprocess.Popen] = []
    try:
        hosts = make_hosts(folder, 2, prefix)
        options = ssh_setup(folder, hosts)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        servers = [start_sshd(host, folder) for host in hosts]
        wait_for_ssh(hosts, options, servers, folder)
        yield SeparateHosts(hosts, options)
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
        delete_leftovers_of(prefix)


def delete_leftovers_of(prefix: str) -> None:
    for name in _namespaces():
        if name.startswith(prefix):
            _delete_namespace(name)
