"""Pytest plugin: the `shared_fs` fixture, one folder served by a real sshd and mounted twice with
sshfs, as two nodes mount a network file system.

Each mount is a node's view ("node A's" and "node B's"): it caches attributes, names and missing
names for a few seconds, as NFS does (acregmin 3 s), so one mount sees the other's writes late;
and an fcntl or flock lock taken through one mount does not exclude a lock through the other, as
on NFS with `local_lock=all`, BeeGFS with its default `tuneUseGlobalFileLocks=false` or Lustre
with `localflock`. The sshd listens on a free port of 127.0.0.1 with a key made here; the mounts
are unmounted and the sshd stopped at the end.

Needs root (FUSE mounts, an sshd that logs in as root) and Debian's `sshfs` and `openssh-server`;
without them the tests that use it are skipped, except under CI=true, where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import cannot_run, free_port

SSHD = "/usr/sbin/sshd"
# Seconds each mount trusts what it has seen: NFS's acregmin, and its cached "no such file".
CACHE_SECONDS = 3


@dataclass(frozen=True)
class SharedFolder:
    """`served` is the folder on the file server; `mounts` are the nodes' views of it."""

    served: Path
    mounts: tuple[Path, ...]


def _start_sshd(state: Path) -> tuple[subprocess.Popen, int, Path]:
    key = state / "client_key"
    host_key = state / "host_key"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    authorized = state / "authorized_keys"
    shutil.copy(f"{key}.pub", authorized)
    port = free_port()
    config = state / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nPidFile none\nAuthorizedKeysFile {authorized}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nSubsystem sftp internal-sftp\n"
    )
    # -D: in the foreground, so that this process is the sshd and stopping it stops every session.
    sshd = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(state / "sshd.log", "w"), start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return sshd, port, key
        if sshd.poll() is not None:
            break
        time.sleep(0.1)
    sshd.kill()
    pytest.fail(f"sshd did not listen on 127.0.0.1:{port}: {(state / 'sshd.log').read_text()}", pytrace=False)


def _mount(port: int, key: Path, served: Path, mount: Path, misses: float = CACHE_SECONDS) -> None:
    """`misses`: how long the mount trusts a "no such file" (FUSE's negative_timeout)."""
    mount.mkdir()
    cache = CACHE_SECONDS
    options = [
        f"IdentityFile={key}", "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
        "dir_cache=yes", f"dcache_timeout={cache}", f"attr_timeout={cache}", f"entry_timeout={cache}",
        f"negative_timeout={misses}",
    ]
    done = subprocess.run(["sshfs", "-p", str(port), "-o", ",".join(options), f"root@127.0.0.1:{served}", str(mount)],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"sshfs could not mount {served}: {done.stderr.strip()}", pytrace=False)


def _unmount(mount: Path) -> None:
    for command in (["fusermount3", "-u", "-z", str(mount)], ["umount", "-l", str(mount)]):
        if subprocess.run(command, capture_output=True, timeout=30).returncode == 0:
            return


@pytest.fixture
def shared_fs():
    """A `SharedFolder` served by its own sshd and mounted twice (node A's view, node B's)."""
    yield from _shared_folder(CACHE_SECONDS)


# As long as NFS with its defaults can keep a miss: lookupcache=all holds a negative entry until
# the folder's cached attributes expire, acdirmax 60 s.
MISSES_KEPT_LONG = 60


@pytest.fixture
def shared_fs_keeping_misses():
    """`shared_fs` whose mounts answer "no such file" for MISSES_KEPT_LONG seconds after a miss."""
    yield from _shared_folder(MISSES_KEPT_LONG)


def _shared_folder(misses: float):
    if os.geteuid() != 0:
        cannot_run("needs root to mount sshfs and run an sshd (tests/cluster/shared_fs.py)")
    if shutil.which("sshfs") is None or not os.path.exists(SSHD):
        cannot_run("sshfs or sshd not installed: apt-get install -y sshfs openssh-server")
    # Not under pytest's tmp_path: its cleanup would walk the mounts.
    state = Path(tempfile.mkdtemp(prefix="jobgen-shared-fs-", dir="/var/tmp"))
    state.chmod(0o755)
    served = state / "served"
    served.mkdir()
    served.chmod(0o777)  # the group tests add users; their folders say who may write
    sshd, port, key = _start_sshd(state)
    mounts: list[Path] = []
    try:
        for name in ("node-a", "node-b"):
            mount = state / name
            _mount(port, key, served, mount, misses)
            mounts.append(mount)
        yield SharedFolder(served, tuple(mounts))
    finally:
        for mount in mounts:
            _unmount(mount)
        os.killpg(sshd.pid, 15)
        sshd.wait(timeout=30)
        shutil.rmtree(state, ignore_errors=True)
