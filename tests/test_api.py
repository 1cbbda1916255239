"""The Python API (jobgen.Job, jobgen.Run): the same resolution, checks and script as the command
line, typed errors naming the fields, and docs/python-api.md's examples run as written."""

from __future__ import annotations

import doctest
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jobgen
from tests.helpers import EXAMPLES, REPO, jobgen as jobgen_command

CONVERSATIONS = "".join(
    json.dumps({"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
    for i in range(10)
)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch) -> Path:
    """A folder holding a job file from a recipe and its data, as a newcomer's would."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "conversations.jsonl").write_text(CONVERSATIONS)
    shutil.copy(REPO / "configs" / "recipes" / "qwen2.5-7b-lora.yaml", tmp_path / "job.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("config", EXAMPLES[:2], ids=lambda path: path.stem)
def test_render_is_the_text_jobgen_render_prints(config: Path) -> None:
    printed = jobgen_command("render", "-s", "slurm", "--site", "none", str(config.relative_to(REPO)), cwd=REPO)
    assert printed.returncode == 0, printed.stderr
    cwd = os.getcwd()
    os.chdir(REPO)  # the job's relative paths are the command's, read from where it runs
    try:
        assert jobgen.Job.load(config.relative_to(REPO), site="none").render(scheduler="slurm") == printed.stdout
    finally:
        os.chdir(cwd)


def test_validate_returns_what_the_command_prints_as_warnings(workdir: Path) -> None:
    job = jobgen.Job.load("job.yaml", site="none", overrides=["resources.gpus_per_node=2"])
    warnings = job.validate(scheduler="slurm")
    assert warnings[0] == ("global batch 16 (per-device 4 x 2 processes x accumulation 2) is outside 64-256, "
                           "the usual range for LoRA fine-tunes")
    # A global batch given outright: its accumulation follows from it, and the line says so.
    given = jobgen.Job.load("job.yaml", site="none", overrides=["training.global_batch_size=48",
                                                                 "training.gradient_accumulation=8"])
    assert given.warnings[0] == ("global batch 48 (training.global_batch_size, split over 8 processes in micro-batches "
                                 "of at most 4) is outside 64-256, the usual range for LoRA fine-tunes")
    printed = jobgen_command("validate", "-s", "slurm", "--site", "none", "--set", "resources.gpus_per_node=2", "job.yaml", cwd=workdir)
    assert printed.returncode == 0, printed.stderr
    assert printed.stderr.splitlines() == [f"jobgen: warning: {warning}" for warning in warnings]
    assert printed.stdout == f"job.yaml: ok: {job.describe()}; checked for slurm\n{job.describe_requeue()}\n"


def test_a_missing_data_file_is_a_jobgen_error_naming_the_field(workdir: Path) -> None:
    job = jobgen.Job.load("job.yaml", site="none", overrides={"training.data": "data/missing.jsonl"})
    with pytest.raises(jobgen.JobgenError, match=r"^training.data: file '.*/data/missing.jsonl' does not exist"):
        job.validate()
    assert job.validate(files=False) == job.warnings  # the models' checks alone pass


def test_a_refused_value_names_its_field_in_the_error_and_in_fields() -> None:
    with pytest.raises(jobgen.InvalidJob) as refused:
        jobgen.Job.from_values({"resources": {"nodes": 0}, "training": {"model": "m", "data": "d", "methd": "lora"}}, site="none")
    assert refused.value.fields == ("resources.nodes", "training.methd")
    first, second = str(refused.value).splitlines()
    assert first.startswith("<values>: 'resources.nodes' is 0: ")
    assert second.startswith("<values>: unknown key 'training.methd' (did you mean 'method'?); known keys here: ")
    assert isinstance(refused.value, jobgen.JobgenError)


def test_python_values_and_paths_are_taken_as_a_job_file_gives_them(tmp_path: Path) -> None:
    job = jobgen.Job.from_values(
        {"resources": {"nodes": 2, "time_limit": "12:00:00"}, "launch": {"procs_per_node": 1},
         "training": {"model": tmp_path / "model", "data": (tmp_path / "data.jsonl"), "lora": {"target_modules": ("q_proj",)}}},
        site="none", overrides={"resources.time_limit": "24:00:00", "training.lora.r": 8})
    assert job.spec.training.model == str(tmp_path / "model")
    assert job.spec.training.lora.target_modules == ["q_proj"] and job.spec.training.lora.r == 8
    assert job.spec.resources.time_limit == "24:00:00"  # text, not YAML's base-60 number
    with pytest.raises(jobgen.InvalidJob, match=r"^overrides\['training.seed'\]: object is not a job file's value"):
        jobgen.Job.from_values({}, overrides={"training.seed": object()})


def test_python_values_that_drop_a_site_profiles_list_items_say_so_as_a_job_file_does(tmp_path: Path) -> None:
    profile = tmp_path / "testsite.yaml"
    profile.write_text(json.dumps({"description": "A test site.", "scheduler": "slurm",
                                   "defaults": {"environment": {"modules": ["cuda/12.4", "nccl/2.21"]}}}))
    values = {"resources": {"nodes": 2, "time_limit": "01:00:00"}, "launch": {"command": ["python", "train.py"], "procs_per_node": 1}}
    job = jobgen.Job.from_values({**values, "environment": {"modules": ["cuda/12.4", "gcc/13"]}}, site=str(profile))
    assert [line for line in job.warnings if "replaces" in line] == [
        f"environment.modules in <values> replaces the site profile's list ({profile}), dropping nccl/2.21: lists are "
        "not merged; add it to environment.modules in <values> to keep it"]
    kept = jobgen.Job.from_values({**values, "environment": {"modules": ["nccl/2.21", "cuda/12.4"]}}, site=str(profile))
    assert not [line for line in kept.warnings if "replaces" in line]


def test_no_scheduler_is_one_line_saying_what_to_pass() -> None:
    job = jobgen.Job.from_values({"launch": {"procs_per_node": 1}, "training": {"model": "m", "data": "d"}}, site="none")
    with pytest.raises(jobgen.InvalidJob, match=r"^no scheduler: pass scheduler= \(.*slurm.*\), or use a site profile"):
        job.render()


def printed_by(code: str, folder: Path) -> dict:
    """The JSON that `code`, run by a new Python in `folder` with jobgen's commands on PATH, prints last."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_submit_returns_a_run_whose_status_and_cancel_read_the_run_directory(tmp_path: Path) -> None:
    # A program of the job's own, on the local scheduler: a real submission, a second of work.
    code = (
        "import json, jobgen\n"
        "job = jobgen.Job.from_values({'name': 'api-run', 'resources': {'nodes': 1, 'time_limit': '00:05:00'},\n"
        "    'launch': {'procs_per_node': 1, 'command': ['python', '-c', 'print(\"trained\")']}}, site='none')\n"
        "run = job.submit(scheduler='local')\n"
        "again = jobgen.Run.open(run.run_dir)\n"
        "report = run.status()\n"
        "print(json.dumps({'run': [run.job_id, str(run.run_dir), run.scheduler], 'again': [again.job_id, str(again.run_dir)],\n"
        "    'state': run.state, 'segments': [s['outcome'] for s in report['segments']], 'cancelled': run.cancel()}))\n"
    )
    found = printed_by(code, tmp_path)
    run_dir = str(tmp_path / "runs" / "api-run")
    assert found["run"][1:] == [run_dir, "local"] and found["again"] == [found["run"][0], run_dir]
    assert found == {**found, "state": "completed", "segments": ["completed"], "cancelled": False}
    assert "trained" in (tmp_path / "runs" / "api-run" / "logs" / f"{found['run'][0]}-node0.out").read_text()


def test_wait_returns_how_a_run_ended_and_raises_when_it_did_not_complete(tmp_path: Path) -> None:
    # Two programs of the job's own on the local scheduler: one that completes, one that fails.
    code = (
        "import json, jobgen\n"
        "def job(name, status):\n"
        "    return jobgen.Job.from_values({'name': name, 'resources': {'nodes': 1, 'time_limit': '00:05:00'},\n"
        "        'launch': {'procs_per_node': 1, 'command': ['python', '-c', f'raise SystemExit({status})']}}, site='none')\n"
        "done = job('fine', 0).submit(scheduler='local')\n"
        "failed = job('broken', 3).submit(scheduler='local')\n"
        "try:\n"
        "    failed.wait(poll_seconds=0.1)\n"
        "    raised = None\n"
        "except jobgen.RunFailed as error:\n"
        "    raised = [error.state, str(error)]\n"
        "print(json.dumps({'done': done.wait(poll_seconds=0.1), 'state': failed.state, 'status': failed.status()['state'],\n"
        "    'unchecked': failed.wait(check=False), 'raised': raised}))\n"
    )
    found = printed_by(code, tmp_path)
    run_dir = tmp_path / "runs" / "broken"
    assert found == {"done": "completed", "state": "failed", "status": "failed", "unchecked": "failed",
                     "raised": ["failed", f"job {found['raised'][1].split()[1]} ({run_dir}) ended failed: "
                                          f"`jobgen status {run_dir}` says why"]}


def test_the_python_api_page_runs_as_written(workdir: Path) -> None:
    failures, tried = doctest.testfile(str(REPO / "docs" / "python-api.md"), module_relative=False,
                                       optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert tried >= 8 and failures == 0
