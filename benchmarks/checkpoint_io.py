"""Checkpoint save and load against the disk's own speed, and the stall of a background save.

    PYTHONPATH=src python benchmarks/checkpoint_io.py [--nproc 2] [--hidden-size 512] [--layers 8]
        [--repeats 5] [--workdir DIR] [--json OUT.json]

In one invocation, on the file system of --workdir (default: a temporary folder):
  1. `dd` of a file of the checkpoint's size: write `dd if=/dev/zero of=F bs=1M count=N
     conv=fdatasync`, read `dd if=F of=/dev/null bs=1M iflag=direct` (O_DIRECT: not from this
     machine's page cache) after `dd if=F iflag=nocache count=0` (which drops F from it);
     --repeats times each.
  2. Under torchrun, a full fine-tune (ZeRO-2, fp32, AdamW) of a random Llama-shaped model
     (jobgen.train.tiny; hidden 512 and 8 layers: 25 M parameters, a checkpoint of about 400 MB
     with its Adam state), through jobgen's CheckpointStore, alternately --repeats times:
       - synchronous save (`training.async_save: false`): the time training is paused;
       - background save: the stall (snapshot into host memory), then training goes on while
         the files are written; the time to the commit, and the step times meanwhile;
       - load of the newest checkpoint (weights, optimizer, scheduler, RNG), cold (every file
         dropped from the page cache first with posix_fadvise DONTNEED) and warm.
Prints medians, MB/s (size / time) and the stall ratio (median stall / median synchronous save);
the target is <= 0.25. Benchmarks report; nothing here fails on a figure.
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
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))


def job_dict(workdir: Path, nproc: int) -> dict:
    return {
        "name": "checkpoint-io",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": nproc},
        "training": {
            "model": str(workdir / "tiny" / "model"),
            "data": str(workdir / "tiny" / "data.json"),
            "method": "full",
            "zero_stage": 2,
            "precision": "fp32",
            "per_device_batch_size": 2,
            "gradient_accumulation": 1,
            "max_length": 128,
            "lr_schedule": "constant",
            "output_dir": str(workdir / "output"),
        },
    }


def drop_from_page_cache(directory: str) -> None:
    """Evict every file under `directory` from the page cache (clean pages; no root needed)."""
    for parent, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(job_path: str, repeats: int, out_path: str) -> None:
    """Runs on every rank under torchrun; rank 0 writes the timings to `out_path`."""
    import deepspeed
    import torch

    from jobgen.train import checkpoint as ckpt
    from jobgen.train.background_save import BackgroundSaves
    from jobgen.train.__main__ import load_job
    from jobgen.train.data import BatchOrder, ChatTokenizer, TokenizedDataset
    from jobgen.train.distributed import Distributed, RankInfo
    from jobgen.train.modeling import load_model, load_tokenizer
    from jobgen.train.prepare import prepare

    info = RankInfo.from_env()
    p = prepare(load_job(job_path), os.path.dirname(job_path), info.world_size, info.local_rank)
    t = p.training
    dist = Distributed(info, p.placement, p.job.launch.collective_timeout_minutes)
    tokenizer = load_tokenizer(t.model)
    dataset = TokenizedDataset(p.conversations, ChatTokenizer(tokenizer, t.max_length), tokenizer.pad_token_id)
    order = BatchOrder(len(dataset), dist.world_size, dist.rank, t.per_device_batch_size, t.seed)
    torch.manual_seed(t.seed)
    model = load_model(t, "fp32", dist.device, p.ds_config)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[q for q in model.parameters() if q.requires_grad], config=p.ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
    )
    root = os.path.join(p.output_dir, "checkpoints")
    sync_store = ckpt.CheckpointStore(root, dist, keep=2)
    commits: list[float] = []
    async_store = ckpt.CheckpointStore(root, dist, keep=2)
    saves = BackgroundSaves(async_store, on_commit=lambda path, s: commits.append(s))
    engine.train()
    step = 0

    def train_step() -> float:
        nonlocal step
        started = time.perf_counter()
        batch = dataset.collate(order.batch(0, step % order.batches_per_epoch))
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        step += 1
        return time.perf_counter() - started

    def state() -> dict:
        return {"epoch": 0, "batches_consumed": step, "config_digest": p.config_digest, "training": {},
                "lr_scheduler": scheduler.state_dict()}

    def any_rank(flag: bool) -> bool:
        return any(row[0] for row in dist.all_gather_floats([float(flag)]))

    results: dict = {"sync_save_s": [], "async_stall_s": [], "async_commit_s": [], "steps_during_write": [],
                     "step_s_during_write": [], "step_s_idle": [], "load_cold_s": [], "load_warm_s": []}
    for _ in range(3):
        results["step_s_idle"].append(train_step())  # Adam state exists; warm-up steps
    for _ in range(repeats):
        for _ in range(2):
            results["step_s_idle"].append(train_step())
        dist.barrier()
        started = time.perf_counter()
        sync_store.save(engine, step, state())
        results["sync_save_s"].append(time.perf_counter() - started)

        train_step()
        dist.barrier()
        started = time.perf_counter()
        saves.start(engine, step, state())
        results["async_stall_s"].append(time.perf_counter() - started)
        during = []
        # Every rank trains until every rank's save has been committed (then no save is in flight).
        while any_rank(saves.busy):
            during.append(train_step())
        saves.wait()
        results["async_commit_s"].append(commits[-1])
        results["steps_during_write"].append(len(during))
        results["step_s_during_write"] += during

        found = async_store.find_latest()
        if dist.is_main:
            drop_from_page_cache(found.path)
        dist.barrier()
        started = time.perf_counter()
        async_store.load(engine, found)
        dist.barrier()
        results["load_cold_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        async_store.load(engine, found)
        dist.barrier()
        results["load_warm_s"].append(time.perf_counter() - started)
        results["bytes"] = sum(entry["size"] for entry in found.manifest["files"].values())
    results["parameters"] = sum(q.numel() for q in model.parameters())
    if dist.is_main:
        Path(out_path).write_text(json.dumps(results))
    dist.close()


def dd_speeds(directory: Path, megabytes: int, repeats: int) -> dict:
    """MB/s of dd's sequential write (fdatasync) and cold read of a file of `megabytes`."""
    target = directory / "dd.bin"
    write, read = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={megabytes}", "conv=fdatasync"],
                       check=True, capture_output=True)
        write.append(megabytes * 2**20 / 1e6 / (time.perf_counter() - started))
        subprocess.run(["dd", f"if={target}", "iflag=nocache", "count=0"], check=True, capture_output=True)
        started = time.perf_counter()
        subprocess.run(["dd", f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True)
        read.append(megabytes * 2**20 / 1e6 / (time.perf_counter() - started))
    target.unlink()
    return {"dd_write_mb_s": write, "dd_read_mb_s": read}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", help="keep files here (default: a temporary folder)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", nargs=3, metavar=("JOB", "REPEATS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2])
        return

    import yaml

    from jobgen.train.tiny import build

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jobgen-checkpoint-io-"))
    build(str(workdir / "tiny"), conversations=64, hidden_size=args.hidden_size, layers=args.layers)
    shutil.rmtree(workdir / "output", ignore_errors=True)
    job = workdir / "job.yaml"
    job.write_text(yaml.safe_dump(job_dict(workdir, args.nproc)))
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", f"--master_port={free_port()}",
         str(Path(__file__).resolve()), "--worker", str(job), str(args.repeats), str(workdir / "worker.json")],
        check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    figures = json.loads((workdir / "worker.json").read_text())
    megabytes = figures["bytes"] / 1e6
    figures.update(dd_speeds(workdir, round(figures["bytes"] / 2**20), args.repeats))
    median = {key: statistics.median(value) for key, value in figures.items() if isinstance(value, list) and value}
    summary = {
        "command": "PYTHONPATH=src python " + " ".join([os.path.relpath(__file__, REPO), *sys.argv[1:]]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average_1_5_15_min_at_end": [round(x, 1) for x in os.getloadavg()],
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, {platform.machine()}, Linux {platform.release()}",
        "model": f"Llama hidden {args.hidden_size}, {args.layers} layers, {figures['parameters'] / 1e6:.1f} M parameters, "
                 f"full fine-tune, ZeRO-2, fp32, AdamW, {args.nproc} ranks (gloo)",
        "checkpoint_mb": round(megabytes, 1),
        "medians": {key: round(value, 4) for key, value in median.items()},
        "sync_save_mb_s": round(megabytes / median["sync_save_s"], 1),
        "async_commit_mb_s": round(megabytes / median["async_commit_s"], 1),
        "load_cold_mb_s": round(megabytes / median["load_cold_s"], 1),
        "load_warm_mb_s": round(megabytes / median["load_warm_s"], 1),
        "stall_ratio": round(median["async_stall_s"] / median["sync_save_s"], 3),
        "raw": figures,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "raw"}, indent=1))
    print(f"stall of a background save / synchronous save: {summary['stall_ratio']:.3f} (target <= 0.25)")


if __name__ == "__main__":
    main()
