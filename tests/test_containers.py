"""Containers as fields of the job: pyxis/enroot on Slurm's srun line, Apptainer/Singularity around
each node's command. Neither runtime can be installed here, so the rendered scripts are checked
(golden files, bash -n and shellcheck, `sbatch --test-only` on the Slurm test cluster, the srun
line as text), and the Apptainer path runs for real with a stand-in `apptainer` that records its
arguments and execs the node's command without a container.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, jobgen, node_script_of, shell_findings

CONTAINER_EXAMPLES = REPO / "configs" / "examples" / "containers"
GOLDEN = REPO / "examples" / "containers"
# pyxis is a plug-in of srun: its example is for Slurm only.
CASES = [("llama-lora-pyxis", "slurm"), *[("llama-lora-apptainer", s) for s in ("slurm", "pbs", "torque")]]
SUFFIX = {"slurm": ".sbatch", "pbs": ".pbs", "torque": ".torque.pbs"}


def golden(name: str, scheduler: str) -> Path:
    return GOLDEN / f"{name}{SUFFIX[scheduler]}"


@pytest.mark.parametrize("name,scheduler", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_container_examples_match_their_golden_files_and_pass_shellcheck(
    name: str, scheduler: str, tmp_path: Path, shellcheck: str
) -> None:
    config = CONTAINER_EXAMPLES / f"{name}.yaml"
    result = jobgen("render", "-s", scheduler, str(config.relative_to(REPO)), cwd=REPO)
    assert result.returncode == 0, result.stderr
    if os.environ.get("JOBGEN_UPDATE_GOLDEN"):
        golden(name, scheduler).parent.mkdir(parents=True, exist_ok=True)
        golden(name, scheduler).write_text(result.stdout)
    assert result.stdout == golden(name, scheduler).read_text(), "regenerate with JOBGEN_UPDATE_GOLDEN=1 and review"
    batch, node = tmp_path / "job.sh", tmp_path / "node.sh"
    batch.write_text(result.stdout)
    node.write_text(node_script_of(result.stdout))
    assert shell_findings(batch, node) == ""


def test_no_stale_container_golden_files() -> None:
    assert {p.name for p in GOLDEN.iterdir()} == {golden(n, s).name for n, s in CASES}


def test_pyxis_runs_every_node_task_in_the_image_with_the_run_and_work_directories_mounted() -> None:
    script = golden("llama-lora-pyxis", "slurm").read_text()
    srun = script[script.index("\nsrun ") + 1 :]
    assert srun[: srun.index(" &\n")] == (
        "srun --nodes=\"$NNODES\" --ntasks-per-node=1 --cpus-per-task=64 --gpus-per-node=8 \\\n"
        "  --container-image='nvcr.io#nvidia/pytorch:24.05-py3' \\\n"
        "  --container-mounts=\"$JOBGEN_WORKDIR:$JOBGEN_WORKDIR,$JOBGEN_RUN_DIR:$JOBGEN_RUN_DIR\","
        "/scratch/hf-cache:/scratch/hf-cache,/datasets/conversations:/data:ro --no-container-mount-home \\\n"
        "  --kill-on-bad-exit=1 \\\n"
        "  bash -c 'exec bash \"$1\" \"$SLURM_NODEID\"' jobgen-node \"$JOBGEN_RUN_DIR/node.sh\""
    )
    # Inside the image its own PATH and Python are used: node.env does not carry the host's.
    assert "jobgen_env_names=(HOME MODULEPATH" in script and "jobgen_env_names=(PATH" not in script
    assert "apptainer" not in node_script_of(script)


def test_apptainer_wraps_each_nodes_command_on_every_launcher() -> None:
    for scheduler in ("slurm", "pbs", "torque"):
        node = node_script_of(golden("llama-lora-apptainer", scheduler).read_text())
        assert ('exec apptainer exec --nv --bind "$JOBGEN_WORKDIR,$JOBGEN_RUN_DIR",/scratch/hf-cache:/scratch/hf-cache,'
                '/datasets/conversations:/data:ro --cleanenv \\\n'
                '  /images/finetune-2024.05.sif /bin/bash "$JOBGEN_RUN_DIR/node.sh" "$NODE_RANK" in-container\n') in node
        # The module that provides apptainer loads outside the container; setup runs inside.
        assert node.index("jobgen_module_load apptainer") < node.index("exec apptainer exec")


@pytest.mark.usefixtures("slurm_cluster")
@pytest.mark.parametrize("name", ["llama-lora-pyxis", "llama-lora-apptainer"])
def test_sbatch_test_only_accepts_the_container_batch_scripts(name: str, tmp_path: Path) -> None:
    # sbatch judges the #SBATCH header; pyxis's options are on the srun line inside the script,
    # which sbatch does not read (a Slurm without pyxis would refuse them only when srun runs).
    result = subprocess.run(["sbatch", "--test-only", str(golden(name, "slurm"))], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "to start at" in result.stderr


JOB = {
    "name": "box",
    "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00"},
    "launch": {"procs_per_node": 1},
    "training": {"model": "org/model", "data": "data.json", "method": "full"},
}


@pytest.mark.parametrize("container,scheduler,message", [
    ({"runtime": "pyxis", "image": "x"}, "pbs", "'container.runtime' is pyxis, a plug-in of Slurm's srun, and this job's "
     "nodes start with pbsdsh on pbs: use container.runtime apptainer there, or submit to Slurm"),
    ({"runtime": "pyxis", "image": "x"}, "local", "'container.runtime' is pyxis, a plug-in of Slurm's srun, and this job's "
     "nodes start with local on local: use container.runtime apptainer there, or submit to Slurm"),
    ({"image": "x.sif"}, "slurm", "job.yaml: 'container.image' is 'x.sif': needs container.runtime: pyxis, apptainer "
     "or singularity (a site profile may set it)"),
    ({"runtime": "docker", "image": "x"}, "slurm", "job.yaml: 'container.runtime' is 'docker': Input should be 'pyxis', "
     "'apptainer' or 'singularity'"),
    ({"runtime": "apptainer", "image": "x", "mounts": ["data:/data"]}, "slurm", "job.yaml: 'container.mounts' is "
     "['data:/data']: 'data:/data' is not SRC:DST or SRC:DST:ro with absolute paths and no ',' (e.g. /scratch/data:/data:ro)"),
    ({"runtime": "apptainer", "image": "x", "flags": ["--nv"]}, "slurm", "job.yaml: 'container.flags' is ['--nv']: "
     "'--nv' is written by jobgen; set resources.gpus_per_node instead"),
    ({"runtime": "pyxis", "image": "x", "flags": ["--container-mounts=/a:/a"]}, "slurm", "job.yaml: 'container.flags' is "
     "['--container-mounts=/a:/a']: '--container-mounts=/a:/a' is written by jobgen; set container.mounts instead"),
], ids=["pyxis-on-pbs", "pyxis-local", "no-runtime", "unknown-runtime", "relative-mount", "own-flag-nv", "own-flag-mounts"])
def test_a_container_mistake_is_one_line_naming_the_field(tmp_path: Path, container: dict, scheduler: str, message: str) -> None:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "container": container}))
    # validate runs render's checks; as the probe, the job names no files for it to check first.
    for command in (["render"], ["validate", "--set", "launch.entrypoint=jobgen-probe"]):
        result = jobgen(*command, "-s", scheduler, "job.yaml", cwd=tmp_path)
        assert (result.returncode, result.stdout) == (2, ""), command
        assert result.stderr.splitlines() == [f"jobgen: error: {message}"], command


def test_a_site_sets_the_runtime_and_a_job_only_its_image(tmp_path: Path) -> None:
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({"defaults": {"container": {"runtime": "apptainer", "flags": ["--cleanenv"]}}}))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    plain = jobgen("render", "-s", "slurm", "--site", "site.yaml", "job.yaml", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert "apptainer exec" not in plain.stdout, "no image: no container"
    boxed = jobgen("render", "-s", "slurm", "--site", "site.yaml", "--set", "container.image=/images/a.sif", "job.yaml", cwd=tmp_path)
    assert boxed.returncode == 0, boxed.stderr
    assert 'exec apptainer exec --bind "$JOBGEN_WORKDIR,$JOBGEN_RUN_DIR" --cleanenv \\\n  /images/a.sif ' in boxed.stdout


def test_a_working_directory_a_mount_list_cannot_hold_stops_the_job_before_any_node(tmp_path: Path) -> None:
    folder = tmp_path / "co:lon"
    folder.mkdir()
    (folder / "data.json").write_text('[{"id": "a", "conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "ho"}]}]')
    (folder / "job.yaml").write_text(yaml.safe_dump({**JOB, "container": {"runtime": "apptainer", "image": "/x.sif"}}))
    result = jobgen("submit", "-s", "local", "job.yaml", cwd=folder)
    assert result.returncode != 0
    assert (f"jobgen: the working directory ({folder}) or the run directory ({folder}/runs/box) has a ',' or ':', which a "
            "container mount list cannot hold: set environment.workdir or run_dir to a path without them") in result.stderr
    assert not (folder / "runs" / "box" / "node.sh").exists(), "no node started"


# --- the Apptainer path, run for real with a stand-in -------------------------------------------

STAND_IN_APPTAINER = r"""#!/bin/bash
# A stand-in for apptainer, which cannot be installed here: it records its process id and its
# arguments (one line per call, shell-quoted), then runs the command it was given in this
# process, without a container: `exec [OPTIONS] IMAGE COMMAND...` -> exec COMMAND...
# The line goes out in one write: the two nodes' stand-ins append to the same log at once.
printf -v line '%q ' "$@"
printf '%s %s\n' "$$" "$line" >> "$STAND_IN_LOG"
[[ $1 == exec ]] || { echo "stand-in apptainer: only 'exec' is known" >&2; exit 64; }
shift
while [[ $1 == -* ]]; do
  case $1 in
    --bind | -B) shift 2 ;;
    *) shift ;;
  esac
done
shift  # the image
exec "$@"
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from jobgen.train.tiny import build

    folder = tmp_path_factory.mktemp("tiny")
    build(str(folder), conversations=16)
    return folder


def test_apptainer_stand_in_trains_two_nodes_and_a_stop_reaches_the_ranks(tmp_path: Path, tiny_model: Path) -> None:
    """Two nodes on this machine (`--scheduler local`), each entering the "container" through the
    stand-in: the ranks meet at the rendezvous and train; a stop (the time-limit signal to the
    batch script) reaches them inside through the run directory's stop file, and they checkpoint."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STAND_IN_APPTAINER)
    (bin_dir / "apptainer").chmod(0o755)
    (tmp_path / "data").mkdir()
    job = {
        "name": "boxed",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00"},
        "launch": {"procs_per_node": 1, "collective_timeout_minutes": 3},
        "container": {"runtime": "apptainer", "image": "/images/stand-in.sif",
                      "mounts": [f"{tmp_path}/data:/data:ro"], "flags": ["--writable-tmpfs"]},
        "training": {"model": str(tiny_model / "model"), "data": str(tiny_model / "data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "max_steps": 40,
                     "save_interval": 100, "lora": {"r": 4, "alpha": 8}},
        "requeue": {"warning_seconds": 60},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    log = tmp_path / "stand-in.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}", "STAND_IN_LOG": str(log),
           "JOBGEN_DEBUG_STEP_DELAY": "0.5"}
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "runs" / "boxed"
    metrics = run_dir / "output" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and any(json.loads(line)["step"] >= 1 for line in metrics.read_text().splitlines())):
        assert submit.poll() is None and time.monotonic() < deadline, submit.stdout.read() if submit.poll() is not None else "no step 1"
        time.sleep(0.2)
    # Each node is one process from its launcher to torchrun (every step an exec), so a signal
    # the scheduler sends every process of the job reaches torchrun, which passes it to the ranks.
    calls = sorted((shlex.split(line) for line in log.read_text().splitlines()), key=lambda call: call[-2])  # by rank
    for call in calls:
        assert "jobgen-torchrun" in Path(f"/proc/{call[0]}/cmdline").read_text(), call
    _, batch_pid = (run_dir / "local.pid").read_text().split()
    os.kill(int(batch_pid), signal.SIGUSR1)  # what Slurm sends before the time limit
    output, _ = submit.communicate(timeout=180)

    report = json.loads((run_dir / "trainer-exit.json").read_text())
    assert report["reason"] == "stopped", output
    assert 1 <= report["last_step"] < 40
    assert (run_dir / "output" / f"checkpoint-{report['last_step']}").is_dir() or any((run_dir / "output").glob("checkpoint*")), output
    assert "stopped (time_limit) with a complete checkpoint" in output
    # The stand-in saw each node's command: the image, the binds (the working and run directories,
    # then the job's mounts), the flags, and node.sh with the node's rank; no --nv on CPUs.
    assert [call[1:] for call in calls] == [
        ["exec", "--bind", f"{tmp_path},{run_dir},{tmp_path}/data:/data:ro", "--writable-tmpfs", "/images/stand-in.sif",
         "/bin/bash", f"{run_dir}/node.sh", str(rank), "in-container"]
        for rank in (0, 1)
    ]
