"""A scheduler is one module and one template, and an installed package can add one.

tests/plugins/jobgen_shell is such a package: a `shell` scheduler that runs the job on this
machine in the background. It is installed here as an installer would (the package's folder
and a dist-info whose entry_points.txt comes from its pyproject.toml) into a folder on
PYTHONPATH, so jobgen finds it through the `jobgen.schedulers` entry-point group, and nothing
changes in the environment other tests use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jobgen.rundir import files as runfiles
from tests.helpers import REPO, install_as_pip_does, jobgen, node_script_of

PLUGIN = REPO / "tests" / "plugins" / "jobgen_shell"


def install_plugin(site: Path) -> dict[str, str]:
    """Installs the plug-in into `site`; returns the environment in which it is installed."""
    install_as_pip_does(PLUGIN, site)
    # jobgen-torchrun and jobgen-train on PATH, as an activated environment has them.
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return {"PYTHONPATH": str(site), "PATH": path}


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    return install_plugin(tmp_path_factory.mktemp("site-packages"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """DIR with model/ (a tiny random Llama) and data.json."""
    from jobgen.train.tiny import build

    folder = tmp_path_factory.mktemp("tiny")
    build(str(folder))
    return folder


def write_job(folder: Path, tiny: Path = Path("/nonexistent/tiny"), **extra) -> Path:
    """A CPU job on the tiny model; render checks no file, so other tests need none."""
    job = {
        "name": "shell-tiny",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "max_steps": 2},
        **extra,
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def segment_ends(run_dir: Path) -> list[dict]:
    path = run_dir / runfiles.SEGMENTS
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for event in map(json.loads, lines) if event["event"] == "end"]


def test_an_installed_scheduler_plugin_renders_and_runs_a_job(tmp_path: Path, plugin_env: dict[str, str], tiny: Path) -> None:
    config = write_job(tmp_path, tiny, extra_directives=["#SHELL --comment=from-the-job", "#SBATCH --mail-type=FAIL"])

    # --help lists it with the bundled schedulers.
    assert "[slurm|pbs|torque|local|shell]" in jobgen("render", "--help", env=plugin_env).stdout

    rendered = jobgen("render", "-s", "shell", str(config), "-o", str(tmp_path / "job.sh"), cwd=tmp_path, env=plugin_env)
    assert rendered.returncode == 0, rendered.stderr
    script = (tmp_path / "job.sh").read_text()
    # The header is the plug-in's, with the job's own line of its prefix (another scheduler's is left out);
    # the hosts block is its template's, reading the variables its class names.
    assert script.startswith("#!/bin/bash\n#SHELL --name=shell-tiny\n#SHELL --nodes=1\n#SHELL --comment=from-the-job\n#\n")
    assert "#SBATCH" not in script.split("\nset -eo pipefail\n")[0]
    assert "JOBGEN_JOB_ID=$SHELL_JOB_ID\n" in script and "${SHELL_SUBMIT_DIR:-$PWD}" in script

    submitted = jobgen("submit", "-s", "shell", str(config), cwd=tmp_path, env=plugin_env)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    run_dir = tmp_path / "runs" / "shell-tiny"
    assert (run_dir / "job.shell.sh").read_text() == script

    # Asked while the job runs (it takes tens of seconds): the plug-in says RUNNING, and a second
    # submission into the same run directory is refused.
    status = json.loads(jobgen("status", str(run_dir), "--json", env=plugin_env).stdout)
    assert status["scheduler_state"] == {**status["scheduler_state"], "job_id": job_id, "state": "RUNNING", "source": "/proc"}
    again = jobgen("submit", "-s", "shell", str(config), cwd=tmp_path, env=plugin_env)
    assert again.returncode == 2 and f"job {job_id} of run directory {run_dir} is still RUNNING" in again.stderr
    deadline = time.time() + 240
    while not segment_ends(run_dir):
        assert time.time() < deadline, "the job did not end within 4 minutes"
        time.sleep(1)
    # The script exits right after its last record.
    status = json.loads(jobgen("status", str(run_dir), "--json", env=plugin_env).stdout)
    while status["scheduler_state"]["state"] == "RUNNING" and time.time() < deadline:
        time.sleep(0.5)
        status = json.loads(jobgen("status", str(run_dir), "--json", env=plugin_env).stdout)
    assert status["scheduler_state"]["reason"] == "the scheduler no longer knows this job"

    log = jobgen("logs", str(run_dir), env=plugin_env).stdout
    assert [segment["outcome"] for segment in status["segments"]] == ["completed"], log
    assert status["segments"][0]["job_id"] == job_id and status["segments"][0]["last_step"] == 2
    assert "jobgen: training completed at step 2" in log
    assert (run_dir / "output" / "final" / "adapter_config.json").is_file(), sorted(p.name for p in (run_dir / "output").iterdir())


def test_a_plugin_is_loaded_only_when_chosen_and_unknown_names_list_it(tmp_path: Path, plugin_env: dict[str, str]) -> None:
    config = write_job(tmp_path)
    # A render for a bundled scheduler neither scans the entry points nor imports the plug-in.
    code = (
        "import sys; from jobgen.cli import main\n"
        f"try: main(['render', '-s', 'slurm', {str(config)!r}])\n"
        "except SystemExit: pass\n"
        "print('LOADED', sorted(m for m in ('jobgen_shell', 'importlib.metadata', 'jobgen.schedulers.pbs') if m in sys.modules), file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **plugin_env})
    assert "LOADED []" in result.stderr, result.stderr

    result = jobgen("render", "-s", "lsf", str(config), env=plugin_env)
    assert result.returncode == 2
    assert "'lsf' is not one of 'slurm', 'pbs', 'torque', 'local', 'shell' (installed plug-ins included)" in result.stderr
    # Without the package, the name is unknown.
    assert "'shell' is not one of 'slurm', 'pbs', 'torque', 'local' " in jobgen("render", "-s", "shell", str(config)).stderr


def test_a_directive_of_no_scheduler_and_a_scheduler_variable_are_refused_at_render(tmp_path: Path) -> None:
    config = write_job(tmp_path, extra_directives=["#SBTACH --mail-type=FAIL"])
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "jobgen: error: extra_directives: '#SBTACH --mail-type=FAIL' is no scheduler's directive; "
        "accepted prefixes: #SBATCH (slurm), #PBS (pbs or torque)"
    )
    config = write_job(tmp_path, environment={"variables": {"PBS_O_QUEUE": "x"}})
    assert jobgen("render", "-s", "slurm", str(config)).returncode == 0  # not Slurm's name
    result = jobgen("render", "-s", "pbs", str(config))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "jobgen: error: environment.variables: 'PBS_O_QUEUE' is set by pbs in every job and cannot be overridden; "
        "rename it (names starting PBS_ are pbs's)"
    )


RENAMED = {
    "job": "JOB.yaml", "node_script": "NODE.sh", "node_env": "NODE.env", "segments": "SEGMENTS.jsonl",
    "stop_requested": "STOP-REQUESTED", "trainer_exit": "TRAINER-EXIT.json", "logs": "LOGS",
    "continuation_script": "JOB.pbs", "continuation_errors": "QSUB.err", "hostfile_prefix": "HOSTS.",
}


@pytest.mark.parametrize("scheduler,launcher", [("slurm", "srun"), ("pbs", "pbsdsh"), ("pbs", "mpiexec"), ("torque", "ssh"), ("local", "local")])
def test_templates_take_every_run_directory_name_from_runfiles(tmp_path: Path, monkeypatch, scheduler: str, launcher: str) -> None:
    """Renamed in jobgen.rundir.files, a name is renamed in every script line: no template spells one."""
    from jobgen.job.layers import resolve_job
    from jobgen.script.render import render

    for attribute, name in RENAMED.items():
        monkeypatch.setattr(runfiles.TEMPLATE_FILES, attribute, name)
    monkeypatch.setattr(runfiles, "LOGS", "LOGS")
    job = yaml.safe_load(write_job(tmp_path, environment={"modules": ["gcc"]}).read_text())
    job["launch"]["launcher"] = launcher
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    script = render(resolve_job(tmp_path / "job.yaml"), scheduler)
    code = [line for line in (script + node_script_of(script)).splitlines() if not line.lstrip().startswith("#")]
    for old in ("job.yaml", "node.sh", "node.env", "segments.jsonl", "stop-requested", "trainer-exit.json", "/logs",
                "job.pbs", "qsub.err", "hosts."):
        assert not [line for line in code if old in line], f"{old} is spelled in a template"
    assert '"$JOBGEN_RUN_DIR/TRAINER-EXIT.json"' in script and '"$JOBGEN_RUN_DIR/LOGS/$JOBGEN_JOB_ID-node$NODE_RANK.out"' in script
