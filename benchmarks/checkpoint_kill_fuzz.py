"""SIGKILL of a whole training job at random moments of its checkpoint saves, then resume.

    PYTHONPATH=src python benchmarks/checkpoint_kill_fuzz.py [--trials 20] [--seed 0]
        [--sync] [--workdir DIR] [--json OUT.json]

A 2-rank CPU job (tiny random Llama, LoRA r 4 with dropout, ZeRO-2, fp32, 12 steps, a checkpoint
every 2 steps, background saves unless --sync) first runs uninterrupted. Then each trial, with
its own random choices (seeded):
  - the save of a random step in 4..10 is held for HOLD seconds at a random phase with
    JOBGEN_DEBUG_SAVE_PAUSE (snapshot, write: first file written and none durable, commit:
    manifest written and COMPLETE not yet), only to give the kill a window there;
  - a random delay in [0, 1.6 x HOLD) after the phase is reached (so the kill lands in the held
    phase or anywhere later: the rest of the write, the commit, the next steps), torchrun and
    every rank get SIGKILL;
  - the complete checkpoints left are listed, and the job is run again to its end.
A trial passes when the rerun resumed from the newest complete checkpoint (its trainer-exit.json
first_step), removed the killed save's temporary directory if one was left, and its final
adapter is bitwise equal to the uninterrupted run's. Prints one line per trial and a summary.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))
sys.path.insert(0, str(REPO))
from tests.processes import descendants, signal_all  # noqa: E402

HOLD = 0.5
PHASES = ("snapshot", "write", "commit")


def write_job(run_dir: Path, tiny: Path, sync: bool) -> Path:
    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    training = {
        "model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
        "per_device_batch_size": 2, "gradient_accumulation": 2, "epochs": 2, "save_interval": 2,
        "max_length": 128, "lora": {"r": 4, "alpha": 8, "dropout": 0.1}, "async_save": not sync,
        "snapshot_every": 0,  # what is fuzzed is the disk checkpoint; snapshots have their own test
    }
    job = {"name": run_dir.name, "resources": {"nodes": 1, "gpus_per_node": 0},
           "launch": {"procs_per_node": 2, "collective_timeout_minutes": 3}, "training": training}
    path = run_dir / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(job: Path, **env: str) -> subprocess.Popen:
    environment = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "-m", "jobgen.train", "--job", str(job)],
        cwd=job.parent, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )


def run_to_end(job: Path) -> str:
    proc = start(job)
    output = proc.communicate(timeout=600)[0]
    if proc.returncode != 0:
        raise SystemExit(f"run of {job} failed:\n{output}")
    return output


def kill_whole_job(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and all its descendants at once (each rank has a session of its own)."""
    signal_all(descendants([proc.pid]), signal.SIGKILL)
    proc.communicate(timeout=60)


def complete_steps(output: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (output / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())


def adapter(output: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output / "final" / "adapter_model.safetensors"))


def trial(number: int, rng: random.Random, workdir: Path, tiny: Path, reference: dict, sync: bool) -> dict:
    import torch

    step, phase, delay = rng.choice([4, 6, 8, 10]), rng.choice(PHASES), rng.uniform(0, 1.6 * HOLD)
    job = write_job(workdir / f"trial-{number:02d}", tiny, sync)
    output = job.parent / "output"
    proc = start(job, JOBGEN_DEBUG_SAVE_PAUSE=f"{phase}@{step}:{HOLD}")
    marker = output / f"debug-save-pause-{phase}-rank0"
    deadline = time.monotonic() + 300
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"trial {number}: the save of step {step} never reached {phase}:\n{proc.communicate()[0]}")
        time.sleep(0.01)
    time.sleep(delay)
    kill_whole_job(proc)
    left = complete_steps(output)
    temps = sorted(p.name for p in (output / "checkpoints").glob(".tmp-*"))
    log = run_to_end(job)
    report = json.loads((job.parent / "trainer-exit.json").read_text())
    resumed = adapter(output)
    bitwise = resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)
    newest = left[-1] if left else 0
    result = {
        "trial": number, "killed_save": step, "phase": phase, "delay_s": round(delay, 3),
        "complete_after_kill": left, "temps_after_kill": temps, "resumed_from": report["first_step"],
        "temps_removed": not temps or "removing incomplete checkpoint" in log,
        "completed": report["reason"] == "completed" and report["last_step"] == 12, "bitwise_equal": bitwise,
    }
    result["passed"] = (result["resumed_from"] == newest and result["temps_removed"] and result["completed"]
                        and bitwise)
    shutil.rmtree(job.parent, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", action="store_true", help="training.async_save: false")
    parser.add_argument("--workdir", help="keep files here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from jobgen.train.tiny import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jobgen-kill-fuzz-"))
    tiny = workdir / "tiny"
    build(str(tiny), conversations=48)
    straight = write_job(workdir / "straight", tiny, args.sync)
    run_to_end(straight)
    reference = adapter(straight.parent / "output")
    rng = random.Random(args.seed)
    results = []
    started = time.monotonic()
    for number in range(1, args.trials + 1):
        result = trial(number, rng, workdir, tiny, reference, args.sync)
        results.append(result)
        print(json.dumps(result), flush=True)
    passed = sum(r["passed"] for r in results)
    summary = {
        "command": "PYTHONPATH=src python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()],
        "trials": len(results), "passed": passed, "seconds": round(time.monotonic() - started),
        "by_phase": dict(collections.Counter(r["phase"] for r in results)),
        "killed_save_committed_before_the_kill": sum(r["killed_save"] in r["complete_after_kill"] for r in results),
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{passed} of {len(results)} trials resumed from the newest complete checkpoint and ended bitwise equal")


if __name__ == "__main__":
    main()
