"""Training scripts of the user's own (launch.command) on the real OpenPBS server: 2 nodes x 1
rank over pbsdsh, preempted by an express-queue job, rerun by the server under the same job id and
resumed from the checkpoint saved at the stop, via launch.resume_argument. Two scripts: a Hugging
Face Trainer with JobgenCallback, and a plain torch.distributed (DDP on gloo) script that handles
SIGTERM itself. Every step is trained once, and the final loss equals the same script's
uninterrupted run on the local scheduler exactly (each resume restores the model, the optimizer
and where the data stands; the ranks, backend and data order are the same)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.cluster.pbs_servers import PbsServer
from tests.test_pbs_servers import finished, logs, status, submit, tiny, wait_for  # noqa: F401 - tiny is a fixture
from tests.own_scripts import SCRIPTS, command, logged, write_script

MAX_STEPS = 12


def own_job(name: str, script: str, tiny: Path, setup: list[str], step_delay: float) -> dict:
    return {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1, "command": command(script, tiny), "checkpoints": "out/checkpoint-*", **SCRIPTS[script][1]},
        "environment": {"setup": setup, "variables": {"STEP_DELAY": step_delay}},
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }


def start_reference_run(folder: Path, script: str, tiny: Path) -> Callable[[], list[dict]]:
    """The script's uninterrupted run on the local scheduler, started now beside the server's job
    (a worker's minute less of waiting); returns what waits for it and gives its logged steps."""
    folder.mkdir()
    write_script(folder, script)
    (folder / "job.yaml").write_text(yaml.safe_dump(own_job(f"{script}-reference", script, tiny, [], step_delay=0)))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    running = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=folder, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def ended() -> list[dict]:
        said, _ = running.communicate(timeout=600)
        assert running.returncode == 0, said
        return logged(folder)
    return ended


@pytest.mark.parametrize("script", SCRIPTS)
def test_openpbs_a_preempted_script_of_the_users_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(
        openpbs: PbsServer, tiny: Path, tmp_path: Path, script: str) -> None:
    reference_ended = start_reference_run(tmp_path / "reference", script, tiny)
    folder = openpbs.folder(f"{script}-preempt")
    write_script(folder, script)
    shutil.chown(folder / "out", openpbs.user, openpbs.user)
    job = own_job(f"{script}-preempt", script, tiny, [f"source {openpbs.venv}/bin/activate"], step_delay=2)
    job_id = submit(openpbs, folder, job, "jobgen-submit")
    run_dir = folder / "runs" / job["name"]
    wait_for(lambda: any(entry["step"] >= 3 for entry in logged(folder)), "step 3", timeout=300)
    # It needs every CPU of every vnode: the scheduler requeues the workq job to run it.
    preemptor = subprocess.run([str(openpbs.bin / "qsub"), "-q", openpbs.express_queue, "-N", "jobgen-test-preemptor",
                                "-l", "select=4:ncpus=4", "-j", "oe", "-o", "/dev/null", "--", "/bin/sleep", "3"],
                               cwd=folder, capture_output=True, text=True, env={**os.environ, "PATH": f"{openpbs.bin}:/usr/bin:/bin"})
    assert preemptor.returncode == 0, preemptor.stderr
    fields = finished(openpbs, job_id)
    log = logs(openpbs, folder, run_dir)
    assert (fields["Exit_status"], fields["run_count"]) == ("0", "2"), log

    first, second = status(openpbs, folder, job_id)["segments"]
    assert first["outcome"] == "preempted" and second["outcome"] == "completed", (first, second, log)
    # Saved at the stop (checkpoint-N), and the rerun resumed from it: no step lost, none twice.
    assert second["first_step"] == first["last_step"] >= 3, (first, second)
    assert f"resuming from {folder}/out/checkpoint-{first['last_step']} (launch.resume_argument)" in log
    steps = [entry["step"] for entry in logged(folder)]
    assert steps == list(range(1, MAX_STEPS + 1)), steps
    reference = reference_ended()
    assert [entry["step"] for entry in reference] == list(range(1, MAX_STEPS + 1))
    assert logged(folder)[-1]["loss"] == reference[-1]["loss"]
    everything = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.out"))
    assert "Traceback" not in everything, everything
    print(f"preempted at step {first['last_step']}; final loss {reference[-1]['loss']} in both")
