"""The rendered PBS Pro and Torque scripts, run for real on this machine with fake PBS commands.

No PBS server can be installed here (none is packaged for Debian), so only `pbsdsh` and `qsub`
are replaced, by small scripts that behave as ../shared/notes/pbs.md describes: a pbsdsh task
starts with a bare environment in $HOME, and qsub prints a job id. Everything else is real: the
batch script, the per-node script, torchrun and the ranks. Test names say "fake_pbs".
"""

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

from tests.helpers import jobgen

FAKE_PBSDSH = r"""#!/bin/bash
# pbsdsh -n K -- CMD... (PBS Pro) or pbsdsh -h HOST CMD... (Torque): runs CMD here, as a PBS task
# does: a bare environment, started in $HOME. Records each call.
echo "$*" >> "$FAKE_PBS_LOG"
while [[ $1 == -* ]]; do
  case $1 in -n|-h) shift 2 ;; --) shift; break ;; *) shift ;; esac
done
cd "$HOME" && exec env -i HOME="$HOME" PATH=/usr/bin:/bin PBS_JOBID="$PBS_JOBID" "$@"
"""

FAKE_QSUB = r"""#!/bin/bash
echo "qsub $*" >> "$FAKE_PBS_LOG"
echo "124.fakeserver"
"""


@pytest.fixture
def fake_pbs(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for name, text in (("pbsdsh", FAKE_PBSDSH), ("qsub", FAKE_QSUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_PBS_LOG": str(tmp_path / "pbs-calls.log"),
        "PBS_JOBID": "123.fakeserver",
        "HOME": str(home),
    }


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


@pytest.mark.parametrize(
    "flavour,nodefile,expected_calls",
    [
        # PBS Pro, select=2:mpiprocs=1 with both chunks on one host (vnodes sharing a host name).
        ("pbs", ["127.0.0.1", "127.0.0.1"], ["-n 0 -- /bin/bash", "-n 1 -- /bin/bash"]),
        # Torque, nodes=2:ppn=2: each host listed ppn times; one node rank per unique host.
        ("torque", ["node1", "node1", "node2", "node2"], ["-h node1 /bin/bash", "-h node2 /bin/bash"]),
    ],
)
def test_fake_pbs_every_rank_is_wired_through_pbsdsh(tmp_path: Path, fake_pbs, flavour, nodefile, expected_calls) -> None:
    result = run_pbs_script(tmp_path, flavour, probe_job(2, 2), nodefile, fake_pbs)
    assert result.returncode == 0, result.stdout + result.stderr
    calls = Path(fake_pbs["FAKE_PBS_LOG"]).read_text().splitlines()
    assert sorted(c.split(" /bin/bash")[0] + " /bin/bash" for c in calls) == expected_calls

    run_dir = tmp_path / "runs" / "pbs-probe"
    records = [json.loads((run_dir / "probe" / f"rank-{r}.json").read_text()) for r in range(4)]
    for rank, record in enumerate(records):
        assert (record["RANK"], record["LOCAL_RANK"], record["WORLD_SIZE"]) == (str(rank), str(rank % 2), "4")
        assert record["NODE_RANK"] == str(rank // 2) and record["NNODES"] == "2"
        assert record["MASTER_ADDR"] == nodefile[0]
        assert record["all_reduce_sum"] == 10
    # The task started with a bare environment: what it has came through node.env.
    env_seen = json.loads((run_dir / "probe" / "rank-3.json").read_text())
    assert env_seen["JOBGEN_JOB_ID"] == "123.fakeserver"
    assert not (run_dir / "node.env").exists()


def test_fake_pbs_a_variable_reaches_bare_pbsdsh_tasks_intact(tmp_path: Path, fake_pbs) -> None:
    job = probe_job(2, 1)
    job["environment"]["setup"] = ['printf "%s" "$GREETING" > "$JOBGEN_RUN_DIR/greeting-$NODE_RANK"']
    result = run_pbs_script(tmp_path, "pbs", job, ["127.0.0.1", "127.0.0.1"], fake_pbs)
    assert result.returncode == 0, result.stderr
    for node in (0, 1):
        assert (tmp_path / "runs" / "pbs-probe" / f"greeting-{node}").read_text() == "it's $(not run)"


def test_fake_pbs_a_nodefile_with_the_wrong_node_count_stops_with_a_clear_message(tmp_path: Path, fake_pbs) -> None:
    result = run_pbs_script(tmp_path, "pbs", probe_job(2, 1), ["127.0.0.1"], fake_pbs)
    assert result.returncode == 2
    assert "the job file asks for 2 nodes but the scheduler gave 1" in result.stderr


def test_fake_pbs_at_the_walltime_warning_the_job_checkpoints_and_submits_its_continuation(tmp_path: Path, fake_pbs) -> None:
    subprocess.run([sys.executable, "-m", "jobgen.train.tiny", str(tmp_path / "tiny")], check=True, capture_output=True)
    job = {
        "name": "pbs-walltime",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:30:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(tmp_path / "tiny/model"), "data": str(tmp_path / "tiny/data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "epochs": 5, "max_steps": 40,
                     "save_interval": 100},
        "requeue": {"warning_seconds": 60, "max_restarts": 3},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job))
    script = tmp_path / "job.pbs.sh"
    assert jobgen("render", "-s", "pbs", str(config), "-o", str(script)).returncode == 0
    # PBS has no --signal: the script's own timer sends it USR1 at walltime - warning (1740 s here).
    assert "( sleep 1740 && kill -USR1 $$ ) &" in script.read_text()
    (tmp_path / "nodefile").write_text("127.0.0.1\n127.0.0.1\n")
    env = {**os.environ, **fake_pbs, "JOBGEN_DEBUG_STEP_DELAY": "2", "PBS_NODEFILE": str(tmp_path / "nodefile"), "PBS_O_WORKDIR": str(tmp_path)}
    batch = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "runs" / "pbs-walltime"
    metrics = run_dir / "output" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and batch.poll() is None, "training never reached step 2"
        time.sleep(0.5)
    batch.send_signal(signal.SIGUSR1)  # what the timer does
    stdout, stderr = batch.communicate(timeout=240)

    assert batch.returncode == 0, stdout + stderr
    end = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()][-1]
    assert end["outcome"] == "time_limit" and 2 <= end["last_step"] < 40
    assert (run_dir / "output" / "checkpoints" / f"step-{end['last_step']:06d}" / "COMPLETE").exists()
    qsub = [c for c in Path(fake_pbs["FAKE_PBS_LOG"]).read_text().splitlines() if c.startswith("qsub")]
    assert qsub == [f"qsub -W depend=afterany:123.fakeserver -v JOBGEN_RESTART_COUNT=1 {run_dir}/job.pbs"]
    assert (run_dir / "job.pbs").read_text() == script.read_text(), "the continuation is not this same script"
    assert "continuation 124.fakeserver submitted (restart 1 of at most 3)" in stdout


def test_fake_pbs_server_reruns_count_as_restarts_and_past_max_restarts_the_job_stops(tmp_path: Path, fake_pbs) -> None:
    # A continuation (restart 1, passed by qsub -v) that the server then reruns twice under the
    # same job id, as it does after a preemption; the bound is 2 restarts.
    job = probe_job(2, 1)
    job["requeue"] = {"max_restarts": 2}
    env = {**fake_pbs, "JOBGEN_RESTART_COUNT": "1"}
    runs = [run_pbs_script(tmp_path, "pbs", job, ["127.0.0.1", "127.0.0.1"], env) for _ in range(3)]

    assert [run.returncode for run in runs] == [0, 0, 1], runs[2].stderr
    run_dir = tmp_path / "runs" / "pbs-probe"
    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["outcome"]) for e in events] == [
        ("start", 1, ""), ("end", 1, "completed"),
        ("start", 2, ""), ("end", 2, "completed"),
        ("start", 3, ""), ("end", 3, "restarts_exhausted"),
    ]
    assert "not started: this is restart 3 of the job, and requeue.max_restarts is 2" in runs[2].stderr
    # The third run started no node task: two pbsdsh calls per run, for the first two only.
    assert len(Path(fake_pbs["FAKE_PBS_LOG"]).read_text().splitlines()) == 4
    assert "restarts_exhausted" in jobgen("status", str(run_dir)).stdout
