"""Goodput of a job preempted every few minutes, as `jobgen status` computes it, on the Slurm
test cluster (tests/cluster/slurm-cluster.sh start).

    python benchmarks/goodput_preempted.py [--preemptions 5] [--every 300] [--step-delay 1]

One 2-node LoRA job of the tiny model (CPU, gloo, 1 rank per node) trains until it is done; each
time a segment has held its nodes for `--every` seconds, an exclusive job in the `high` partition
preempts it on its own nodes (as tests/test_slurm_requeue.py does on all of them), `--preemptions` times. After each requeue the
job is released 3 s later (as root, `scontrol update StartTime=now`, standing in for Slurm's
~2 minute requeue delay; a job waiting in the queue holds no nodes, so it is outside goodput
either way). After the last preemption the job is cancelled instead, so every segment is one
interval long and ends by preemption (max_steps is set beyond reach).

Goodput (src/jobgen/rundir/status.py): the seconds the trainer spent in its training loop (steps and
the checkpoints saved inside it), summed over the finished segments, over the seconds those
segments held their nodes (the batch script's start line to its end line). What it leaves out:
the batch script's start, imports, process group, model load, DeepSpeed init, checkpoint load,
and after the loop the final save and the exit. JOBGEN_DEBUG_STEP_DELAY lengthens every step by
`--step-delay` seconds of sleep inside the loop: it stands in for a step's compute, without taking
the CPU from the other ranks and jobs of a small machine.

Prints `jobgen status --json`'s goodput and every segment (held seconds, training seconds,
steps, outcome, and the segment's own ratio), and the trainer's start-up breakdown per segment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from jobgen.rundir.status import _epoch  # noqa: E402


def scontrol(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def wait(condition, what: str, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := condition()):
            return value
        time.sleep(1)
    raise SystemExit(f"timed out waiting for {what}")


def status(run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "status", "--json", str(run_dir)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def tiny_work(work: Optional[Path], prefix: str) -> Path:
    """The run's folder (a new temporary one unless given) with the tiny model and its data in tiny/."""
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "jobgen.train.tiny", str(work / "tiny")], check=True, capture_output=True)
    return work


def submit_job(work: Path, job: dict, step_delay: float) -> str:
    """`jobgen submit -s slurm` of `job`, written to WORK/job.yaml, from WORK; the job id."""
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_DEBUG_STEP_DELAY": str(step_delay)}
    return subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(work / "job.yaml")],
                          cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()


def segment_starts(run_dir: Path) -> list[float]:
    path = run_dir / "segments.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [_epoch(e["started_at"]) for e in events if e.get("event") == "start"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preemptions", type=int, default=5)
    parser.add_argument("--every", type=float, default=300.0, help="seconds a segment holds its nodes before it is preempted")
    parser.add_argument("--step-delay", type=float, default=1.0)
    parser.add_argument("--work", type=Path, help="folder for the run (default: a new temporary one)")
    args = parser.parse_args()
    work = tiny_work(args.work, "jobgen-goodput-")
    steps = 100_000  # beyond reach: every segment ends by preemption
    job = {
        "name": "jobgen-bench-goodput",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "02:00:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(work / "tiny/model"), "data": str(work / "tiny/data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "max_steps": steps,
                     "save_interval": 100, "logging_interval": 10},
        "requeue": {"max_restarts": args.preemptions + 1, "warning_seconds": 30},
    }
    job_id = submit_job(work, job, args.step_delay)
    run_dir = work / "runs" / "jobgen-bench-goodput"
    print(f"job {job_id}, {steps} steps, run directory {run_dir}", flush=True)
    done = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
    for n in range(args.preemptions):
        started = wait(lambda: len(segment_starts(run_dir)) > n and segment_starts(run_dir)[n], f"segment {n + 1} to start")
        while time.time() < started + args.every and scontrol(job_id).get("JobState") not in done:
            time.sleep(1)
        if scontrol(job_id).get("JobState") in done:
            print(f"the job ended before preemption {n + 1}", flush=True)
            break
        # On this job's nodes only: the cluster's other jobs are left alone.
        nodes = scontrol(job_id)["NodeList"]
        subprocess.run(["sbatch", "-p", "high", "--exclusive", "-N2", f"--nodelist={nodes}", "--job-name=jobgen-bench-preemptor",
                        "--output=/dev/null", "--wrap", "sleep 3"], check=True, capture_output=True)
        wait(lambda: scontrol(job_id).get("JobState") == "PENDING" and int(scontrol(job_id).get("Restarts", 0)) > n, "the requeue")
        print(f"preemption {n + 1} at {time.strftime('%H:%M:%S')}", flush=True)
        if n + 1 == args.preemptions:
            subprocess.run(["scancel", job_id], check=True)
            break
        time.sleep(3)  # see tests/test_slurm_requeue.py: released at once, a start can race the old allocation's cleanup
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    state = wait(lambda: scontrol(job_id).get("JobState") in done and scontrol(job_id)["JobState"], "the end")
    report = status(run_dir)
    print(f"\njob {job_id} {state}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'seg':>3} {'outcome':<10} {'steps':>11} {'held s':>7} {'train s':>8} {'ratio':>6}  start-up (trainer's breakdown, s)")
    startups = _startups(run_dir)
    for i, s in enumerate(report["segments"]):
        held = _epoch(s["ended_at"]) - _epoch(s["started_at"]) if s["ended_at"] else float("nan")
        train = float(s["train_seconds"] or 0)
        steps_text = f"{s['first_step']}->{s['last_step']}"
        breakdown = startups[i] if i < len(startups) else {}
        text = " ".join(f"{k} {v:.1f}" for k, v in breakdown.items())
        print(f"{i + 1:>3} {s['outcome']:<10} {steps_text:>11} {held:>7.0f} {train:>8.1f} {train / held if held else 0:>6.3f}  {text}")
    print(f"\ngoodput (jobgen status): {report['goodput']}")


def _startups(run_dir: Path) -> list[dict]:
    """The trainer's start-up breakdown of each segment, from OUTPUT_DIR/startup.jsonl if it wrote one."""
    path = run_dir / "output" / "startup.jsonl"
    if not path.exists():
        return []
    return [json.loads(line).get("seconds", {}) for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    main()
