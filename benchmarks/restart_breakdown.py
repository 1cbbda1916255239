"""Time from a restart to its first new step, phase by phase, on this machine's CPU.

    python benchmarks/restart_breakdown.py [--restarts 5] [--baseline REV]

A 2-node LoRA job of the tiny model (`jobgen submit --scheduler local`: the batch script, each
node a local process, jobgen-torchrun, 1 rank per node, gloo) trains 2 steps and saves; then it
is submitted again `--restarts` times, each time one step further (training.max_steps may change
on a resume), so every submission resumes from the last checkpoint and trains one new step.

Per restart:
  - submit -> first new step: from `jobgen submit` to the first new step's line in metrics.jsonl
  - launch: from `jobgen submit` to the rank's process start (the CLI, the batch and node
    scripts, jobgen-torchrun's own start and rendezvous)
  - the trainer's phases on rank 0, from its OUTPUT_DIR/startup.jsonl (see StartupClock in
    src/jobgen/train/metrics.py)
and their medians. With `--baseline REV`, the same restarts of the code at git revision REV (a
worktree, put first on PYTHONPATH) alternate with those of this checkout in the same run, so both
see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def job(tiny: Path) -> dict:
    return {
        "name": "restart",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:30:00"},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "method": "lora", "precision": "fp32",
                     "per_device_batch_size": 2, "max_length": 64, "max_steps": 2, "save_interval": 1000,
                     # a constant learning rate, so that a resume may train further than the first run
                     "lr_schedule": "constant", "warmup_steps": 0},
    }


def submit(work: Path, src: Path, max_steps: int) -> float:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(src)}
    env.pop("JOBGEN_DEBUG_STEP_DELAY", None)
    started = time.time()
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml", "--set", f"training.max_steps={max_steps}"],
                         cwd=work, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"jobgen submit failed in {work}:\n{out.stderr[-3000:]}")
    return started


def measure(work: Path, src: Path, step: int) -> dict:
    submitted = submit(work, src, step)
    output = work / "runs" / "restart" / "output"
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    first = min(m["time"] for m in metrics if m["step"] == step)
    row = {"submit -> first new step": first - submitted}
    startup_file = output / "startup.jsonl"
    if startup_file.exists():
        entry = json.loads(startup_file.read_text().splitlines()[-1])
        if entry["first_step"] == step - 1:
            row["launch"] = entry["started"] - submitted
            row.update(entry["seconds"])
    return row


def prepare(work: Path, tiny: Path, src: Path) -> None:
    work.mkdir(parents=True)
    (work / "job.yaml").write_text(yaml.safe_dump(job(tiny)))
    submit(work, src, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also measure the code at this git revision, alternating")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="jobgen-restart-"))
    subprocess.run([sys.executable, "-m", "jobgen.train.tiny", str(root / "tiny")], check=True, capture_output=True)
    variants = {"this checkout": REPO / "src"}
    if args.baseline:
        tree = root / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), args.baseline], check=True, capture_output=True)
        variants = {f"baseline {args.baseline}": tree / "src", **variants}
    try:
        for name, src in variants.items():
            prepare(root / name.replace(" ", "-"), root / "tiny", src)
        rows: dict[str, list[dict]] = {name: [] for name in variants}
        for n in range(args.restarts):
            for name, src in variants.items():
                rows[name].append(measure(root / name.replace(" ", "-"), src, 3 + n))
                print(name, {k: round(v, 2) for k, v in rows[name][-1].items()}, flush=True)
    finally:
        if args.baseline:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root / "baseline")], capture_output=True)
    print(f"\nmedians over {args.restarts} restarts, seconds ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs)")
    phases = list(dict.fromkeys(k for name in variants for row in rows[name] for k in row))
    print(f"{'phase':<26}" + "".join(f"{name:>28}" for name in variants))
    for phase in phases:
        cells = []
        for name in variants:
            values = [row[phase] for row in rows[name] if phase in row]
            cells.append(f"{statistics.median(values):>28.2f}" if values else f"{'-':>28}")
        print(f"{phase:<26}" + "".join(cells))


if __name__ == "__main__":
    main()
