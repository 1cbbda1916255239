"""The GPU runs: jobgen's whole path (rendered script, node script, jobgen-torchrun, jobgen-train)
on one GPU, with figures, and a plain PEFT + PyTorch loop on the same model, data and batch.

    python benchmarks/gpu_finetune.py --out DIR [--work /tmp/jobgen-gpu] [--only NAME,...] [--smoke]

Nothing is downloaded: models are built from configs with random weights in the shapes of
Llama-3-8B and Llama-3.2-1B, with the tiny tokenizer of jobgen.train.tiny and conversations made
here, each longer than the 2048-token sequence (so every sequence is full: no padding). Each run is
`jobgen submit --scheduler local JOB.yaml` in WORK; its figures come from the run's own
metrics.jsonl and logs. Runs:

  probe-gpu       jobgen-probe, 1 GPU, NCCL
  probe-cpu-job   jobgen-probe of a CPU job (2 ranks, gpus_per_node 0) on this GPU host: gloo, GPUs hidden
  lora            LoRA r16, bf16, ZeRO-2, 8B shape, sequence 2048, no gradient checkpointing
  lora-gc         the same with gradient checkpointing, stopped by SIGTERM to jobgen-torchrun
                  mid-run, then submitted again: it must resume and end at the same step
  qlora           Q-LoRA (4-bit NF4, bf16 compute), 8B shape, gradient checkpointing
  full-1b         full fine-tune, bf16, ZeRO-2, 1B shape, gradient checkpointing; checkpoints,
                  then resumed for a few steps (checkpoint load time)
  plain-lora      the plain loop (peft + torch.autocast + fused AdamW), 8B shape, as `lora`
  nemo-*          NVIDIA NeMo AutoModel's published Llama-3-8B LoRA shape (r 16, alpha 32, every
                  projection, sequence 4096, micro-batch 2, accumulation 16, bf16): `nemo-plain` the
                  plain loop, `nemo-jobgen` jobgen with packing, `-liger` with Liger's kernels
                  (training.liger_kernel), `-nodrop` with LoRA dropout 0; run with --sequence 4096

Throughput = input tokens / wall time of a step, median over the steps after the first 3.
MFU counts 6 N + 12 L h s FLOPs per token (N parameters, L layers, h hidden, s sequence) against
the GPU's dense bf16 peak; for LoRA, where frozen weights get no weight gradient, `mfu_4n` counts
4 N + 12 L h s as well. --smoke runs the same on the CPU with tiny shapes (gpus_per_node 0), to
check this script before spending GPU time. Results: OUT/results.json (one object per run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

SEQUENCE = 2048  # --sequence
WARMUP_STEPS = 3  # --warmup: steps left out of the medians
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
               tie_word_embeddings=True),
}
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False)
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
# The plain loop, and the steps from it to jobgen's loop, one change each, to find a gap:
# `chunked` takes jobgen's loss (trainer._token_loss_sum), `ds` runs the step through DeepSpeed
# ZeRO-2 with jobgen's config (`nooverlap`: overlap_comm off).
VARIANTS = ("plain", "plain-chunked", "ds", "ds-nooverlap", "ds-chunked", "ds-noclip", "ds-stage0", "ds-profile", "ds-nocheck")


def main() -> int:
    global SEQUENCE, WARMUP_STEPS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--work", type=Path, default=Path("/tmp/jobgen-gpu"))
    parser.add_argument("--only", default="", help="comma-separated run names (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks this script")
    parser.add_argument("--plain", nargs=2, metavar=("MODEL", "DATA"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (lora and plain-lora)")
    parser.add_argument("--variant", default="plain", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--sequence", type=int, default=SEQUENCE, help="tokens per sequence (every one full)")
    parser.add_argument("--warmup", type=int, default=WARMUP_STEPS, help="first steps left out of the medians")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step (plain loop)")
    parser.add_argument("--liger", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lora-dropout", type=float, default=LORA["dropout"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    SEQUENCE, WARMUP_STEPS = args.sequence, args.warmup
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plain:
        return plain_loop(args)
    args.work.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    return bench.run_all()


# ------------------------------------------------------------------------------------ inputs
def conversations(count: int, words: int, seed: int = 0) -> list[dict]:
    from jobgen.train.tiny import _WORDS

    rng = random.Random(seed)
    items = []
    for index in range(count):
        answer = " ".join(rng.choice(_WORDS) for _ in range(words))
        turns = [{"from": "user", "value": f"Tell me about item {index}."}, {"from": "assistant", "value": answer}]
        items.append({"id": f"gpu-{index:04d}", "conversations": turns})
    return items


def build_data(work: Path) -> str:
    """Conversations longer than a sequence (about a token a word or more), so every row is full."""
    data = work / f"data-{SEQUENCE}.json"
    if not data.exists():
        data.write_text(json.dumps(conversations(160 if SEQUENCE > 2048 else 96, max(2000, SEQUENCE + 100))))
    return str(data)


def build_model(work: Path, shape: str, smoke: bool) -> str:
    """work/model-SHAPE: random weights in that shape, with the tiny tokenizer (kept when present)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from jobgen.train.tiny import build_tokenizer

    target = work / f"model-{shape}"
    if (target / "config.json").exists():
        return str(target)
    started = time.perf_counter()
    items = conversations(8, 200)
    tokenizer = build_tokenizer([t["value"] for i in items for t in i["conversations"]] + ["user\n", "assistant\n"], 384)
    config = LlamaConfig(**(SMOKE_SHAPE if smoke else SHAPES[shape]), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(str(target))
    tokenizer.save_pretrained(str(target))
    params = sum(p.numel() for p in model.parameters())
    del model
    if not smoke:
        torch.cuda.empty_cache()
    print(f"built {target}: {params / 1e9:.2f} B parameters in {time.perf_counter() - started:.0f} s", flush=True)
    return str(target)


# --------------------------------------------------------------------------------- the runs
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work, self.out, self.smoke = args, args.work, args.out, args.smoke
        self.results: dict[str, dict] = {}
        self.only = set(filter(None, args.only.split(",")))

    def wanted(self, name: str) -> bool:
        return not self.only or name in self.only

    def model(self, shape: str) -> str:
        return build_model(self.work, shape, self.smoke)

    def run_all(self) -> int:
        self.results["environment"] = environment()
        self.save()
        self.data = build_data(self.work)
        steps = 6 if self.smoke else self.args.steps
        runs = [
            ("probe-gpu", lambda: self.probe("probe-gpu", gpus=1)),
            ("probe-cpu-job", lambda: self.probe("probe-cpu-job", gpus=0, procs=2)),
            ("lora", lambda: self.train("lora", "8b", "lora", steps, gc=False, per_device_batch_size=self.args.batch)),
            ("plain-lora", lambda: self.plain("plain-lora", "8b", steps, gc=False)),
            ("qlora", lambda: self.train("qlora", "8b", "qlora", max(steps // 2, 6), gc=True)),
            ("full-1b", lambda: self.full_with_resume("full-1b", steps)),
            ("lora-gc", lambda: self.stop_and_resume("lora-gc", "8b", steps + 10, stop_at=steps // 2)),
        ] + [(f"variant-{v}", lambda v=v: self.plain(f"variant-{v}", "8b", 20, gc=False, variant=v)) for v in VARIANTS]
        # NeMo AutoModel's published shape; `steps` counts optimizer steps of 16 micro-batches here.
        nemo = dict(per_device_batch_size=2, gradient_accumulation=16, packing=True)
        runs += [
            ("nemo-plain", lambda: self.plain("nemo-plain", "8b", steps, gc=False, batch=2, accumulation=16)),
            ("nemo-jobgen", lambda: self.train("nemo-jobgen", "8b", "lora", steps, gc=False, **nemo)),
            ("nemo-jobgen-liger", lambda: self.train("nemo-jobgen-liger", "8b", "lora", steps, gc=False, liger_kernel=True, **nemo)),
            ("cuda-checks", lambda: self.cuda_checks("cuda-checks")),
            ("nemo-plain-liger", lambda: self.plain("nemo-plain-liger", "8b", steps, gc=False, batch=2, accumulation=16, liger=True)),
            ("nemo-plain-liger-nodrop", lambda: self.plain("nemo-plain-liger-nodrop", "8b", steps, gc=False, batch=2,
                                                           accumulation=16, liger=True, lora_dropout=0.0)),
            ("nemo-jobgen-nodrop", lambda: self.train("nemo-jobgen-nodrop", "8b", "lora", steps, gc=False,
                                                      lora={**LORA, "dropout": 0.0}, **nemo)),
            ("nemo-jobgen-liger-nodrop", lambda: self.train("nemo-jobgen-liger-nodrop", "8b", "lora", steps, gc=False,
                                                            liger_kernel=True, lora={**LORA, "dropout": 0.0}, **nemo)),
        ]
        failed = 0
        for name, run in runs:
            if not self.wanted(name):
                continue
            started = time.perf_counter()
            try:
                self.results[name] = run()
            except Exception as exc:  # one failed run must not lose the others' figures
                failed += 1
                self.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
            self.results[name]["wall_seconds"] = round(time.perf_counter() - started, 1)
            print(f"== {name}: {json.dumps(self.results[name])[:1500]}", flush=True)
            self.save()
        return 1 if failed else 0

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))

    # jobs
    def job(self, name: str, shape: str, method: str, steps: int, gc: bool, gpus: int = 1, procs: int | None = None,
            entrypoint: str = "jobgen-train", **training) -> Path:
        smoke = self.smoke
        job = {
            "name": name,
            "resources": {"nodes": 1, "gpus_per_node": 0 if smoke else gpus, "time_limit": "02:00:00"},
            "launch": {"entrypoint": entrypoint, **({"procs_per_node": procs or 1} if smoke or gpus == 0 else {})},
            "training": {
                "model": self.model(shape), "data": self.data, "method": method, "zero_stage": 2,
                "precision": "fp32" if smoke else "bf16", "per_device_batch_size": 1, "gradient_accumulation": 1,
                "max_length": SEQUENCE, "max_steps": steps, "save_interval": 100000, "logging_interval": 1,
                "lr_schedule": "constant", "learning_rate": 1e-4 if method != "full" else 1e-5,
                "gradient_checkpointing": gc, "lora": LORA, **training,
                **({"liger_kernel": False} if smoke else {}),  # Liger needs a GPU: the smoke run checks the rest
            },
            "requeue": {"enabled": False},
        }
        path = self.work / "jobs" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        import yaml

        path.write_text(yaml.safe_dump(job, sort_keys=False))
        return path

    def submit(self, job: Path, log_name: str, wait: bool = True):
        log = open(self.out / f"{log_name}.log", "w")
        process = subprocess.Popen(["jobgen", "submit", "-s", "local", str(job)], cwd=self.work,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            process.wait(timeout=1500)
        return process

    def run_dir(self, name: str) -> Path:
        return self.work / "runs" / name

    def probe(self, name: str, gpus: int, procs: int | None = None) -> dict:
        job = self.job(name, "1b", "lora", 1, False, gpus=gpus, procs=procs, entrypoint="jobgen-probe")
        self.submit(job, name)
        ranks = sorted((self.run_dir(name) / "probe").glob("rank-*.json"))
        return {"exit": exit_report(self.run_dir(name)), "ranks": [json.loads(p.read_text()) for p in ranks]}

    def train(self, name: str, shape: str, method: str, steps: int, gc: bool, **training) -> dict:
        self.submit(self.job(name, shape, method, steps, gc, **training), name)
        return self.figures(name, shape, method)

    def stop_and_resume(self, name: str, shape: str, steps: int, stop_at: int) -> dict:
        job = self.job(name, shape, "lora", steps, gc=True)
        run_dir = self.run_dir(name)
        process = self.submit(job, f"{name}-1", wait=False)
        metrics = run_dir / "output" / "metrics.jsonl"
        deadline = time.time() + 1200
        while last_step(metrics) < stop_at:
            if process.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the run ended or hung before step {stop_at}")
            time.sleep(0.5)
        torchrun = subprocess.run(["pgrep", "-f", f"jobgen-torchrun.*{run_dir}/job.yaml"],
                                  capture_output=True, text=True).stdout.split()
        signalled = time.time()
        for pid in torchrun:
            os.kill(int(pid), signal.SIGTERM)
        process.wait(timeout=600)
        first = {"exit": exit_report(run_dir), "signalled_at_step": last_step(metrics),
                 "stop_seconds": round(time.time() - signalled, 1), "torchrun_pids": torchrun}
        self.submit(job, f"{name}-2")
        result = self.figures(name, shape, "lora")
        result["first_segment"] = first
        return result

    def cuda_checks(self, name: str) -> dict:
        """The CUDA paths the CPU tests cannot reach, in one short run of the 1B shape: LoRA under
        ZeRO-3 (the dtype it trains in), evaluation, background saves (their CUDA snapshot), the
        adapter-only final save and the health gate's matmul figure."""
        job = self.job(name, "1b", "lora", 4, gc=True, zero_stage=3, eval_fraction=0.05, eval_interval=2,
                       save_interval=2, async_save=True, max_length=min(SEQUENCE, 2048))
        import yaml

        spec = yaml.safe_load(job.read_text())
        spec["launch"]["health_check"] = True
        job.write_text(yaml.safe_dump(spec, sort_keys=False))
        self.submit(job, name)
        run_dir = self.run_dir(name)
        logs = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
        (self.out / f"{name}-logs.txt").write_text(logs[-200_000:])
        final = run_dir / "output" / "final"
        lines = [json.loads(l) for l in (run_dir / "output" / "metrics.jsonl").read_text().splitlines() if l.strip()]
        health = run_dir / "health.json"
        return {
            "exit": exit_report(run_dir),
            "dtypes": re.findall(r"trainable parameters in (\S+)", logs),
            "final_files": {p.name: p.stat().st_size for p in final.iterdir()} if final.is_dir() else None,
            "eval_losses": {l["step"]: l.get("eval_loss") for l in lines if "eval_loss" in l},
            "checkpoints": sorted(p.name for p in (run_dir / "output" / "checkpoints").glob("step-*")),
            "health": json.loads(health.read_text()) if health.exists() else None,
            **log_figures(run_dir),
        }

    def full_with_resume(self, name: str, steps: int) -> dict:
        job = self.job(name, "1b", "full", steps, gc=True, save_interval=max(steps // 2, 2))
        self.submit(job, f"{name}-1")
        result = self.figures(name, "1b", "full")
        # Resume from the last checkpoint for a few more steps: the checkpoint load time.
        job = self.job(name, "1b", "full", steps + 3, gc=True, save_interval=max(steps // 2, 2))
        self.submit(job, f"{name}-2")
        result["resume"] = {"exit": exit_report(self.run_dir(name)), "checkpoint_load_seconds": log_figures(self.run_dir(name))["checkpoint_load_seconds"]}
        disk_usage(self.run_dir(name) / "output" / "checkpoints", result)
        # A checkpoint of a full 1B fine-tune is ~17 GB (weights and Adam states): free the disk.
        shutil.rmtree(self.run_dir(name) / "output" / "checkpoints", ignore_errors=True)
        return result

    def plain(self, name: str, shape: str, steps: int, gc: bool, variant: str = "plain", batch: int | None = None,
              accumulation: int = 1, liger: bool = False, lora_dropout: float = LORA["dropout"]) -> dict:
        command = [sys.executable, __file__, "--out", str(self.out / name), "--plain", self.model(shape), self.data,
                   "--steps", str(steps), "--variant", variant, "--batch", str(batch or self.args.batch),
                   "--accumulation", str(accumulation), "--sequence", str(SEQUENCE), "--warmup", str(WARMUP_STEPS)]
        command += (["--smoke"] if self.smoke else []) + (["--liger"] if liger and not self.smoke else [])
        command += ["--lora-dropout", str(lora_dropout)]
        with open(self.out / f"{name}.log", "w") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=1500, check=True)
        result = json.loads((self.out / name / "plain.json").read_text())
        result.update(flops(self.model(shape), "lora", result["tokens_per_s"], self.smoke))
        return result

    def figures(self, name: str, shape: str, method: str) -> dict:
        run_dir = self.run_dir(name)
        lines = [json.loads(l) for l in (run_dir / "output" / "metrics.jsonl").read_text().splitlines() if l.strip()]
        lines = [l for l in lines if "tokens_per_s" in l]  # not the evaluation-only lines
        measured = [l["tokens_per_s"] for l in lines[WARMUP_STEPS:]] or [l["tokens_per_s"] for l in lines]
        result = {
            "exit": exit_report(run_dir),
            "steps": [l["step"] for l in lines][-1] if lines else None,
            "loss": {l["step"]: round(l["loss"], 5) for l in lines},
            "tokens_per_s": statistics.median(measured) if measured else None,
            "step_seconds_median": statistics.median([l["step_seconds_max"] for l in lines[WARMUP_STEPS:]] or [0]),
            "peak_memory_mb": max((l["peak_memory_mb"] for l in lines), default=None),
            "peak_reserved_mb": max((l.get("peak_reserved_mb", 0) for l in lines), default=None),
            "host_peak_mb": max((l.get("host_peak_mb", 0) for l in lines), default=None),
            **log_figures(run_dir),
        }
        if result["tokens_per_s"]:
            result.update(flops(self.model(shape), method, result["tokens_per_s"], self.smoke))
        return result


def disk_usage(directory: Path, result: dict) -> None:
    for checkpoint in sorted(directory.glob("step-*")):
        size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
        result.setdefault("checkpoint_gb", {})[checkpoint.name] = round(size / 1e9, 2)


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    lines = [l for l in metrics.read_text().splitlines() if l.strip()]
    return json.loads(lines[-1])["step"] if lines else 0


def exit_report(run_dir: Path) -> dict:
    path = run_dir / "trainer-exit.json"
    return json.loads(path.read_text()) if path.exists() else {}


def log_figures(run_dir: Path) -> dict:
    text = "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").rglob("*-rank0.out")))
    saves = [float(s) for s in re.findall(r"checkpoint \S+ \(([\d.]+) s\)", text)]
    loads = [float(s) for s in re.findall(r"checkpoint loaded in ([\d.]+) s", text)]
    models = [float(s) for s in re.findall(r"model \S+ loaded in ([\d.]+) s", text)]
    return {"checkpoint_save_seconds": saves, "checkpoint_load_seconds": loads, "model_load_seconds": models}


def peak_flops(smoke: bool) -> tuple[float, str]:
    if smoke:
        return 1e12, "smoke run: nominal 1 TFLOP/s"
    import torch

    name = torch.cuda.get_device_name(0)
    for key, value in (("PCIe", 756e12), ("NVL", 835e12)):
        if key in name:
            return value, f"{name}: dense bf16 peak {value / 1e12:.0f} TFLOP/s"
    return 989e12, f"{name}: dense bf16 peak 989 TFLOP/s (H100/H200 SXM)"


def flops(model_dir: str, method: str, tokens_per_s: float, smoke: bool) -> dict:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * config["intermediate_size"]
    params = layers * per_layer + vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    attention = 12 * layers * h * SEQUENCE
    peak, peak_note = peak_flops(smoke)
    result = {"parameters": params, "mfu": tokens_per_s * (6 * params + attention) / peak, "peak_note": peak_note}
    if method in ("lora", "qlora"):
        result["mfu_4n"] = tokens_per_s * (4 * params + attention) / peak
    return result


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    for package in ("transformers", "peft", "deepspeed", "bitsandbytes", "accelerate"):
        try:
            info[package] = __import__(package).__version__
        except Exception as exc:  # noqa: BLE001 - recorded, not fatal
            info[package] = f"not importable: {exc}"
    return info


# ---------------------------------------------------------------------------- the plain loop
def plain_loop(args: argparse.Namespace) -> int:
    """The same model, LoRA, data and batch as `lora`, in the plainest PEFT + PyTorch loop."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jobgen.job.models import Lora
    from jobgen.job.conversations import load_conversations
    from jobgen.train.data import ChatTokenizer, TokenizedDataset

    model_dir, data = args.plain
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = TokenizedDataset(load_conversations(data), ChatTokenizer(tokenizer, SEQUENCE), tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": device})
    model.config.use_cache = False
    if args.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    lora = Lora(**{**LORA, "dropout": args.lora_dropout})
    model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    variant = args.variant
    if variant.startswith("ds"):
        import deepspeed

        from jobgen.job.models import Training
        from jobgen.train.dsconfig import build_config

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
        deepspeed.init_distributed(dist_backend="gloo" if args.smoke else "nccl")
        training = Training(model=model_dir, data=data, zero_stage=2, precision="fp32" if args.smoke else "bf16",
                            learning_rate=1e-4, lr_schedule="constant")
        config = build_config(training, 1, training.precision, None)
        config["zero_optimization"]["overlap_comm"] = variant != "ds-nooverlap"
        if variant == "ds-nocheck":  # DeepSpeed's per-gradient inf/NaN check off
            config["bf16"]["check_grad_overflow"] = False
        if variant == "ds-noclip":
            config["gradient_clipping"] = 0.0
        if variant == "ds-stage0":
            config["zero_optimization"]["stage"] = 0
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    else:
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=not args.smoke)
    model.train()
    times, losses, tokens = [], [], []
    profiler = None
    micro_steps = 0
    for step in range(args.steps):
        if variant == "ds-profile" and step == 8:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        started, step_tokens = time.perf_counter(), 0
        for _ in range(args.accumulation):
            rows = range(micro_steps * args.batch, (micro_steps + 1) * args.batch)
            batch = {k: v.to(device) for k, v in dataset.collate([r % len(dataset) for r in rows]).items()}
            micro_steps += 1
            if variant.startswith("ds"):
                loss = _loss(engine, batch, chunked=variant.endswith("chunked"))
                engine.backward(loss)
                engine.step()
            else:
                with torch.autocast(device.type, dtype=dtype, enabled=not args.smoke):
                    loss = _loss(model, batch, chunked=variant.endswith("chunked"))
                (loss / args.accumulation).backward()
            step_tokens += int(batch["attention_mask"].sum())
        if not variant.startswith("ds"):
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises, as jobgen's per-step collective does
        times.append(time.perf_counter() - started)
        tokens.append(step_tokens)
        if profiler is not None and step == 10:
            profiler.__exit__(None, None, None)
            averages = profiler.key_averages()
            report = [averages.table(sort_by=key, row_limit=30) for key in ("self_cpu_time_total", "self_device_time_total")]
            (args.out / "profile.txt").write_text("\n\n".join(report))
            profiler = None
    rates = [n / t for n, t in zip(tokens[WARMUP_STEPS:], times[WARMUP_STEPS:])] or [n / t for n, t in zip(tokens, times)]
    result = {
        "variant": variant, "steps": args.steps, "tokens_per_s": statistics.median(rates), "liger": args.liger,
        "micro_batch": args.batch, "accumulation": args.accumulation, "sequence": SEQUENCE, "lora_dropout": args.lora_dropout,
        "step_seconds_median": statistics.median(times[WARMUP_STEPS:] or times),
        "loss": {i + 1: round(l, 5) for i, l in enumerate(losses)},
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20 if not args.smoke else None,
        "peak_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if not args.smoke else None,
    }
    (args.out / "plain.json").write_text(json.dumps(result, indent=1))
    return 0


def _loss(model, batch: dict, chunked: bool):
    if not chunked:
        return model(**batch).loss
    from jobgen.train.trainer import _token_loss_sum

    return _token_loss_sum(model, batch) / (batch["labels"][:, 1:] != -100).sum()


if __name__ == "__main__":
    sys.exit(main())
