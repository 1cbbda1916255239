"""Throughput of `jobgen-train` against the Hugging Face Trainer with DeepSpeed, same model, data,
batch and DeepSpeed config, on this machine's CPU.

    python benchmarks/hf_trainer_compare.py [--nproc 2] [--steps 30] [--warmup 5] [--rounds 2]

A small random Llama (jobgen.train.tiny, hidden 256, 4 layers), LoRA r16 on q/k/v/o/gate/up/down,
ZeRO-2, fp32, gloo, under torchrun, alternately (ABBA: jobgen, hf, hf, jobgen, ...) in this one
invocation:
  - jobgen-train on a job with those settings (logging every step, no checkpoint until the end);
  - transformers.Trainer with `deepspeed=` the very DeepSpeed config jobgen builds for that job,
    the same LoRA model (jobgen's own loader), the same micro-batch size and accumulation, the
    same padding (jobgen's collate), logging every step, no saving, no evaluation.
The Trainer samples in its own order; every conversation of the data is the same one, so every
batch holds the same number of tokens in both and the figure does not depend on the order.
Throughput of a step = input tokens of all ranks / wall time between the ends of consecutive
steps on rank 0 (jobgen: metrics.jsonl; Trainer: a callback's on_step_end). Prints the median
over the steps after warm-up of each (all runs pooled) and the ratio jobgen / Trainer.
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
sys.path.insert(0, str(REPO / "src"))


def job_dict(workdir: Path, args: argparse.Namespace) -> dict:
    return {
        "name": "hf-compare",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": args.nproc},
        "training": {
            "model": str(workdir / "tiny" / "model"), "data": str(workdir / "same.json"), "method": "lora",
            "zero_stage": 2, "precision": "fp32", "per_device_batch_size": args.batch,
            "gradient_accumulation": args.accumulation, "max_steps": args.steps, "save_interval": 10_000,
            "max_length": args.max_length, "lr_schedule": "constant", "warmup_steps": 0,
            "lora": {"r": 16, "alpha": 32, "dropout": 0.05},
        },
    }


def torchrun(args: argparse.Namespace, *command: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), DS_ACCELERATOR="cpu",
               CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--master_port={args.port}", *command],
                   check=True, env=env, stdout=None if args.verbose else subprocess.DEVNULL, stderr=None if args.verbose else subprocess.DEVNULL)


def hf_trainer(job_path: str, out_path: str) -> None:
    """Runs on every rank under torchrun; rank 0 writes [{"step", "time", "tokens"}, ...]."""
    import torch
    import yaml
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from jobgen.job.models import Job
    from jobgen.job.conversations import load_conversations
    from jobgen.train.data import ChatTokenizer, TokenizedDataset
    from jobgen.train.dsconfig import build_config
    from jobgen.train.modeling import load_model, load_tokenizer

    t = Job.model_validate(yaml.safe_load(open(job_path))).training
    world = int(os.environ["WORLD_SIZE"])
    tokenizer = load_tokenizer(t.model)
    dataset = TokenizedDataset(load_conversations(t.data), ChatTokenizer(tokenizer, t.max_length), tokenizer.pad_token_id)
    per_step_tokens = dataset.tokens([0]) * t.per_device_batch_size * t.gradient_accumulation * world
    torch.manual_seed(t.seed)
    model = load_model(t, "fp32", torch.device("cpu"))

    class Indices(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, i: int) -> dict:
            return {"index": i}

    records: list[dict] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            records.append({"step": state.global_step, "time": time.time(), "tokens": per_step_tokens})

    arguments = TrainingArguments(
        output_dir=str(Path(out_path).parent / "hf-out"), per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=t.gradient_accumulation, max_steps=t.max_steps, learning_rate=t.learning_rate,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        remove_unused_columns=False, deepspeed=build_config(t, world, "fp32", None), dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=Indices(),
                      data_collator=lambda items: dataset.collate([item["index"] for item in items]), callbacks=[Clock()])
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        Path(out_path).write_text(json.dumps(records))


def per_step_throughput(records: list[dict]) -> list[float]:
    return [b["tokens"] / (b["time"] - a["time"]) for a, b in zip(records, records[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each, in ABBA order")
    parser.add_argument("--port", type=int, default=29741)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--hf", nargs=2, metavar=("JOB", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf:
        hf_trainer(*args.hf)
        return

    import yaml

    from jobgen.train.tiny import build

    workdir = Path(tempfile.mkdtemp(prefix="jobgen-hf-compare-"))
    build(str(workdir / "tiny"), conversations=64, hidden_size=256, layers=4)
    one = json.loads((workdir / "tiny" / "data.json").read_text())[0]
    samples = args.steps * args.accumulation * args.batch * args.nproc
    same = [{**one, "id": f"same-{i:05d}"} for i in range(samples)]
    (workdir / "same.json").write_text(json.dumps(same))
    run_dir = workdir / "run"
    run_dir.mkdir()
    job = run_dir / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(workdir, args)))

    pooled: dict[str, list[float]] = {"jobgen": [], "hf": []}
    tokens: dict[str, int] = {}
    order = [("jobgen", "hf"), ("hf", "jobgen")] * args.rounds
    for variant in [v for pair in order[: args.rounds] for v in pair]:
        if variant == "jobgen":
            shutil.rmtree(run_dir / "output", ignore_errors=True)
            torchrun(args, "-m", "jobgen.train", "--job", str(job))
            records = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
        else:
            torchrun(args, str(Path(__file__).resolve()), "--hf", str(job), str(workdir / "hf.json"))
            records = json.loads((workdir / "hf.json").read_text())
        tokens.setdefault(variant, records[-1]["tokens"])
        rates = per_step_throughput(records)[args.warmup:]
        pooled[variant] += rates
        print(f"  {variant:6s} run: {len(records)} steps, median {statistics.median(rates):8.1f} tokens/s", flush=True)
    assert tokens["jobgen"] == tokens["hf"], f"the two saw different batches: {tokens}"
    ours, theirs = statistics.median(pooled["jobgen"]), statistics.median(pooled["hf"])
    print(f"model: Llama hidden 256, 4 layers, LoRA r16, ZeRO-2, fp32, {args.nproc} ranks (gloo); {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"steps: {args.steps} per run, {args.rounds} runs of each, micro-batch {args.batch}, accumulation {args.accumulation}, "
          f"{tokens['jobgen']} input tokens per step")
    print(f"jobgen-train             {ours:10.1f} tokens/s")
    print(f"HF Trainer + DeepSpeed   {theirs:10.1f} tokens/s")
    print(f"ratio                    {ours / theirs:10.3f}")


if __name__ == "__main__":
    main()
