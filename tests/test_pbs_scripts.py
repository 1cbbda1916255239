"""The rendered PBS Pro and Torque scripts with stand-in PBS commands, for what the real servers
(tests/test_pbs_servers.py) cannot show: a nodefile with the wrong number of nodes, a qsub that
refuses the continuation, and reruns past requeue.max_restarts without waiting for the server.

Only `pbsdsh`, `pbs_tmrsh` and `qsub` are replaced, by small scripts that behave as the real
servers do (a task starts with a bare environment in $HOME, qsub prints a job id, a -v on qsub's
command line replaces the script's own). Everything else is real: the batch script, the per-node
script, torchrun and the ranks. The tests and the fixture say "stand_in".
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, tiny_model
from tests.processes import descendants, signal_all

FAKE_PBSDSH = r"""#!/bin/bash
# pbsdsh -n K -- CMD... (PBS Pro) or pbsdsh -h HOST CMD... (Torque), as MoM runs a task: not a
# child of pbsdsh but a process of its own session, with a bare environment, in $HOME, its output
# in the job's spooled output (not pbsdsh's stdout). pbsdsh waits for it; a SIGTERM ends pbsdsh
# at once with status 1, whatever the task is doing. Records each call and each task's pid.
echo "$*" >> "$FAKE_PBS_LOG"
while [[ $1 == -* ]]; do
  case $1 in -n|-h) shift 2 ;; --) shift; break ;; *) shift ;; esac
done
trap 'exit 1' TERM
cd "$HOME"
setsid env -i HOME="$HOME" PATH=/usr/bin:/bin PBS_JOBID="$PBS_JOBID" "$@" >> "$FAKE_PBS_SPOOL" 2>&1 < /dev/null &
echo $! >> "$FAKE_PBS_TASKS"
wait $!
"""

# pbs_tmrsh HOST CMD...: runs CMD on HOST as MoM runs a pbsdsh task (above), refusing a host that
# is not in the job's nodefile, as PBS does; exits with the task's status. Records each call.
FAKE_PBS_TMRSH = r"""#!/bin/bash
echo "pbs_tmrsh $*" >> "$FAKE_PBS_LOG"
host=$1
shift
if ! grep -qxF "$host" "$PBS_NODEFILE"; then
  echo "pbs_tmrsh: host $host is not a node in job $PBS_JOBID" >&2
  exit 1
fi
trap 'exit 1' TERM
cd "$HOME"
setsid env -i HOME="$HOME" PATH=/usr/bin:/bin PBS_JOBID="$PBS_JOBID" "$@" >> "$FAKE_PBS_SPOOL" 2>&1 < /dev/null &
echo $! >> "$FAKE_PBS_TASKS"
wait $!
"""

# qsub as an OpenPBS server takes it: prints a job id and records, as JSON, the environment the
# new job would get. A -v on the command line replaces the script's own `#PBS -v` lines; a name
# without a value takes the value in qsub's environment.
FAKE_QSUB = r"""#!/usr/bin/env python3
import json, os, re, sys
args, passed, script = sys.argv[1:], None, sys.argv[-1]
with open(os.environ["FAKE_PBS_LOG"], "a") as log:
    log.write("qsub " + " ".join(args) + "\n")
if "-v" in args:
    passed = args[args.index("-v") + 1]
else:
    lines = [m.group(1) for m in re.finditer(r"^#PBS -v (\S+)$", open(script).read(), re.M)]
    passed = ",".join(lines)
env = {}
for item in filter(None, passed.split(",")):
    name, sep, value = item.partition("=")
    if sep or name in os.environ:
        env[name] = value if sep else os.environ[name]
with open(os.environ["FAKE_PBS_SUBMITTED"], "a") as out:
    out.write(json.dumps({"script": script, "env": env, "workdir": os.getcwd()}) + "\n")
print("124.fakeserver")
"""

# Debian's slurm-wlm-torque puts Slurm's own qsub in /usr/bin; inside a job it may come first.
SLURM_QSUB = """#!/bin/sh
echo "qsub: error: this is Slurm's qsub wrapper, not the PBS server's" >&2
exit 1
"""


def write_commands(folder: Path, commands: dict[str, str]) -> Path:
    folder.mkdir()
    for name, text in commands.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@pytest.fixture
def stand_in_pbs(tmp_path: Path):
    bin_dir = write_commands(tmp_path / "fakebin", {"pbsdsh": FAKE_PBSDSH, "pbs_tmrsh": FAKE_PBS_TMRSH, "qsub": FAKE_QSUB})
    slurm_dir = write_commands(tmp_path / "slurmbin", {"qsub": SLURM_QSUB})
    home = tmp_path / "home"
    home.mkdir()
    # A job id of its own, as a server gives: tests run side by side, and what a job derives from
    # its id (its port, its processes' JOBGEN_JOB_ID) must not be another test's.
    job_id = f"{100 + int(hashlib.sha1(str(tmp_path).encode()).hexdigest()[:8], 16) % 900000}.fakeserver"
    yield {
        "PATH": f"{slurm_dir}:{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_PBS_LOG": str(tmp_path / "pbs-calls.log"),
        "FAKE_PBS_TASKS": str(tmp_path / "pbs-tasks"),
        "FAKE_PBS_SPOOL": str(tmp_path / f"{job_id}.OU"),
        "FAKE_PBS_SUBMITTED": str(tmp_path / "qsub-submitted.jsonl"),
        "PBS_JOBID": job_id,
        "HOME": str(home),
    }
    # A failed test must not leave its tasks (and what they started) running.
    tasks = tmp_path / "pbs-tasks"
    if tasks.exists():
        signal_all(descendants([int(pid) for pid in tasks.read_text().split()]), signal.SIGKILL)


def start_pbs_job(script: Path, env: dict[str, str], nodefile: list[str], workdir: Path | None = None) -> subprocess.Popen:
    """The batch script as MoM starts it: its own session, its output in the job's spool file,
    PBS_O_WORKDIR the directory qsub ran in."""
    folder = workdir or script.parent
    (folder / "nodefile").write_text("".join(f"{host}\n" for host in nodefile))
    full_env = {**os.environ, **env, "PBS_NODEFILE": str(folder / "nodefile"), "PBS_O_WORKDIR": str(folder)}
    spool = open(env["FAKE_PBS_SPOOL"], "a")
    return subprocess.Popen(["bash", str(script)], cwd=folder, env=full_env, stdout=spool, stderr=subprocess.STDOUT,
                            start_new_session=True)


def run_pbs_script(tmp_path: Path, flavour: str, job: dict, nodefile: list[str], env: dict[str, str], timeout: int = 240):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    script = tmp_path / f"job.{flavour}.sh"
    assert jobgen("render", "-s", flavour, str(config), "-o", str(script)).returncode == 0
    (tmp_path / "nodefile").write_text("".join(f"{host}\n" for host in nodefile))
    full_env = {**os.environ, **env, "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path)}
    return subprocess.run(["bash", str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=timeout)


def probe_job(nodes: int, procs: int) -> dict:
    return {
        "name": "pbs-probe",
        "resources": {"nodes": nodes, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": procs, "entrypoint": "jobgen-probe"},
        "environment": {"variables": {"GREETING": "it's $(not run)"}},
        "training": {"model": "unused", "data": "unused"},
    }


def test_stand_in_pbs_a_nodefile_with_the_wrong_node_count_stops_with_a_clear_message(tmp_path: Path, stand_in_pbs) -> None:
    result = run_pbs_script(tmp_path, "pbs", probe_job(2, 1), ["127.0.0.1"], stand_in_pbs)
    assert result.returncode == 2
    message = "the job file asks for 2 nodes but the scheduler gave 1"
    assert message in result.stdout
    # The batch log is also in the run directory, where `jobgen logs` finds it.
    assert message in jobgen("logs", str(tmp_path / "runs" / "pbs-probe")).stdout


def test_stand_in_torque_nodes_packed_onto_one_host_are_refused_with_the_reason(tmp_path: Path, stand_in_pbs) -> None:
    # A scheduler without exact node matching gives nodes=2:ppn=4 as 8 cores of one host: two
    # "nodes" would start on one machine and fight for its GPUs. The header asks Moab for exact
    # matching; a job packed anyway stops before it starts anything.
    job = probe_job(2, 4)
    header = jobgen("render", "-s", "torque", str(write_yaml(tmp_path / "header.yaml", job))).stdout
    assert "#PBS -W x=nmatchpolicy:exactnode" in header.splitlines()
    result = run_pbs_script(tmp_path, "torque", job, ["tq0"] * 8, stand_in_pbs)
    assert result.returncode == 2
    said = [line for line in jobgen("logs", str(tmp_path / "runs" / "pbs-probe")).stdout.splitlines() if line.startswith("jobgen: ")]
    assert said[-2:] == [
        "jobgen: the job file asks for 2 nodes but the scheduler gave 1 (tq0)",
        "jobgen: the node file lists tq0 x8: the scheduler packed the job's nodes onto fewer hosts. Moab honours the "
        "header's -W x=nmatchpolicy:exactnode; under Maui the site sets JOBNODEMATCHPOLICY EXACTNODE in maui.cfg",
    ]
    assert not (tmp_path / "runs" / "pbs-probe" / "probe").exists()


def test_torque_asks_for_exact_node_matching_only_for_several_nodes(tmp_path: Path) -> None:
    one_node = jobgen("render", "-s", "torque", str(write_yaml(tmp_path / "one.yaml", probe_job(1, 4)))).stdout
    assert "#PBS -W x=nmatchpolicy:exactnode" not in one_node.splitlines() and "#PBS -l nodes=1:ppn=4" in one_node


def write_yaml(path: Path, job: dict) -> Path:
    path.write_text(yaml.safe_dump(job))
    return path


def lora_job(tmp_path: Path, name: str, **requeue) -> dict:
    tiny_model(tmp_path / "tiny")
    return {
        "name": name,
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:30:00"},
        "launch": {"procs_per_node": 1},
        "environment": {"secrets": ["JOBGEN_TEST_TOKEN"]},
        "training": {"model": str(tmp_path / "tiny/model"), "data": str(tmp_path / "tiny/data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "epochs": 5, "max_steps": 12,
                     "save_interval": 100},
        "requeue": {"warning_seconds": 60, "max_restarts": 3, **requeue},
    }


def render_to(tmp_path: Path, job: dict) -> Path:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    script = tmp_path / "job.pbs.sh"
    assert jobgen("render", "-s", "pbs", str(config), "-o", str(script)).returncode == 0
    return script


def wait_for_step(run_dir: Path, step: int, batch: subprocess.Popen, timeout: float = 240) -> None:
    metrics = run_dir / "output" / "metrics.jsonl"
    deadline = time.time() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert time.time() < deadline and batch.poll() is None, f"training never reached step {step}"
        time.sleep(0.5)


def segments(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]


def test_stand_in_pbs_a_continuation_qsub_refuses_says_why_in_one_line(tmp_path: Path, stand_in_pbs) -> None:
    refusing = write_commands(tmp_path / "pbsexec", {"qsub": "#!/bin/sh\necho 'qsub: Job violates queue and/or server resource limits' >&2\nexit 38\n"})
    (tmp_path / "pbs.conf").write_text(f"PBS_SERVER=fakeserver\nPBS_EXEC={refusing.parent}/pbsexec-root\n")
    (tmp_path / "pbsexec-root").mkdir()
    (tmp_path / "pbsexec-root" / "bin").symlink_to(refusing)
    job = lora_job(tmp_path, "pbs-refused")
    job["training"]["max_steps"] = 40
    script = render_to(tmp_path, job)
    env = {**stand_in_pbs, "JOBGEN_DEBUG_STEP_DELAY": "1", "JOBGEN_TEST_TOKEN": "x", "PBS_CONF_FILE": str(tmp_path / "pbs.conf")}
    batch = start_pbs_job(script, env, ["127.0.0.1", "127.0.0.1"])
    run_dir = tmp_path / "runs" / "pbs-refused"
    wait_for_step(run_dir, 1, batch)
    batch.send_signal(signal.SIGUSR1)
    assert batch.wait(timeout=240) == 1
    said = [line for line in jobgen("logs", str(run_dir)).stdout.splitlines() if "could not submit" in line]
    assert said == [f"jobgen: could not submit the continuation with {tmp_path}/pbsexec-root/bin/qsub: qsub: Job violates "
                    f"queue and/or server resource limits; submit the job again to resume from step {segments(run_dir)[-1]['last_step']}"]


def test_stand_in_pbs_server_reruns_count_as_restarts_and_past_max_restarts_the_job_stops(tmp_path: Path, stand_in_pbs) -> None:
    # A continuation (restart 1, passed by qsub -v) that the server then reruns twice under the
    # same job id, as it does after a preemption; the bound is 2 restarts.
    job = probe_job(2, 1)
    job["requeue"] = {"max_restarts": 2}
    env = {**stand_in_pbs, "JOBGEN_RESTART_COUNT": "1"}
    runs = [run_pbs_script(tmp_path, "pbs", job, ["127.0.0.1", "127.0.0.1"], env) for _ in range(3)]

    assert [run.returncode for run in runs] == [0, 0, 1], runs[2].stdout
    run_dir = tmp_path / "runs" / "pbs-probe"
    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["outcome"]) for e in events] == [
        ("start", 1, ""), ("end", 1, "completed"),
        ("start", 2, ""), ("end", 2, "completed"),
        ("start", 3, ""), ("end", 3, "restarts_exhausted"),
    ]
    assert "not started: this is restart 3 of the job, and requeue.max_restarts is 2" in runs[2].stdout
    # The third run started no node task: two pbsdsh calls per run, for the first two only.
    assert len(Path(stand_in_pbs["FAKE_PBS_LOG"]).read_text().splitlines()) == 4
    assert "restarts_exhausted" in jobgen("status", str(run_dir)).stdout


@pytest.mark.parametrize("flavour,nodefile", [("pbs", ["127.0.0.1", "127.0.0.1"]), ("torque", ["127.0.0.1", "localhost"])])
def test_stand_in_pbs_jobgens_own_variables_reach_every_node_without_the_script_naming_them(
    tmp_path: Path, flavour: str, nodefile: list[str], stand_in_pbs
) -> None:
    # pbsdsh starts each node's task in a bare environment: a variable of the batch shell gets
    # there only through node.env. The trainer's testing aid reaches every node as jobgen's own
    # variables do, and no rendered script names it for a reviewing admin to ask about.
    job = probe_job(2, 1)
    job["environment"]["setup"] = ['echo "${JOBGEN_DEBUG_STEP_DELAY:-unset}" > "$JOBGEN_RUN_DIR/delay-$NODE_RANK"']
    # A job id of its own, chosen here: the test reads the port that follows from it.
    job_id = {"pbs": "4711.fakeserver", "torque": "4712.fakeserver"}[flavour]
    env = {**stand_in_pbs, "PBS_JOBID": job_id, "JOBGEN_DEBUG_STEP_DELAY": "0.25"}
    result = run_pbs_script(tmp_path, flavour, job, nodefile, env)
    assert result.returncode == 0, result.stdout
    run_dir = tmp_path / "runs" / "pbs-probe"
    assert [(run_dir / f"delay-{node}").read_text() for node in (0, 1)] == ["0.25\n", "0.25\n"]
    script = (tmp_path / f"job.{flavour}.sh").read_text()
    assert [line for line in script.splitlines() if "JOBGEN_DEBUG" in line and "delay-$NODE_RANK" not in line] == []


def script_functions(script: str, *names: str) -> str:
    """The shell functions `names` as the rendered script defines them, to be run on their own. The
    last definition: a scheduler's hosts block redefines job.sh's no-op ones."""
    return "\n".join(script[script.rindex(f"\n{name}() {{") + 1:].split("\n}\n", 1)[0] + "\n}" for name in names)


@pytest.mark.parametrize("scheduler", ["pbs", "torque"])
def test_stand_in_pbsnodes_the_mother_superior_is_never_gone_on_the_servers_word(tmp_path: Path, scheduler: str) -> None:
    """The batch script runs on the mother superior (the node file's first host): a server that
    shows it down is wrong (its MoM, busy with a lost sister, missed its reports; seen on Torque),
    and taking its word ended a healthy restart and excluded the script's own host. A stand-in
    pbsnodes shows every node down; the script's own look at it names the others only."""
    job = {**probe_job(3, 1), "name": "own-host", "resources": {"nodes": 2, "spare_nodes": 1, "gpus_per_node": 0}}
    script = jobgen("render", "-s", scheduler, str(write_yaml(tmp_path / "job.yaml", job))).stdout
    functions = script_functions(script, "jobgen_pbs_command", "jobgen_nodes_gone")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pbsdsh").write_text("#!/bin/sh\n")
    (bin_dir / "pbsnodes").write_text("#!/bin/sh\nfor n in node1 node2 node3; do printf '%s\\n     state = down\\n\\n' \"$n\"; done\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (tmp_path / "nodefile").write_text("node1.cluster\nnode2.cluster\nnode3.cluster\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PBS_NODEFILE": str(tmp_path / "nodefile"),
           "PBS_CONF_FILE": str(tmp_path / "none")}
    gone = subprocess.run(["bash", "-c", f"{functions}\njobgen_nodes_gone node1.cluster node2.cluster node3.cluster"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert (gone.returncode, gone.stdout.split()) == (0, ["node2.cluster", "node3.cluster"]), gone.stderr


def test_a_node_in_its_start_up_whose_supervisor_writes_is_not_silent_to_the_batch_script(tmp_path: Path) -> None:
    """The batch script of a job with spares takes a node the server shows down for gone once its
    supervisor has said nothing for 30 s. Before its ranks start a node has no summary; its
    supervisor rewrites node-K.starting instead, so a node the server wrongly shows down (a MoM
    that missed its reports, seen on Torque) is not ended in its start-up. The script's own
    function, looked at as its loop does, about 10 s apart (bash's SECONDS set; no look within a
    second of a 30 s mark, since SECONDS counts whole seconds of the wall clock): node 0 publishes
    summaries, node 1 only its start-up file, node 2 nothing; then node 1 falls silent too."""
    job = {**probe_job(3, 1), "name": "silence", "resources": {"nodes": 3, "spare_nodes": 1, "gpus_per_node": 0}}
    script = jobgen("render", "-s", "torque", str(write_yaml(tmp_path / "job.yaml", job))).stdout
    functions = script_functions(script, "jobgen_part_ended", "jobgen_look_at_summaries")
    folder = tmp_path / "run" / "heartbeat"
    folder.mkdir(parents=True)
    looks = f"""
set -eo pipefail
{functions}
JOBGEN_RUN_DIR={tmp_path / "run"}
jobgen_watched=(host1 host2 host3) jobgen_launched_host=() jobgen_launched_exit=()
jobgen_summary_seen=() jobgen_summary_since=() jobgen_silent=()
for t in 0 10 20 32 45; do
  SECONDS=$t
  echo "$t" > {folder}/node-0.json
  echo "$t" > {folder}/node-1.starting
  jobgen_look_at_summaries
  echo "$t: ${{jobgen_silent[*]}}"
done
for t in 55 65 80; do
  SECONDS=$t
  echo "$t" > {folder}/node-0.json
  jobgen_look_at_summaries
  echo "$t: ${{jobgen_silent[*]}}"
done
"""
    result = subprocess.run(["bash", "-c", looks], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["0: ", "10: ", "20: ", "32: host3", "45: host3", "55: host3", "65: host3",
                                          "80: host2 host3"], result.stdout
