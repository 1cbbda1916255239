"""Peak host memory per rank of a full fine-tune, LoRA and Q-LoRA of the same model, on the CPU.

    PYTHONPATH=src python benchmarks/memory_by_method.py [--nproc 2] [--hidden-size 1024]
        [--layers 8] [--steps 4] [--precision fp32] [--workdir DIR] [--json OUT.json]

Builds one random Llama-shaped model (jobgen.train.tiny; hidden 1024 and 8 layers: 76 M
parameters, 305 MB in fp32), then runs `jobgen-train` under torchrun on it once per method (ZeRO-2,
same data, batch and precision; LoRA and Q-LoRA: r 16 on q/k/v/o/gate/up/down; Q-LoRA: NF4 with
double quantization, bitsandbytes on the CPU). While each runs, every rank's /proc/PID/status is
read every 0.1 s: VmHWM (peak resident set, what metrics.jsonl's peak_memory_mb records),
RssAnon (memory the process allocated, not file pages it mapped), VmRSS once training has
begun (metrics.jsonl has a line) and RssFile (mapped file pages: libraries, the model's
safetensors) when VmRSS was largest. Prints, per method, the largest of each over the ranks.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
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
from tests.processes import ranks_of  # noqa: E402

METHODS = ("full", "lora", "qlora")


def job_dict(workdir: Path, method: str, args: argparse.Namespace) -> dict:
    return {
        "name": f"memory-{method}",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": args.nproc},
        "training": {
            "model": str(workdir / "tiny" / "model"), "data": str(workdir / "tiny" / "data.json"),
            "method": method, "zero_stage": 2, "precision": args.precision,
            "per_device_batch_size": 2, "gradient_accumulation": 1, "max_steps": args.steps,
            "max_length": 256, "save_interval": 10_000, "lr_schedule": "constant",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.05},
        },
    }


def status_mb(pid: int) -> dict[str, float]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            values[key] = int(rest.split()[0]) / 1024  # kB
    return values


def measure(job: Path, nproc: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
         "-m", "jobgen.train", "--job", str(job)],
        cwd=job.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    metrics = job.parent / "output" / "metrics.jsonl"
    peak: dict[int, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    while proc.poll() is None:
        training = metrics.exists() and metrics.stat().st_size > 0
        for rank, pid in ranks_of(proc.pid).items():
            try:
                values = status_mb(pid)
            except (OSError, ValueError):
                continue
            record = peak[rank]
            record["VmHWM"] = max(record["VmHWM"], values.get("VmHWM", 0))
            record["RssAnon"] = max(record["RssAnon"], values.get("RssAnon", 0))
            if values.get("VmRSS", 0) > record["VmRSS"]:  # what the largest resident set was made of
                record.update(VmRSS=values["VmRSS"], RssAnon_at_peak=values.get("RssAnon", 0),
                              RssFile_at_peak=values.get("RssFile", 0))
            if training:
                record["VmRSS_training"] = max(record["VmRSS_training"], values.get("VmRSS", 0))
        time.sleep(0.1)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed:\n{output}")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {
        "per_rank": {rank: {k: round(v) for k, v in values.items()} for rank, values in sorted(peak.items())},
        "peak_rss_mb": round(max(v["VmHWM"] for v in peak.values())),
        "peak_anon_mb": round(max(v["RssAnon"] for v in peak.values())),
        "rss_while_training_mb": round(max(v["VmRSS_training"] for v in peak.values())),
        "file_pages_at_peak_mb": round(max(v["RssFile_at_peak"] for v in peak.values())),
        "metrics_peak_memory_mb": round(max(line["peak_memory_mb"] for line in lines)),
        "trainable": next((line for line in output.splitlines() if "trainable parameters" in line), "").split("INFO ")[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--workdir", help="keep files here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    import yaml

    from jobgen.train.tiny import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jobgen-memory-"))
    build(str(workdir / "tiny"), conversations=64, hidden_size=args.hidden_size, layers=args.layers)
    results = {}
    for method in args.methods:
        run_dir = workdir / method
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        job = run_dir / "job.yaml"
        job.write_text(yaml.safe_dump(job_dict(workdir, method, args)))
        results[method] = measure(job, args.nproc)
        print(method, json.dumps(results[method]), flush=True)
    weights = sum(f.stat().st_size for f in (workdir / "tiny" / "model").glob("*.safetensors"))
    summary = {
        "command": "PYTHONPATH=src python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()],
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}",
        "model_file_mb": round(weights / 1e6),
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"model weights on disk: {summary['model_file_mb']} MB ({args.precision} training, {args.nproc} ranks)")
    print(f"{'method':8s} {'peak RSS':>10s} {'peak anon':>10s} {'RSS training':>13s} {'file pages':>11s}  (MB, largest rank)")
    for method, r in results.items():
        print(f"{method:8s} {r['peak_rss_mb']:10d} {r['peak_anon_mb']:10d} {r['rss_while_training_mb']:13d} "
              f"{r['file_pages_at_peak_mb']:11d}")


if __name__ == "__main__":
    main()
