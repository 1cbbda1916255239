"""No false hang: a 2-node job trains for `--minutes` with saves, evaluation and metrics every step,
beside `--hogs` CPU-bound processes, on the Slurm test cluster (tests/cluster/slurm-cluster.sh start).

    python benchmarks/hang_soak.py [--minutes 30] [--hogs 2] [--step-delay 0]

The hang supervisor's quick bound (10 s in steady training, docs/exit-codes.md "The hang bound")
must not end a healthy job: a slow step under load, a checkpoint written in the background, an
evaluation or rank 0's metrics must not be taken for a hang. The job (LoRA of the tiny model, CPU,
gloo, 1 rank per node) saves every `--save-interval` steps (in the background, the default) and
evaluates every `--eval-interval`; it is cancelled after `--minutes`. Every 5 s the script reads
the nodes' published summaries (RUN_DIR/heartbeat/node-K.json: the bound an aggregating node
applied and its ranks' longest recent pause) and the load average.

Prints the steps trained, whether RUN_DIR/hang.json was written (a false hang: the script exits
with 1), the bounds applied (how often each, and the smallest), the longest pause seen against
the bound in force, and the load average's median and maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from goodput_preempted import scontrol, submit_job, tiny_work, wait  # noqa: E402

HOG = "while True: pass"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside the job, for load")
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--save-interval", type=int, default=50)
    parser.add_argument("--eval-interval", type=int, default=20)
    parser.add_argument("--work", type=Path, help="folder for the run (default: a new temporary one)")
    args = parser.parse_args()
    work = tiny_work(args.work, "jobgen-soak-")
    limit = int(args.minutes) + 15
    job = {
        "name": "jobgen-bench-soak",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": f"{limit // 60:02d}:{limit % 60:02d}:00",
                      "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(work / "tiny/model"), "data": str(work / "tiny/data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "max_steps": 1_000_000,
                     "save_interval": args.save_interval, "eval_fraction": 0.1, "eval_interval": args.eval_interval,
                     "logging_interval": 1},
        "requeue": {"max_restarts": 0, "warning_seconds": 30},
    }
    job_id = submit_job(work, job, args.step_delay)
    run_dir = work / "runs" / "jobgen-bench-soak"
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    print(f"job {job_id}, run directory {run_dir}, {args.hogs} CPU hogs beside it", flush=True)
    bounds: Counter = Counter()
    pauses_against: list[tuple[float, float]] = []  # (longest pause, bound in force)
    loads: list[float] = []
    done = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
    try:
        wait(lambda: scontrol(job_id).get("JobState") == "RUNNING", "the job to start", 900)
        ends = time.time() + args.minutes * 60
        while time.time() < ends and scontrol(job_id).get("JobState") not in done and not (run_dir / "hang.json").exists():
            summaries = []
            for path in (run_dir / "heartbeat").glob("node-*.json"):
                try:
                    summaries.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    pass
            for node in summaries:
                if node.get("bound") is not None:
                    bounds[node["bound"]] += 1
                    longest = max((n.get("longest_pause") or 0.0) for n in summaries)
                    pauses_against.append((longest, node["bound"]))
            loads.append(os.getloadavg()[0])
            time.sleep(5)
    finally:
        for hog in hogs:
            hog.kill()
        subprocess.run(["scancel", job_id], capture_output=True)
    state = wait(lambda: scontrol(job_id).get("JobState") in done and scontrol(job_id)["JobState"], "the end")
    metrics = run_dir / "output" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = max((r["step"] for r in records), default=0)
    evals = sum(1 for r in records if "eval_loss" in r)
    hung = run_dir / "hang.json"
    print(f"\njob {job_id} {state} after {args.minutes:g} min; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"steps trained: {steps} ({evals} evaluations, a save every {args.save_interval} steps)")
    print(f"false hang: {'YES: ' + json.loads(hung.read_text())['message'] if hung.exists() else 'none'}")
    if bounds:
        print("bounds applied (s: times seen): " + ", ".join(f"{b:g}: {n}" for b, n in sorted(bounds.items())))
        worst = max(pauses_against, key=lambda pair: pair[0] / pair[1])
        print(f"longest recent pause seen {max(p for p, _ in pauses_against):.2f} s; closest to its bound: "
              f"{worst[0]:.2f} s against {worst[1]:g} s")
    if loads:
        print(f"load average (1 min): median {statistics.median(loads):.1f}, max {max(loads):.1f} on {os.cpu_count()} CPUs")
    sys.exit(1 if hung.exists() else 0)


if __name__ == "__main__":
    main()
