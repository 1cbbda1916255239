"""Pytest plugin: the `openpbs` and `torque` fixtures, a real OpenPBS and a real Torque server on
this machine.

No PBS server is packaged for Debian: both are built from source by `pbs-up.sh` and
`torque-up.sh` in ../shared/schedulers (beside this checkout; JOBGEN_PBS_SOURCES names another
folder), which scripts/test runs in the background while it sets up the rest and the tests start;
a fixture waits for that run to end. Each script is idempotent: here it only starts what is down.
README.md says where the sources come from.

OpenPBS: one MoM with vnodes vm0..vm3, queues workq (default) and express (its jobs preempt
workq's by requeue); root may submit. Torque: MoMs tq0 and tq1 (np=2 each), queue batch; root
may not submit (qsub refuses it), so jobs are submitted as the ordinary user the script creates,
`tquser`, from a folder of its own, with a Python environment that user can run.

Without root, or without the scripts and no server installed, the tests that use them are
skipped, except under CI=true, where that is a failure: CI must run them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import REPO, cannot_run

SOURCES = Path(os.environ.get("JOBGEN_PBS_SOURCES") or REPO.parent / "shared" / "schedulers")
NO_SOURCES = (
    f"no PBS server is installed and {SOURCES} (pbs-up.sh, torque-up.sh and their sources) is missing: "
    "README.md says where to get them"
)
# Jobs that tests submit are named with this prefix, so that teardown deletes them and nothing else.
TEST_JOB_PREFIX = "jobgen-test"


@dataclass(frozen=True)
class PbsServer:
    """A running server and how a test submits to it as its job user would."""

    flavour: str  # the jobgen scheduler: "pbs" (PBS Pro) or "torque"
    bin: Path  # the server's own commands (Slurm's qsub wrapper may be first on PATH)
    user: str  # who submits and whom the jobs run as
    workspace: Path  # a folder that user owns, for the tests' job folders
    venv: Path  # a Python environment with jobgen[train] that user can run
    nodes: tuple[str, ...] = ()
    express_queue: str = ""  # PBS Pro: a job there preempts (requeues) the default queue's jobs
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def home(self) -> str:
        return pwd.getpwnam(self.user).pw_dir

    def env(self, **extra: str) -> dict[str, str]:
        """The submitting shell: the server's commands and the environment's first on PATH."""
        return {
            "PATH": f"{self.bin}:{self.venv}/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": self.home, "USER": self.user, "LOGNAME": self.user, "LANG": "C.UTF-8",
            **self.extra_env, **extra,
        }

    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """A command run as the job user, in `cwd`, with `self.env()` and `env` only."""
        full = self.env(**(env or {}))
        if self.user != pwd.getpwuid(os.getuid()).pw_name:
            argv = ["runuser", "-u", self.user, "--", "env", "-i", *(f"{k}={v}" for k, v in full.items()), *argv]
            return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return subprocess.run(argv, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)

    def folder(self, name: str) -> Path:
        """A new folder of the job user's in the workspace."""
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.workspace))
        path.chmod(0o755)
        shutil.chown(path, self.user, self.user)
        return path

    def qstat_fields(self, job_id: str) -> dict[str, str]:
        """`qstat -f` of the job (with -x on PBS Pro, which keeps finished jobs); {} once gone."""
        from jobgen.schedulers.pbs import qstat_fields

        argv = [str(self.bin / "qstat"), "-f", *(["-x"] if self.flavour == "pbs" else []), job_id]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        return qstat_fields(result.stdout) if result.returncode == 0 else {}

    def delete_test_jobs(self) -> None:
        listing = subprocess.run([str(self.bin / "qstat"), "-f"], capture_output=True, text=True, timeout=30).stdout
        jobs: dict[str, dict[str, str]] = {}
        job_id = None
        for line in listing.splitlines():
            if line.startswith("Job Id: "):
                job_id = line.split(": ", 1)[1].strip()
                jobs[job_id] = {}
            elif job_id and " = " in line:
                key, value = (part.strip() for part in line.split(" = ", 1))
                jobs[job_id][key] = value
        job_ids = [job_id for job_id, fields in jobs.items()
                   if fields.get("Job_Name", "").startswith(TEST_JOB_PREFIX) and fields.get("job_state") not in ("C", "F")]
        if job_ids:
            force = ["-W", "force"] if self.flavour == "pbs" else ["-p"]
            subprocess.run([str(self.bin / "qdel"), *force, *job_ids], capture_output=True, timeout=60)


def _bring_up(script: str, bin_dir: Path) -> None:
    if os.geteuid() != 0:
        cannot_run(f"needs root to start the real {script.split('-')[0]} server ({SOURCES}/{script})")
    _wait_for_scripts_test(script)
    up = SOURCES / script
    if not up.exists():
        if (bin_dir / "qstat").exists():
            return  # installed before, and its daemons' state is the admin's
        cannot_run(NO_SOURCES)
    started = subprocess.run([str(up)], capture_output=True, text=True, timeout=1200, check=False)
    if started.returncode != 0:
        pytest.fail(f"{up} exited {started.returncode}:\n{started.stdout[-3000:]}{started.stderr[-3000:]}", pytrace=False)


def _wait_for_scripts_test(script: str, timeout: float = 1800) -> None:
    """scripts/test runs the servers' scripts in the background while the tests start (a build is
    minutes of a fresh machine's set-up): wait for its run to end, and show its output if it
    failed. Run alone, pytest has no such run to wait for."""
    folder = os.environ.get("JOBGEN_PBS_UP")
    if not folder:
        return
    done, log = Path(folder) / f"{script}.rc", Path(folder) / f"{script}.log"
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{script}, started by scripts/test, still runs after {timeout:.0f} s; its output so far:\n"
                        f"{log.read_text(errors='replace')[-3000:]}", pytrace=False)
        time.sleep(2)
    rc = done.read_text().split()[0]
    if rc != "0":
        pytest.fail(f"{script}, started by scripts/test, exited {rc}:\n{log.read_text(errors='replace')[-3000:]}", pytrace=False)


def _workspace(name: str, user: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"jobgen-test-{name}-", dir="/var/tmp"))
    path.chmod(0o755)
    shutil.chown(path, user, user)
    return path


def _venv_for(user: str, workspace: Path) -> Path:
    """A Python environment `user` can run: this interpreter may live where only its owner can
    look (pyenv in /root), so the system's Python of the same version runs it, with this
    environment's packages (site-packages is read in place) and its commands (their first line
    naming the new interpreter)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    system_python = shutil.which(f"python{version}", path="/usr/bin:/usr/local/bin")
    if system_python is None:
        pytest.fail(f"no system python{version} for {user} to run jobgen with: apt-get install -y python3", pytrace=False)
    site_packages = Path(sysconfig.get_paths()["purelib"])
    readable = subprocess.run(["runuser", "-u", user, "--", "test", "-r", str(site_packages / "torch" / "__init__.py")])
    if readable.returncode != 0:
        pytest.fail(f"{user} cannot read {site_packages}: keep the checkout where every user can read it", pytrace=False)
    venv = workspace / "venv"
    subprocess.run(["runuser", "-u", user, "--", system_python, "-m", "venv", "--without-pip", str(venv)], check=True)
    own_site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    # addsitedir, not a bare path: the packages' own .pth files (jobgen's editable install) count.
    (own_site / "jobgen-test-packages.pth").write_text(f"import site; site.addsitedir({str(site_packages)!r})\n")
    here = Path(sys.executable).parent
    for command in here.iterdir():
        try:
            text = command.read_text()
        except (UnicodeDecodeError, IsADirectoryError, OSError):
            continue
        first, _, rest = text.partition("\n")
        if first.startswith("#!") and first[2:].strip() in (sys.executable, str(here / "python"), str(here / "python3")):
            target = venv / "bin" / command.name
            if not target.exists():
                target.write_text(f"#!{venv}/bin/python\n{rest}")
                target.chmod(0o755)
    subprocess.run(["chown", "-R", f"{user}:{user}", str(venv)], check=True)
    return venv


@pytest.fixture(scope="session")
def openpbs():
    """The real OpenPBS server; jobs run as root, who may submit there."""
    _bring_up("pbs-up.sh", Path("/opt/pbs/bin"))
    workspace = _workspace("openpbs", "root")
    server = PbsServer(
        flavour="pbs", bin=Path("/opt/pbs/bin"), user="root", workspace=workspace, venv=Path(sys.executable).parent.parent,
        nodes=("vm0", "vm1", "vm2", "vm3"), express_queue="express",
    )
    yield server
    server.delete_test_jobs()
    shutil.rmtree(workspace, ignore_errors=True)


@pytest.fixture(scope="session")
def torque():
    """The real Torque server; jobs are submitted by, and run as, the user `tquser`."""
    _bring_up("torque-up.sh", Path("/opt/torque/bin"))
    user = os.environ.get("TORQUE_JOB_USER", "tquser")
    try:
        pwd.getpwnam(user)
    except KeyError:
        pytest.fail(f"torque-up.sh did not create the job user {user}", pytrace=False)
    workspace = _workspace("torque", user)
    server = PbsServer(flavour="torque", bin=Path("/opt/torque/bin"), user=user, workspace=workspace,
                       venv=_venv_for(user, workspace), nodes=("tq0", "tq1"))
    yield server
    server.delete_test_jobs()
    shutil.rmtree(workspace, ignore_errors=True)
