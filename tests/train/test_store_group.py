"""A prepared_cache shared by a group (a folder of mode 2775): every member prepares in it, after
another member's preparation was killed midway and beside the stores another member made; a user
outside the group is told in one line what to ask for. Real users, made here (root only)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.pbs_servers import _venv_for
from tests.helpers import cannot_run

GROUP = "jobgen-share"
MEMBER = "jgmember"  # in GROUP
OUTSIDER = "jgoutsider"  # not


def _ensure_user(name: str, groups: str = "") -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", *(["-G", groups] if groups else []), name],
                       check=True)


@pytest.fixture(scope="module")
def shared(tiny, tmp_path_factory):
    """A workspace every user can read: the tiny model, the data, a venv per user, and the cache
    folder root:GROUP 2775."""
    if os.geteuid() != 0:
        cannot_run("needs root to add the users of a shared group (tests/train/test_store_group.py)")
    try:
        grp.getgrnam(GROUP)
    except KeyError:
        subprocess.run(["groupadd", GROUP], check=True)
    _ensure_user(MEMBER, GROUP)
    _ensure_user(OUTSIDER)
    workspace = Path(tempfile.mkdtemp(prefix="jobgen-test-group-", dir="/var/tmp"))
    workspace.chmod(0o755)
    shutil.copytree(tiny / "model", workspace / "model")
    from jobgen.train.tiny import synthetic_conversations

    (workspace / "big.json").write_text(json.dumps(synthetic_conversations(12_000, seed=1)))
    shutil.copy(tiny / "data.json", workspace / "data.json")
    subprocess.run(["chmod", "-R", "a+rX", str(workspace)], check=True)
    cache = workspace / "cache"
    cache.mkdir()
    shutil.chown(cache, "root", GROUP)
    cache.chmod(0o2775)
    venvs = {}
    for user in (MEMBER, OUTSIDER):
        home = workspace / user
        home.mkdir()
        shutil.chown(home, user, user)
        venvs[user] = _venv_for(user, home)
    yield workspace, venvs
    shutil.rmtree(workspace, ignore_errors=True)


def _job(folder: Path, workspace: Path, data: str, **training) -> Path:
    job = folder / f"job-{len(list(folder.glob('job-*.yaml')))}.yaml"
    job.write_text(yaml.safe_dump({
        "name": "prep", "resources": {"nodes": 1, "gpus_per_node": 0}, "launch": {"procs_per_node": 2},
        "training": {"model": str(workspace / "model"), "data": str(workspace / data), "max_length": 256,
                     "prepared_cache": str(workspace / "cache"), "packing": True, **training},
    }))
    job.chmod(0o644)
    return job


def _prepare(job: Path, user: str, venv: Path) -> list[str]:
    """As `user`, with the umask most systems give (022): group write comes from the folder."""
    return ["runuser", "-u", user, "--", "sh", "-c", f'umask 022; cd "$1" && exec "$2" -m jobgen.cli prepare "$3" --site none',
            "sh", str(job.parent), str(venv / "bin" / "python"), str(job)]


def _as_root(job: Path) -> list[str]:
    import sys

    return ["sh", "-c", 'umask 022; exec "$1" -m jobgen.cli prepare "$2" --site none', "sh", sys.executable, str(job)]


def _env() -> dict:
    from tests.train.conftest import subprocess_env

    return subprocess_env(HOME="/tmp")


def test_a_member_prepares_after_another_members_preparation_was_killed(shared):
    workspace, venvs = shared
    cache = workspace / "cache"
    job = _job(workspace, workspace, "big.json")
    killed = subprocess.Popen(_as_root(job), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".tmp-") for p in cache.iterdir()):
        assert killed.poll() is None and time.monotonic() < deadline, killed.stdout.read() if killed.poll() is not None else "slow"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    (lock,) = [p for p in cache.iterdir() if p.name.endswith(".lock")]  # it stays, as it would
    assert lock.stat().st_mode & 0o777 == 0o664 and lock.group() == GROUP
    lock.chmod(0o644)  # as a jobgen before this one left it: a member may not open it to write
    done = subprocess.run(_prepare(job, MEMBER, venvs[MEMBER]), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "jobgen: prepared " in done.stderr


def test_a_member_adds_packed_rows_to_a_store_another_member_made(shared):
    workspace, venvs = shared
    job = _job(workspace, workspace, "data.json", seed=1)
    first = subprocess.run(_as_root(job), env=_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    other_seed = _job(workspace, workspace, "data.json", seed=2)  # the same tokens, packed rows of its own
    done = subprocess.run(_prepare(other_seed, MEMBER, venvs[MEMBER]), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "was prepared already" in done.stderr
    assert list((workspace / "cache").glob("*/rows-256-s2.npz"))


def test_a_user_outside_the_group_is_told_in_one_line(shared):
    workspace, venvs = shared
    job = _job(workspace, workspace, "data.json", max_length=64)  # a store nobody made
    done = subprocess.run(_prepare(job, OUTSIDER, venvs[OUTSIDER]), env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    cache = workspace / "cache"
    assert done.stderr.strip().splitlines()[-1] == (
        f"jobgen: error: training.prepared_cache: cannot write in {str(cache)!r} (Permission denied; owner root, "
        f"group {GROUP}, mode drwxrwsr-x): its owner can share it with a group you are in (chgrp -R GROUP, "
        "chmod -R g+w and g+s on its folders), or give a folder you can write")
