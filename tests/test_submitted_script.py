"""What `jobgen submit` hands to Slurm is the script `jobgen render` shows, byte for byte.

A user or admin reviews `jobgen render`; sbatch must get exactly that, whether the user runs
sbatch by hand or `jobgen submit` does it through submitit. These tests also guard the submitit
behaviour that promise rests on (sbatch gets the text submitit is handed, unchanged), so that a
submitit release that changes it fails here rather than as a wrong job on a user's cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import yaml

from tests.helpers import EXAMPLES, REPO, jobgen

# The two example profiles (one per scheduler family) stand for every site here: the archetype
# profiles are submitted on the test cluster by `jobgen sites check` in tests/test_sites.py.
SITES = [None, *sorted((REPO / "configs" / "sites").glob("example-*.yaml"))]
# A site's own directives (example-slurm-ib: --mail-type=FAIL) come with the site; these are a
# job's, which replace the site's list. The #PBS line must be dropped from a Slurm script.
JOB_DIRECTIVES = 'extra_directives=["#SBATCH --comment=reviewed-by-the-admin", "#SBATCH --mail-type=FAIL", "#PBS -m a"]'
DIRECTIVES = {"site-directives": (), "job-directives": ("--set", JOB_DIRECTIVES)}

# The venv's torchrun and jobgen-probe must be on the nodes' PATH; sbatch passes the environment.
ENV = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


@pytest.fixture
def submit_directory(tmp_path: Path) -> Path:
    """A user's submit directory, holding the files the examples name relative to it, since
    `jobgen submit` checks them first (their hub models and /datasets paths it cannot check here)."""
    conversation = [{"id": "0", "conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Hello"}]}]
    for data in ("data/conversations.json", "tiny/data.json"):
        (tmp_path / data).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / data).write_text(json.dumps(conversation))
    (tmp_path / "tiny" / "model").mkdir()
    (tmp_path / "tiny" / "model" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def job_arguments(example: Path, site: Optional[Path], directives: str) -> list[str]:
    return [*(["--site", str(site)] if site else []), *DIRECTIVES[directives], str(example)]


def header(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jobgen: error:")]


every_job = pytest.mark.parametrize(
    "example,site,directives",
    [(e, s, d) for e in EXAMPLES for s in SITES for d in DIRECTIVES],
    ids=lambda value: value.stem if isinstance(value, Path) else (value or "no-site"),
)


@every_job
def test_dry_run_shows_exactly_the_rendered_script(submit_directory: Path, example: Path, site: Optional[Path], directives: str) -> None:
    arguments = job_arguments(example, site, directives)
    rendered = jobgen("render", "-s", "slurm", *arguments, cwd=submit_directory)
    dry_run = jobgen("submit", "--dry-run", "-s", "slurm", *arguments, cwd=submit_directory)
    assert dry_run.returncode == rendered.returncode, dry_run.stderr
    if rendered.returncode:  # a site for another scheduler: submit refuses what render refuses
        assert error_lines(dry_run.stderr) == error_lines(rendered.stderr)
        return
    assert header(dry_run.stdout) == header(rendered.stdout)
    assert dry_run.stdout == rendered.stdout


@every_job
@pytest.mark.usefixtures("slurm_cluster")
def test_slurm_stores_exactly_the_rendered_script(submit_directory: Path, example: Path, site: Optional[Path], directives: str) -> None:
    arguments = job_arguments(example, site, directives)
    rendered = jobgen("render", "-s", "slurm", *arguments, cwd=submit_directory)
    # Held, so the example's fine-tune never starts; it is cancelled as soon as it is read back.
    submitted = jobgen("submit", "-s", "slurm", *arguments, cwd=submit_directory, env={**ENV, "SBATCH_HOLD": "1"})
    if rendered.returncode:
        assert submitted.returncode == rendered.returncode
        assert error_lines(submitted.stderr) == error_lines(rendered.stderr)
        return
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    try:
        stored = batch_script(job_id)
    finally:
        subprocess.run(["scancel", job_id], check=True)

    assert header(stored) == header(rendered.stdout)
    assert stored == rendered.stdout
    [run_dir] = (submit_directory / "runs").iterdir()
    assert (run_dir / "submission.txt").read_text() == stored
    # The file submitit wrote and ran sbatch on: if a submitit release stops writing our text
    # verbatim, this names the culprit.
    assert (run_dir / "submitit" / f"{job_id}_submission.sh").read_text() == rendered.stdout


def batch_script(job_id: str) -> str:
    """The script Slurm stored for the job, which is what its batch shell runs."""
    result = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.usefixtures("slurm_cluster")
def test_a_submitted_job_carries_the_directives_the_render_showed(tmp_path: Path) -> None:
    config = tmp_path / "reviewed.yaml"
    config.write_text(yaml.safe_dump({
        "name": "jobgen-test-reviewed",
        "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:05:00"},
        "launch": {"procs_per_node": 1, "entrypoint": "jobgen-probe"},
        "training": {"model": "unused", "data": "unused"},
        "extra_directives": ["#SBATCH --comment=reviewed-by-admin", "#SBATCH --mail-type=FAIL"],
    }))
    submitted = jobgen("submit", "-s", "slurm", str(config), cwd=tmp_path, env=ENV)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    fields = dict(token.split("=", 1) for token in show_job(job_id).split() if "=" in token)
    assert fields["Comment"] == "reviewed-by-admin"
    assert fields["MailType"] == "FAIL"
    # This cluster tracks no wckeys, so scontrol shows none either way; the stored script would
    # show submitit's own `--wckey=submitit`.
    assert "--wckey" not in batch_script(job_id)
    assert fields["StdOut"] == str(tmp_path / f"jobgen-test-reviewed-{job_id}.out")
    assert wait_until_finished(job_id) == "COMPLETED"
    # The batch log is where the rendered `--output=%x-%j.out` puts it: the directory sbatch ran in.
    assert "jobgen: job" in (tmp_path / f"jobgen-test-reviewed-{job_id}.out").read_text()


def show_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True).stdout


def wait_until_finished(job_id: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = next(t.split("=", 1)[1] for t in show_job(job_id).split() if t.startswith("JobState="))
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} still unfinished after {timeout} s")
