"""Every per-node launcher, run for real: a 2-node probe job whose ranks all report their
variables and the environment module the job loads, with Lmod and with Environment Modules;
and a node that fails ends the job at once, every node with it, its status in the batch log.

- srun: the Slurm test cluster (tests/cluster).
- pbsdsh, pbs_tmrsh: the real OpenPBS and Torque servers (tests/test_pbs_servers.py); ssh and
  mpiexec below run under the stand-in PBS of tests/test_pbs_scripts.py, whose tasks start bare.
- ssh: an OpenSSH server on 127.0.0.1-3 that this module starts with its own host key and a client
  key it makes; the system's sshd and ~/.ssh are not used.
- mpiexec: Debian's Open MPI and MPICH (hydra), installed side by side.
Under PBS both "nodes" are 127.0.0.1, so placement cannot be seen: each node rank must appear once.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import cannot_run, free_port, jobgen
from tests.test_pbs_scripts import stand_in_pbs, probe_job, run_pbs_script, write_commands  # noqa: F401 (stand_in_pbs: a fixture)
from tests.test_slurm_submit import probe_job as slurm_probe_job
from tests.test_slurm_submit import node_addr, probe_records, submit_by_hand, wait_until_finished

MODULE = "jobgen-test/1.0"
# Tcl, which both module systems read. Loaded, it is in every rank's LOADEDMODULES; it refuses to
# load on the node whose rank the job sets in JOBGEN_TEST_FAIL_ON_NODE.
MODULEFILE = """#%Module1.0
if {[info exists env(JOBGEN_TEST_FAIL_ON_NODE)] && $env(JOBGEN_TEST_FAIL_ON_NODE) == $env(NODE_RANK)} {
    error "jobgen-test: not on this node"
}
"""
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
# Debian's lmod and environment-modules packages conflict: scripts/test installs Environment Modules
# into its own prefix (tests/modules/install-environment-modules.sh), as a site building it would.
ENVIRONMENT_MODULES_HOMES = (Path("/usr/share/modules"), Path("/var/tmp/jobgen-environment-modules/share/modules"))
# What a shell that set up a module system carries; none of it may leak into these jobs from the
# shell pytest runs in, or a node would use that instead of finding its own.
MODULE_SYSTEM_VARIABLES = re.compile(r"BASH_FUNC_.*|BASH_ENV|ENV|_{0,2}LMOD.*|_{0,2}MODULE.*|LOADEDMODULES|_LMFILES_|_ModuleTable.*")
MPIEXEC = {"openmpi": "/usr/bin/mpiexec.openmpi", "mpich": "/usr/bin/mpiexec.mpich"}
FAIL_NODE_1 = 'if [[ $NODE_RANK == 1 ]]; then exit 3; fi'
TWO_NODES = ["127.0.0.1", "127.0.0.1"]
# Where the test's sshd listens: three hosts of a job, all this machine (Linux routes 127/8 to lo).
SSH_ADDRESSES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture(autouse=True)
def no_module_system_from_the_test_shell(monkeypatch) -> None:
    for name in list(os.environ):
        if MODULE_SYSTEM_VARIABLES.fullmatch(name):
            monkeypatch.delenv(name)


@pytest.fixture(params=["lmod", "environment-modules"])
def module_system(request, tmp_path: Path) -> dict[str, str]:
    """What the batch script has on a site with this module system: MODULEPATH (here, with the
    test's module), and MODULESHOME where Environment Modules is not in its default place. The
    shell function `module` it does not have: every node must define it itself."""
    modulefiles = tmp_path / "modulefiles"
    (modulefiles / MODULE).parent.mkdir(parents=True)
    (modulefiles / MODULE).write_text(MODULEFILE)
    if request.param == "lmod":
        if not LMOD_INIT.exists():
            cannot_run("Lmod is not installed: apt-get install -y lmod (scripts/test does it)")
        return {"MODULEPATH": str(modulefiles)}
    home = next((home for home in ENVIRONMENT_MODULES_HOMES if (home / "init" / "bash").exists()), None)
    if home is None:
        cannot_run("Environment Modules is not installed: tests/modules/install-environment-modules.sh (scripts/test runs it)")
    return {"MODULEPATH": str(modulefiles), "MODULESHOME": str(home)}


@pytest.fixture(scope="module")
def sshd(tmp_path_factory) -> list[str]:
    """An OpenSSH server on 127.0.0.1, .2 and .3 for this module's jobs; yields the jobs' launch.ssh_options,
    an ssh config file with its port, the client key and its host key."""
    server = shutil.which("sshd") or shutil.which("sshd", path="/usr/sbin")
    if server is None or shutil.which("ssh") is None:
        cannot_run("OpenSSH is not installed: apt-get install -y openssh-server openssh-client (scripts/test does it)")
    folder = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    port = free_port()
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    known = ",".join(f"[{address}]:{port}" for address in SSH_ADDRESSES)
    (folder / "known_hosts").write_text(f"{known} {(folder / 'host_key.pub').read_text()}")
    listen = "".join(f"ListenAddress {address}\n" for address in SSH_ADDRESSES)
    (folder / "sshd_config").write_text(
        f"Port {port}\n{listen}HostKey {folder}/host_key\nAuthorizedKeysFile {folder}/authorized_keys\n"
        f"PidFile {folder}/sshd.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
    )
    (folder / "ssh_config").write_text(
        f"Host *\n  Port {port}\n  IdentityFile {folder}/client_key\n  UserKnownHostsFile {folder}/known_hosts\n"
        "  StrictHostKeyChecking yes\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    with open(folder / "sshd.log", "w") as log:
        process = subprocess.Popen([server, "-D", "-e", "-f", str(folder / "sshd_config")], stderr=log)
    deadline = time.time() + 10
    while subprocess.run(["ssh", "-F", str(folder / "ssh_config"), "-o", "BatchMode=yes", "127.0.0.1", "true"],
                         capture_output=True).returncode != 0:
        if time.time() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail(f"the test's sshd did not start: {(folder / 'sshd.log').read_text()}")
        time.sleep(0.2)
    yield ["-F", str(folder / "ssh_config")]
    process.terminate()
    process.wait(timeout=10)


@dataclass
class Mpi:
    name: str
    env: dict[str, str]  # the batch script's environment (over the fake PBS's)


@pytest.fixture(params=sorted(MPIEXEC))
def mpi(request, tmp_path: Path, stand_in_pbs: dict) -> Mpi:
    """PATH with this MPI's mpiexec first and, as root, Open MPI's consent to run as root: given by
    the test's environment, so the rendered script has nothing a real cluster would not want."""
    if not Path(MPIEXEC[request.param]).exists():
        cannot_run("Open MPI or MPICH is not installed: apt-get install -y openmpi-bin mpich (scripts/test does it)")
    bin_dir = tmp_path / f"{request.param}-bin"
    bin_dir.mkdir()
    # A script, not a link: hydra looks for its proxy beside the mpiexec it was started as.
    (bin_dir / "mpiexec").write_text(f'#!/bin/sh\nexec {MPIEXEC[request.param]} "$@"\n')
    (bin_dir / "mpiexec").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{stand_in_pbs['PATH']}"}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return Mpi(request.param, env)


def pbs_job(launcher: str, modules: tuple[str, ...] = (MODULE,), setup: tuple[str, ...] = (), **launch) -> dict:
    """A 2-node probe job for the fake PBS, each node one rank."""
    job = probe_job(2, 1)
    # A fake PBS job's derived port may be another session's job's.
    job["launch"].update(launcher=launcher, master_port=free_port(), **launch)
    job["environment"].update(modules=list(modules), setup=list(setup))
    return job


def assert_every_rank_wired_with_the_module(run_dir: Path, master_addr: str) -> None:
    records = probe_records(run_dir)
    assert sorted(record["NODE_RANK"] for record in records) == ["0", "1"], "a node rank ran twice, or not at all"
    for rank, record in enumerate(records):
        assert (record["RANK"], record["LOCAL_RANK"], record["WORLD_SIZE"], record["LOCAL_WORLD_SIZE"]) == (str(rank), "0", "2", "1")
        assert (record["NODE_RANK"], record["NNODES"], record["MASTER_ADDR"]) == (str(rank), "2", master_addr)
        assert record["all_reduce_sum"] == 3
        assert MODULE in (record["LOADEDMODULES"] or "").split(":"), f"rank {rank} runs without {MODULE}: {record}"


def batch_log(run_dir: Path) -> str:
    return jobgen("logs", str(run_dir)).stdout


def job_processes(run_dir: Path) -> list[str]:
    """Command lines of the processes of this run (node scripts, torchrun, ranks) still running."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            words = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        line = b" ".join(words).decode(errors="replace")
        if str(run_dir) in line:
            found.append(line)
    return found


def assert_no_node_outlives_the_job(run_dir: Path) -> None:
    deadline = time.time() + 10
    while job_processes(run_dir):
        assert time.time() < deadline, f"still running after the job ended: {job_processes(run_dir)}"
        time.sleep(0.2)


# --- Every rank is wired, and has the job's module ---------------------------------------------


def test_stand_in_pbs_ssh_every_rank_has_the_module(module_system: dict, sshd: list[str], tmp_path: Path, stand_in_pbs: dict) -> None:
    result = run_pbs_script(tmp_path, "pbs", pbs_job("ssh", ssh_options=sshd), TWO_NODES, {**stand_in_pbs, **module_system}, timeout=120)
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, batch_log(run_dir) + result.stdout
    assert_every_rank_wired_with_the_module(run_dir, "127.0.0.1")
    assert_no_node_outlives_the_job(run_dir)


def test_stand_in_pbs_mpiexec_every_rank_has_the_module(mpi: Mpi, module_system: dict, tmp_path: Path, stand_in_pbs: dict) -> None:
    result = run_pbs_script(tmp_path, "pbs", pbs_job("mpiexec"), TWO_NODES, {**stand_in_pbs, **module_system, **mpi.env}, timeout=120)
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, batch_log(run_dir) + result.stdout
    assert_every_rank_wired_with_the_module(run_dir, "127.0.0.1")
    # One slot per node of the job on each host, in the syntax of the MPI at hand.
    hostfile = (run_dir / f"hosts.{stand_in_pbs['PBS_JOBID']}").read_text()
    assert hostfile == {"openmpi": "127.0.0.1 slots=2\n", "mpich": "127.0.0.1:2\n"}[mpi.name]


def test_stand_in_pbs_an_mpiexec_jobgen_does_not_know_is_refused_in_one_line(tmp_path: Path, stand_in_pbs: dict) -> None:
    # Debian's slurm-wlm-torque, for one, installs Slurm's own mpiexec wrapper as `mpiexec`.
    other = write_commands(tmp_path / "otherbin", {"mpiexec": "#!/bin/sh\necho 'Unknown option: version' >&2\nexit 1\n"})
    result = run_pbs_script(tmp_path, "pbs", pbs_job("mpiexec", modules=()), TWO_NODES, {**stand_in_pbs, "PATH": f"{other}:{stand_in_pbs['PATH']}"}, timeout=60)
    assert result.returncode == 2
    run_dir = tmp_path / "runs" / "pbs-probe"
    said = [line for line in batch_log(run_dir).splitlines() if "mpiexec on PATH" in line]
    assert said == [f"jobgen: the mpiexec on PATH ({other}/mpiexec) is neither Open MPI's nor MPICH's or Intel MPI's (hydra), "
                    "which jobgen knows how to start one process per node with; 'mpiexec --version' says: Unknown option: version"]


@pytest.mark.usefixtures("slurm_cluster")
def test_srun_every_rank_has_the_module(module_system: dict, tmp_path: Path, monkeypatch) -> None:
    for name, value in module_system.items():
        monkeypatch.setenv(name, value)  # sbatch passes the submitting shell's environment on
    config = slurm_probe_job(tmp_path, "modules", 2, 1)
    job = yaml.safe_load(config.read_text())
    job["environment"] = {"modules": [MODULE]}
    config.write_text(yaml.safe_dump(job))
    job_id = submit_by_hand(config)
    run_dir = tmp_path / "runs" / "jobgen-test-modules"
    assert wait_until_finished(job_id) == "COMPLETED", batch_log(run_dir)
    assert_every_rank_wired_with_the_module(run_dir, node_addr(probe_records(run_dir)[0]["SLURMD_NODENAME"]))


HUGGING_FACE_CACHE = {"HF_HOME": "/shared/hf", "HF_HUB_CACHE": "/shared/hf/hub", "HF_HUB_OFFLINE": "1",
                      "HF_ENDPOINT": "http://127.0.0.1:9", "TRANSFORMERS_CACHE": "/shared/hf/transformers",
                      "HF_DATASETS_CACHE": "/shared/hf/datasets", "XDG_CACHE_HOME": "/shared/cache"}


def test_stand_in_pbs_ssh_nodes_get_the_hugging_face_cache_of_the_submitting_shell(sshd: list[str], tmp_path: Path, stand_in_pbs: dict) -> None:
    # What `jobgen prepare` and `validate` used (the shell's cache, offline) is what every rank
    # must use; a token is a secret, passed only when environment.secrets names it.
    (tmp_path / "scratch").mkdir()
    shell = {**HUGGING_FACE_CACHE, "TMPDIR": str(tmp_path / "scratch")}
    names = [*shell, "HF_TOKEN"]
    record = 'printf "%s\\n" ' + " ".join(f'"{name}=${{{name}-unset}}"' for name in names) + ' > "$JOBGEN_RUN_DIR/env-$NODE_RANK"'
    job = pbs_job("ssh", modules=(), setup=(record,), ssh_options=sshd)
    env = {**stand_in_pbs, **shell, "HF_TOKEN": "hf_not_for_the_nodes"}
    result = run_pbs_script(tmp_path, "pbs", job, TWO_NODES, env, timeout=120)
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert result.returncode == 0, batch_log(run_dir) + result.stdout
    for rank in (0, 1):
        seen = dict(line.split("=", 1) for line in (run_dir / f"env-{rank}").read_text().splitlines())
        assert seen == {**shell, "HF_TOKEN": "unset"}


# --- A node that fails ends the job, every node with it -----------------------------------------


def assert_the_job_failed_for_node_1(run_dir: Path, status: int) -> str:
    log = batch_log(run_dir)
    said = re.search(rf"^jobgen: node 1 \(\S+\) exited with status {status}\b", log, re.M)
    assert said, log
    assert "jobgen: training failed: the trainer left no report" in log
    return log


def test_stand_in_pbs_ssh_a_failing_node_ends_every_node(sshd: list[str], tmp_path: Path, stand_in_pbs: dict) -> None:
    job = pbs_job("ssh", modules=(), setup=(FAIL_NODE_1,), ssh_options=sshd)
    result = run_pbs_script(tmp_path, "pbs", job, TWO_NODES, stand_in_pbs, timeout=60)
    assert result.returncode == 3
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert "node 1 (127.0.0.1) exited with status 3: ending the other nodes" in assert_the_job_failed_for_node_1(run_dir, 3)
    assert_no_node_outlives_the_job(run_dir)


def test_stand_in_pbs_mpiexec_a_failing_node_ends_every_node(mpi: Mpi, tmp_path: Path, stand_in_pbs: dict) -> None:
    result = run_pbs_script(tmp_path, "pbs", pbs_job("mpiexec", modules=(), setup=(FAIL_NODE_1,)), TWO_NODES, {**stand_in_pbs, **mpi.env}, timeout=60)
    # Open MPI exits with the node's status; hydra ends every node only when one is killed (9).
    assert result.returncode == {"openmpi": 3, "mpich": 9}[mpi.name]
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert_the_job_failed_for_node_1(run_dir, 3)
    assert_no_node_outlives_the_job(run_dir)


def test_stand_in_pbs_ssh_a_module_that_does_not_load_on_one_node_ends_the_job(module_system: dict, sshd: list[str], tmp_path: Path, stand_in_pbs: dict) -> None:
    job = pbs_job("ssh", ssh_options=sshd)
    job["environment"]["variables"]["JOBGEN_TEST_FAIL_ON_NODE"] = "1"
    result = run_pbs_script(tmp_path, "pbs", job, TWO_NODES, {**stand_in_pbs, **module_system}, timeout=60)
    assert result.returncode == 1
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert_the_job_failed_for_node_1(run_dir, 1)
    node1 = jobgen("logs", str(run_dir), "--node", "1").stdout
    assert "jobgen-test: not on this node" in node1, "the module system's own message is missing"
    assert (f"jobgen: node 1 ({socket.gethostname()}): 'module load {MODULE}' failed (its message is above); check "
            f"environment.modules and MODULEPATH ({module_system['MODULEPATH']})") in node1
    assert_no_node_outlives_the_job(run_dir)


@pytest.mark.usefixtures("slurm_cluster")
def test_srun_a_failing_node_ends_the_job(tmp_path: Path) -> None:
    config = slurm_probe_job(tmp_path, "fail", 2, 1)
    job = yaml.safe_load(config.read_text())
    job["environment"] = {"setup": [FAIL_NODE_1]}
    config.write_text(yaml.safe_dump(job))
    started = time.time()
    job_id = submit_by_hand(config)
    assert wait_until_finished(job_id, timeout=60) == "FAILED"
    assert time.time() - started < 45
    log = batch_log(tmp_path / "runs" / "jobgen-test-fail")
    # srun names the node and its status, ends the others (--kill-on-bad-exit) and exits with
    # the highest status of its tasks: 143, the SIGTERM that ended node 0.
    node1 = log.split("jobgen: job ", 1)[1].split(" on ", 1)[1].split(";")[0].split()[1]  # wherever Slurm put it
    assert f"srun: error: {node1}: task 1: Exited with exit code 3" in log
    assert "jobgen: training failed: the trainer left no report (srun (every node) exited with status 143)" in log


# --- A spare node in a failed node's place, started by ssh --------------------------------------

BAD_NODE_ONCE = 'if [[ $JOBGEN_RESTART_COUNT == 0 && $NODE_RANK == 1 ]]; then exit 75; fi'  # "this node is bad"


def test_stand_in_pbs_ssh_a_failed_node_is_replaced_by_the_spare_inside_the_job(sshd: list[str], tmp_path: Path, stand_in_pbs: dict) -> None:
    """resources.spare_nodes: 1 with launch.launcher ssh: three hosts, three loopback addresses
    where the test's sshd listens. Node 1 (127.0.0.2) says it is bad (75) at the first start; the
    job goes on at once, ssh starting node 0 and the spare (127.0.0.3), whose ranks reach each other."""
    job = pbs_job("ssh", modules=(), setup=(BAD_NODE_ONCE,), ssh_options=sshd)
    job["resources"]["spare_nodes"] = 1
    result = run_pbs_script(tmp_path, "pbs", job, list(SSH_ADDRESSES), stand_in_pbs, timeout=180)
    run_dir = tmp_path / "runs" / "pbs-probe"
    log = batch_log(run_dir)
    assert result.returncode == 0, log + result.stdout
    assert "jobgen: restarting inside this allocation without node(s) 127.0.0.2 on 2 node(s)" in log, log
    assert "(restart 1) on 127.0.0.1 127.0.0.3;" in log, log
    from tests.test_failure_kinds import outcomes

    assert outcomes(run_dir) == ["node_failed", "completed"]
    records = probe_records(run_dir)
    assert [(r["NODE_RANK"], r["all_reduce_sum"]) for r in records] == [("0", 3), ("1", 3)]
    assert_no_node_outlives_the_job(run_dir)
