"""Useful (non-padding) tokens per second: padding to max_length, padding to the longest in the
batch (jobgen without packing), and training.packing, on the same conversations in one run.

    PYTHONPATH=src python benchmarks/packing.py [--conversations 192] [--max-length 1024] [--rounds 3]
        [--batch 8] [--hidden-size 256] [--layers 4] [--attention sdpa] [--out packing.json]

Data, generated on the spot: short multi-turn chats with a long tail (1-4 exchanges, words per
turn log-normal, median 12, cut to max_length by the chat layout), tokenized by jobgen's chat
layout with the tiny model's tokenizer. Model: a random Llama (jobgen.train.tiny) loaded as the
trainer loads it, LoRA r 16, fp32, the trainer's loss (jobgen.train.trainer._token_loss_sum) and
collation (TokenizedDataset.collate / collate_packed, packed rows from pack_rows). Each timed unit
is one micro-batch: forward, backward and an AdamW step (torch's, in one process, in place of
DeepSpeed's). The same per_device_batch_size (--batch) in every mode: samples when padding, rows
when packing, so padding to max_length and packing run tensors of the same shape.
A pass trains every conversation once; the modes take turns pass by pass (--rounds times each),
and each mode's figure is the median over its passes of useful tokens / pass wall time (and, less
sensitive to other work on the machine, / the process's CPU time). Prints, and writes as JSON,
the medians and the ratios packing / pad-to-max and packing / pad-to-longest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Mostly short chats, a few long ones: words per turn ~ lognormal(median 12, sigma 1.0)."""
    from jobgen.train.tiny import _WORDS

    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(max(1, int(rng.lognormvariate(2.5, 1.0)))))

    items = []
    for index in range(count):
        turns = []
        for _ in range(rng.choice((1, 1, 2, 2, 3, 4))):
            turns += [{"from": "user", "value": text()}, {"from": "assistant", "value": text()}]
        items.append({"id": f"chat-{index}", "conversations": turns})
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=192)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attention", default="sdpa", help="transformers attn_implementation (sdpa, eager, ...)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="packing.json")
    args = parser.parse_args()

    import torch

    from jobgen.job.models import Training
    from jobgen.job.conversations import load_conversations
    from jobgen.train.data import ChatTokenizer, TokenizedDataset, pack_rows
    from jobgen.train.modeling import load_model, load_tokenizer
    from jobgen.train.tiny import build
    from jobgen.train.trainer import _token_loss_sum

    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="jobgen-packing-"))
    build(str(workdir), conversations=64, hidden_size=args.hidden_size, layers=args.layers)
    training = Training(model=str(workdir / "model"), data=str(workdir / "data.json"), method="lora",
                        precision="fp32", max_length=args.max_length, lora={"r": 16, "alpha": 32, "dropout": 0.0})
    tokenizer = load_tokenizer(training.model)
    (workdir / "chats.json").write_text(json.dumps(conversations(args.conversations)))
    items = load_conversations(str(workdir / "chats.json"))
    dataset = TokenizedDataset(items, ChatTokenizer(tokenizer, args.max_length), tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = load_model(training, "fp32", torch.device("cpu"))
    model.set_attn_implementation(args.attention)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    order = list(range(len(dataset)))
    random.Random(1).shuffle(order)  # as the sampler would: batches of random lengths
    batches = [order[i:i + args.batch] for i in range(0, len(order), args.batch)]
    rows = pack_rows(dataset.lengths, args.max_length, seed=1, world_size=1)
    random.Random(1).shuffle(rows)
    row_batches = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]

    def pad_to_max(indices):
        batch = dataset.collate(indices)
        extra = args.max_length - batch["input_ids"].size(1)
        pad = {"input_ids": dataset.pad_id, "attention_mask": 0, "labels": -100}
        return {k: torch.nn.functional.pad(v, (0, extra), value=pad[k]) for k, v in batch.items()}

    modes = {
        "pad_to_max_length": [pad_to_max(b) for b in batches],
        "pad_to_longest": [dataset.collate(b) for b in batches],
        "packed": [dataset.collate_packed(b) for b in row_batches],
    }
    useful = sum(dataset.lengths)
    computed = {name: sum(b["input_ids"].numel() for b in tensors) for name, tensors in modes.items()}

    def one_pass(tensors) -> tuple[float, float]:
        """Wall seconds and this process's CPU seconds (less sensitive to other load on the machine)."""
        started, cpu = time.perf_counter(), time.process_time()
        for batch in tensors:
            optimizer.zero_grad(set_to_none=True)
            loss_sum = _token_loss_sum(model, batch)
            (loss_sum / max(1, int((batch["labels"][:, 1:] != -100).sum()))).backward()
            optimizer.step()
        return time.perf_counter() - started, time.process_time() - cpu

    one_pass(modes["packed"][:1] + modes["pad_to_longest"][:1])  # warm-up: first-call allocations
    load_before = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    cpu_seconds: dict[str, list[float]] = {name: [] for name in modes}
    for round_ in range(args.rounds):
        for name in (list(modes) if round_ % 2 == 0 else list(reversed(modes))):
            wall, cpu = one_pass(modes[name])
            seconds[name].append(round(wall, 2))
            cpu_seconds[name].append(round(cpu, 2))
            print(f"round {round_ + 1} {name}: {wall:.1f} s ({cpu:.1f} s CPU)", flush=True)

    tokens_per_s = {name: statistics.median(useful / s for s in runs) for name, runs in seconds.items()}
    per_cpu_s = {name: statistics.median(useful / s for s in runs) for name, runs in cpu_seconds.items()}
    lengths = sorted(dataset.lengths)
    result = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "conversations": len(dataset), "useful_tokens": useful,
        "length_median": lengths[len(lengths) // 2], "length_p90": lengths[int(len(lengths) * 0.9)],
        "length_max": lengths[-1], "max_length": args.max_length, "batch": args.batch, "attention": args.attention,
        "rows": len(rows), "row_fill": round(useful / (len(rows) * args.max_length), 3),
        "computed_tokens": computed, "pass_seconds": seconds, "pass_cpu_seconds": cpu_seconds,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "useful_tokens_per_s_median": {k: round(v, 1) for k, v in tokens_per_s.items()},
        "packed_over_pad_to_max": round(tokens_per_s["packed"] / tokens_per_s["pad_to_max_length"], 2),
        "packed_over_pad_to_longest": round(tokens_per_s["packed"] / tokens_per_s["pad_to_longest"], 2),
        "useful_tokens_per_cpu_s_median": {k: round(v, 1) for k, v in per_cpu_s.items()},
        "per_cpu_s_packed_over_pad_to_max": round(per_cpu_s["packed"] / per_cpu_s["pad_to_max_length"], 2),
        "per_cpu_s_packed_over_pad_to_longest": round(per_cpu_s["packed"] / per_cpu_s["pad_to_longest"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    print(
        f"useful tokens/s (median of {args.rounds}): pad to max_length {tokens_per_s['pad_to_max_length']:,.0f}, "
        f"pad to longest {tokens_per_s['pad_to_longest']:,.0f}, packed {tokens_per_s['packed']:,.0f}; "
        f"packed is {result['packed_over_pad_to_max']}x pad-to-max and {result['packed_over_pad_to_longest']}x "
        "pad-to-longest"
    )


def _cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
