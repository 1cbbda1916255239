"""Training scripts of the user's own (launch.command) on the real OpenPBS server: 2 nodes x 1
rank over pbsdsh, preempted by an express-queue job, rerun by the server under the same job id and
resumed from the checkpoint saved at the stop, via launch.resume_argument. Two scripts: a Hugging
Face Trainer with JobgenCallback, and a plain torch.distributed (DDP on gloo) script that handles
SIGTERM itself. Every step is trained once, and the final loss equals the same script's
uninterrupted run on the local scheduler exactly (each resume restores the model, the optimizer
and where the data stands; the ranks, backend and data order are the same)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster.pbs_servers import PbsServer
from tests.test_pbs_servers import finished, jobgen_as, logs, status, submit, tiny, wait_for  # noqa: F401 - tiny is a fixture
from tests.test_slurm_own_command import FINETUNE

MAX_STEPS = 12

# A plain DDP training that handles SIGTERM itself: at each step's end the ranks agree on a stop
# (one all-reduce: the signal reaches them at different moments), rank 0 saves model, optimizer
# and step into checkpoint-N, COMPLETE last, and every rank exits 0. A step's batch is drawn from
# (step, rank), so a resumed run sees the batches an uninterrupted one would.
PLAIN_DDP = r'''import json, os, signal, sys, time

import torch
import torch.distributed as dist

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
dist.init_process_group("gloo")
rank, world, out = dist.get_rank(), dist.get_world_size(), sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if "--resume" in sys.argv:
    state = torch.load(os.path.join(sys.argv[sys.argv.index("--resume") + 1], "state.pt"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
for step in range(start + 1, 13):
    batch = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=batch)
    loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        with open(os.path.join(out, "steps.jsonl"), "a") as log:
            log.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
    time.sleep(float(os.environ.get("STEP_DELAY", "0")))
    asked = torch.tensor([1 if stop else 0])
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    if asked.item():
        if rank == 0:
            folder = os.path.join(out, f"checkpoint-{step}")
            os.makedirs(folder)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       os.path.join(folder, "state.pt"))
            open(os.path.join(folder, "COMPLETE"), "w").close()
            print(f"rank 0: SIGTERM: saved checkpoint-{step}", flush=True)
        dist.barrier()
        break
dist.destroy_process_group()
'''
SCRIPTS = {
    "hf-trainer": (FINETUNE, {"resume_argument": "--resume_from_checkpoint {checkpoint}"}),
    "plain-ddp": (PLAIN_DDP, {"resume_argument": "--resume {checkpoint}", "checkpoint_complete_file": "COMPLETE"}),
}


def own_job(name: str, script: str, tiny: Path, setup: list[str], step_delay: float) -> dict:
    command = ["python", "train.py", str(tiny), "out"] if script == "hf-trainer" else ["python", "train.py", "out"]
    return {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1, "command": command, "checkpoints": "out/checkpoint-*", **SCRIPTS[script][1]},
        "environment": {"setup": setup, "variables": {"STEP_DELAY": step_delay}},
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }


def logged(folder: Path) -> list[dict]:
    path = folder / "out" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def write_script(folder: Path, script: str) -> None:
    (folder / "train.py").write_text(SCRIPTS[script][0])
    (folder / "out").mkdir()


def reference_run(folder: Path, script: str, tiny: Path) -> list[dict]:
    folder.mkdir()
    write_script(folder, script)
    (folder / "job.yaml").write_text(yaml.safe_dump(own_job(f"{script}-reference", script, tiny, [], step_delay=0)))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=folder, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return logged(folder)


@pytest.mark.parametrize("script", SCRIPTS)
def test_openpbs_a_preempted_script_of_the_users_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(
        openpbs: PbsServer, tiny: Path, tmp_path: Path, script: str) -> None:
    reference = reference_run(tmp_path / "reference", script, tiny)
    assert [entry["step"] for entry in reference] == list(range(1, MAX_STEPS + 1))

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
    assert logged(folder)[-1]["loss"] == reference[-1]["loss"]
    everything = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.out"))
    assert "Traceback" not in everything, everything
    print(f"preempted at step {first['last_step']}; final loss {reference[-1]['loss']} in both")
