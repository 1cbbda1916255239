"""Steady-state throughput of `jobgen-train` against a bare DeepSpeed loop, same model, data, config.

    PYTHONPATH=src python benchmarks/train_throughput.py [--nproc 2] [--steps 40] [--warmup 5]

Builds a small random Llama (jobgen.train.tiny, hidden 256, 4 layers by default), then runs under
torchrun, alternately (ABBA: jobgen, bare, bare, jobgen, ...) in this one invocation:
  - jobgen-train on a job with LoRA, ZeRO-2, fp32 (logging every step, no checkpoint until the end);
  - this file with --bare: the same model, LoRA config, DeepSpeed config and micro-batches, in the
     plainest loop: forward with labels, engine.backward, engine.step; no metrics, no collectives of
     its own, no signal checks.
Throughput of a step = input tokens of all ranks / wall time between the ends of consecutive steps
(timestamps taken on rank 0; jobgen's from metrics.jsonl, so its logging, stop-flag collective and
sample bookkeeping are inside the measurement). Prints the median over the steps after warm-up of
each (all runs pooled) and the ratio jobgen / bare (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))


def job_dict(workdir: Path, args: argparse.Namespace) -> dict:
    return {
        "name": "throughput",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": args.nproc},
        "training": {
            "model": str(workdir / "tiny" / "model"),
            "data": str(workdir / "tiny" / "data.json"),
            "method": "lora",
            "zero_stage": 2,
            "precision": "fp32",
            "per_device_batch_size": args.batch,
            "gradient_accumulation": args.accumulation,
            "max_steps": args.steps,
            "epochs": 1,
            "save_interval": 10_000,
            "max_length": args.max_length,
            "lr_schedule": "constant",
            "lora": {"r": 16, "alpha": 32, "dropout": 0.05},
        },
    }


def torchrun(args: argparse.Namespace, *command: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
         f"--master_port={args.port}", *command],
        check=True, env=env, stdout=subprocess.DEVNULL if not args.verbose else None,
        stderr=subprocess.DEVNULL if not args.verbose else None,
    )


def per_step_throughput(records: list[dict]) -> list[float]:
    """tokens/s of step i from the timestamps of steps i-1 and i."""
    return [b["tokens"] / (b["time"] - a["time"]) for a, b in zip(records, records[1:])]


def bare_loop(job_path: str, out_path: str) -> None:
    """Runs on every rank under torchrun; rank 0 writes [{"step", "time", "tokens"}, ...]."""
    import deepspeed
    import torch
    import yaml

    from jobgen.job.models import Job
    from jobgen.job.conversations import load_conversations
    from jobgen.train.data import BatchOrder, ChatTokenizer, TokenizedDataset
    from jobgen.train.dsconfig import build_config
    from jobgen.train.modeling import load_model, load_tokenizer

    t = Job.model_validate(yaml.safe_load(open(job_path))).training
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    deepspeed.init_distributed(dist_backend="gloo")
    tokenizer = load_tokenizer(t.model)
    dataset = TokenizedDataset(load_conversations(t.data), ChatTokenizer(tokenizer, t.max_length), tokenizer.pad_token_id)
    torch.manual_seed(t.seed)
    model = load_model(t, "fp32", torch.device("cpu"))
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=build_config(t, world, "fp32", None),
    )
    orders = [BatchOrder(len(dataset), world, r, t.per_device_batch_size, t.seed) for r in range(world)]
    records = []
    engine.train()
    for step in range(t.max_steps):
        tokens = 0
        for micro in range(t.gradient_accumulation):
            index = step * t.gradient_accumulation + micro
            batch = dataset.collate(orders[rank].batch(0, index))
            tokens += sum(len(dataset.input_ids[i]) for o in orders for i in o.batch(0, index))
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
        records.append({"step": step + 1, "time": time.time(), "tokens": tokens})
    if rank == 0:
        Path(out_path).write_text(json.dumps(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each loop, in ABBA order")
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--workdir", help="keep files here (default: a temporary folder)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--bare", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        bare_loop(*args.bare)
        return

    import yaml

    from jobgen.train.tiny import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jobgen-throughput-"))
    samples = args.steps * args.accumulation * args.batch * args.nproc
    build(str(workdir / "tiny"), conversations=samples, hidden_size=args.hidden_size, layers=args.layers)
    run_dir = workdir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    job = run_dir / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(workdir, args)))

    samples: dict[str, list[float]] = {"jobgen": [], "bare": []}
    tokens: dict[str, list[int]] = {}
    # ABBA order, so that a slow drift of the machine (other jobs, heat) weighs on both alike.
    order = [("jobgen", "bare"), ("bare", "jobgen")] * args.rounds
    for variant in [v for pair in order[: args.rounds] for v in pair]:
        if variant == "jobgen":
            shutil.rmtree(run_dir / "output", ignore_errors=True)
            torchrun(args, "-m", "jobgen.train", "--job", str(job))
            records = [json.loads(l) for l in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
        else:
            torchrun(args, str(Path(__file__).resolve()), "--bare", str(job), str(workdir / "bare.json"))
            records = json.loads((workdir / "bare.json").read_text())
        tokens.setdefault(variant, [r["tokens"] for r in records])
        samples[variant] += per_step_throughput(records)[args.warmup :]
        print(f"  {variant:6s} run: median {statistics.median(per_step_throughput(records)[args.warmup:]):8.1f} tokens/s")
    assert tokens["jobgen"] == tokens["bare"], "the two loops saw different batches"
    ours, theirs = statistics.median(samples["jobgen"]), statistics.median(samples["bare"])
    print(f"model: Llama hidden {args.hidden_size}, {args.layers} layers, LoRA r16, ZeRO-2, fp32, {args.nproc} ranks (gloo)")
    print(f"steps: {args.steps} per run, {args.rounds} runs of each (median over steps {args.warmup + 2}..{args.steps} "
          f"of every run), micro-batch {args.batch}, accumulation {args.accumulation}")
    print(f"jobgen-train    {ours:10.1f} tokens/s")
    print(f"bare DeepSpeed  {theirs:10.1f} tokens/s")
    print(f"ratio           {ours / theirs:10.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
