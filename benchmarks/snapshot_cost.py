"""What a peer snapshot every step (training.snapshot_every) costs the step, against none.

    PYTHONPATH=src python benchmarks/snapshot_cost.py [--hidden-size 512] [--layers 8] [--steps 14]
        [--repeats 3] [--methods lora,full] [--workdir DIR] [--json OUT.json]

The real trainer on two nodes of one rank each (two torchrun agents on this host, with node names
and snapshot folders of their own, so every snapshot also travels to the other "node" over the
gloo group), on a random Llama-shaped model (jobgen.train.tiny; hidden 512, 8 layers: 19 M
parameters). For each method, runs with `snapshot_every: 0` and `1` alternate, --repeats times;
each trains --steps steps with a checkpoint only at the last. A step's cost is its wall time: the
difference of consecutive `time` stamps in metrics.jsonl (logging every step), steps 3 to the
next-to-last (the first ones warm up; the last saves). Prints the median step per variant, the ratio
with/without (target for lora: at most 1.02) and the snapshot's size a rank from the trainer's log.
Benchmarks report; nothing here fails on a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_dict(workdir: Path, method: str, every: int, steps: int) -> dict:
    training = {
        "model": str(workdir / "tiny" / "model"), "data": str(workdir / "tiny" / "data.json"),
        "method": method, "zero_stage": 2, "precision": "fp32", "per_device_batch_size": 2,
        "gradient_accumulation": 2, "max_length": 128, "max_steps": steps, "save_interval": 1000,
        "logging_interval": 1, "snapshot_every": every, "lr_schedule": "constant",
    }
    if method == "lora":
        training["lora"] = {"r": 16, "alpha": 32, "dropout": 0.05}
    return {"name": "snapshot-cost", "resources": {"nodes": 2, "gpus_per_node": 0},
            "launch": {"procs_per_node": 1}, "training": training}


def run(workdir: Path, method: str, every: int, steps: int) -> dict:
    import yaml

    run_dir = workdir / f"{method}-{every}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job_dict(workdir, method, every, steps)))
    port, procs = free_port(), []
    for node_rank, node in enumerate("ab"):
        env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   JOBGEN_NODE_NAME=node, JOBGEN_SNAPSHOT_DIR=str(workdir / "memory" / node))
        log = open(run_dir / f"node-{node}.log", "w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "jobgen.train", "--job", "job.yaml"],
            cwd=run_dir, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    for proc in procs:
        if proc.wait(timeout=1800) != 0:
            raise SystemExit(f"{method} snapshot_every {every} failed:\n" + (run_dir / "node-a.log").read_text()[-4000:])
    times = [json.loads(line)["time"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    walls = [b - a for a, b in zip(times, times[1:])][2:-1]
    said = re.search(r"snapshots: (\d+) taken, (\d+) skipped .*?, ([\d.]+) MB a rank(?:; training paused a median (\d+) ms "
                     r"for each, kept and sent in (\d+) ms beside it \((\d+) ms of CPU\))?", (run_dir / "node-a.log").read_text())
    return {"step_s": walls, "taken": int(said[1]) if said else 0, "skipped": int(said[2]) if said else 0,
            "mb_a_rank": float(said[3]) if said else 0.0,
            "paused_ms": int(said[4]) if said and said[4] else None, "kept_ms": int(said[5]) if said and said[5] else None,
            "cpu_ms": int(said[6]) if said and said[6] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="lora,full")
    parser.add_argument("--workdir", help="keep files here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    from jobgen.train.tiny import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jobgen-snapshot-cost-"))
    build(str(workdir / "tiny"), conversations=96, hidden_size=args.hidden_size, layers=args.layers)
    figures: dict = {}
    for _ in range(args.repeats):
        for method in args.methods.split(","):
            for every in (0, 1):  # alternated, so that the machine's load falls on both alike
                result = run(workdir, method, every, args.steps)
                entry = figures.setdefault(f"{method} snapshot_every {every}", {"step_s": [], "taken": 0, "skipped": 0})
                entry["step_s"] += result["step_s"]
                entry["taken"] += result["taken"]
                entry["skipped"] += result["skipped"]
                entry["mb_a_rank"] = result["mb_a_rank"]
                if result["paused_ms"] is not None:
                    entry.setdefault("paused_ms", []).append(result["paused_ms"])
                    entry.setdefault("kept_ms", []).append(result["kept_ms"])
                    entry.setdefault("cpu_ms", []).append(result["cpu_ms"])
    summary = {
        "command": "PYTHONPATH=src python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()],
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}",
        "model": f"Llama hidden {args.hidden_size}, {args.layers} layers; ZeRO-2, fp32, 2 nodes x 1 rank (gloo)",
        "variants": {name: {"median_step_s": round(statistics.median(e["step_s"]), 4), "steps_timed": len(e["step_s"]),
                            "snapshots_taken": e["taken"], "snapshots_skipped": e["skipped"],
                            "snapshot_mb_a_rank": e["mb_a_rank"],
                            **({"paused_ms_median_of_runs": statistics.median(e["paused_ms"]),
                                "kept_ms_median_of_runs": statistics.median(e["kept_ms"]),
                                "thread_cpu_ms_median_of_runs": statistics.median(e["cpu_ms"])} if e.get("paused_ms") else {})}
                 for name, e in figures.items()},
    }
    for method in args.methods.split(","):
        with_, without = (summary["variants"][f"{method} snapshot_every {e}"]["median_step_s"] for e in (1, 0))
        summary[f"{method}_ratio_with_to_without"] = round(with_ / without, 4)
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "raw": figures}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
