"""Preparing the data: the old per-rank tokenization against the prepared store, on this machine.

    PYTHONPATH=src python benchmarks/data_prepare.py [--conversations 100000] [--repeats 3]
        [--old-conversations 10000] [--processes N] [--datasets] [--jsonl] [--variants prepare ...]

Generates `--conversations` ShareGPT conversations (1 to 8 exchanges, a system prompt in one of
four, messages of 3 to 600 words drawn log-normally, some with numbers, lists and code), a JSON
array as users give it, and the tiny model's byte-level tokenizer (jobgen.train.tiny). Then, each
variant in a fresh process, alternating, `--repeats` times:

  - old: what every rank did at every start before the store: load_conversations, then
    TokenizedDataset (ChatTokenizer, one tokenizer call per turn, Python lists), on the first
    `--old-conversations` conversations, a file of its own (the old path is linear in the data;
    its full run takes minutes per repeat). Reports tokens/s on its one CPU and the rank's RSS growth per conversation.
  - prepare: jobgen.train.store.ensure_store into an empty folder (what `jobgen prepare` and local
    rank 0 do) with `--processes` workers (default: every usable CPU): tokens/s per CPU.
  - restart: ensure_store finding that store, then MicroBatches.build and a first batch, as a
    restarted rank's data phase does (torch and transformers imported before, as there):
    the data phase's seconds, and the rank's RSS growth (RssAnon: private; RssFile: the mapped
    store's pages, which are the page cache's, shared by every rank of the node), also after
    reading every token once (a rank's epoch).
With `--datasets`, also, once after the repeats, the Hugging Face `datasets` map path (Dataset.from_list of the records
jobgen reads, then map with the same ChatTokenizer, batched, num_proc = the processes), if the
package is installed (or in `--datasets-path`, a folder `pip install --target` filled).

`--vocab-size N` tokenizes with a byte-level BPE tokenizer of N tokens trained on the first 2,000
generated conversations (as a real model's tokenizer is trained on text like what it reads: whole
words as one token), instead of the tiny model's 384, which splits every word into several
tokens and so makes the tokenizer's own per-token work most of the cost. `--tokenizer DIR` tokenizes
with the tokenizer saved in DIR (a real model's, or Mistral's Tekken made by
benchmarks/tekken_tokenizer.py from a file the `mistral-common` package ships).

`--jsonl` writes the data as JSONL, which the store's preparation reads line by line (a JSON array
is one document, parsed whole); `--variants prepare` runs the preparation alone and prints the
peak RSS of the preparing process and of a worker.

Prints one JSON line per measurement and a table of medians, with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = (
    "the a of to and in is that for it with as on be at by this from or have an which not are but can model data "
    "training loss gradient batch token sequence node cluster job queue memory file disk network rank step epoch "
    "learning rate schedule warmup checkpoint resume python function value error result question answer example "
    "because however therefore although first second then finally important simple complex fast slow large small"
).split()
SYSTEMS = ["You are a helpful assistant.", "You answer briefly and precisely.", "You are an expert HPC engineer."]


def message(rng: random.Random) -> str:
    words = max(3, min(600, int(rng.lognormvariate(3.8, 0.9))))
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    kind = rng.random()
    if kind < 0.15:
        text += "\n\n" + "\n".join(f"{i + 1}. {' '.join(rng.choice(WORDS) for _ in range(8))}" for i in range(rng.randint(2, 6)))
    elif kind < 0.25:
        text += f"\n\n```python\ndef f(x):\n    return x * {rng.randint(2, 999)} + {rng.random():.4f}\n```"
    elif kind < 0.4:
        text += " " + ", ".join(str(rng.randint(0, 10**6)) for _ in range(rng.randint(2, 10)))
    return text[0].upper() + text[1:] + "."


def generate(path: Path, count: int, seed: int = 0, jsonl: bool = False) -> None:
    """A JSON array, or with `jsonl` the same records one a line."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("" if jsonl else "[\n")
        for index in range(count):
            turns = []
            if rng.random() < 0.25:
                turns.append({"from": "system", "value": rng.choice(SYSTEMS)})
            for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4, 8))):
                turns += [{"from": "human", "value": message(rng)}, {"from": "gpt", "value": message(rng)}]
            handle.write(json.dumps({"id": f"c{index:07d}", "conversations": turns}))
            handle.write("\n" if jsonl or index + 1 == count else ",\n")
        handle.write("" if jsonl else "]\n")


def memory() -> dict:
    status = {}
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                status[key] = int(value.split()[0]) / 1024  # MB
    return status


def cpu_seconds() -> float:
    """CPU time of this process and its finished workers: what the work cost, whatever the load."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# --- the variants, each run in its own process ----------------------------------------------------


def run_old(data: str, model: str, count: int) -> dict:
    from jobgen.job.conversations import load_conversations
    from jobgen.train.data import ChatTokenizer, TokenizedDataset
    from jobgen.train.modeling import load_tokenizer

    tokenizer = load_tokenizer(model)
    before = memory()
    started, cpu = time.perf_counter(), cpu_seconds()
    conversations = load_conversations(data)  # a file of `count` conversations: a rank of the old path parsed its whole file
    dataset = TokenizedDataset(conversations, ChatTokenizer(tokenizer, 2048), tokenizer.pad_token_id)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    after = memory()
    tokens = sum(dataset.lengths)
    return {"conversations": len(dataset), "tokens": tokens, "seconds": seconds, "tokens_per_s_per_cpu": tokens / seconds,
            "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu,
            "rss_growth_mb": after["VmRSS"] - before["VmRSS"], "peak_rss_mb": after["VmHWM"]}


def _training(data: str, model: str, cache: str):
    from jobgen.job.models import Training

    return Training(model=model, data=data, max_length=2048, prepared_cache=cache)


def run_prepare(data: str, model: str, cache: str, processes: int) -> dict:
    from jobgen.train.modeling import load_tokenizer
    from jobgen.train.store import ensure_store

    tokenizer = load_tokenizer(model)
    started, cpu = time.perf_counter(), cpu_seconds()
    dataset, outcome = ensure_store(_training(data, model, cache), cache, lambda: tokenizer, True, processes=processes)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    assert outcome == "prepared", outcome
    tokens = int(dataset.meta["tokens"])
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"conversations": len(dataset), "tokens": tokens, "seconds": seconds, "processes": processes,
            "tokens_per_s_per_cpu": tokens / seconds / processes, "peak_rss_mb": memory()["VmHWM"],
            "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu,
            "worker_peak_rss_mb": children}


def run_restart(data: str, model: str, cache: str) -> dict:
    import numpy as np

    from jobgen.train.data import MicroBatches
    from jobgen.train.modeling import load_tokenizer
    from jobgen.train.store import ensure_store

    import torch  # noqa: F401 - imported before, as the trainer's imports phase does
    import transformers  # noqa: F401

    before = memory()
    started = time.perf_counter()  # the trainer's data phase: the store found and mapped, the order
    dataset, outcome = ensure_store(_training(data, model, cache), cache, lambda: load_tokenizer(model), False)
    batches = MicroBatches.build(dataset, 16, 8, 0, 2, 1, 42, False, None)
    batches.collate(batches.units(0, 0, 0))
    seconds = time.perf_counter() - started
    assert outcome == "found", outcome
    mapped = memory()
    checksum = int(np.sum(dataset.token_ids, dtype=np.int64))  # every page read once: a rank's epoch
    read = memory()
    return {"seconds": seconds, "rss_growth_mb": mapped["VmRSS"] - before["VmRSS"],
            "anon_growth_mb": mapped["RssAnon"] - before["RssAnon"],
            "after_epoch_anon_growth_mb": read["RssAnon"] - before["RssAnon"],
            "after_epoch_file_mb": read["RssFile"] - before["RssFile"], "checksum": checksum}


_DATASETS_CHAT: dict = {}


def datasets_encode(batch: dict, model: str) -> dict:
    """The map function: the per-conversation ChatTokenizer, as a trainer built on datasets would call it."""
    from jobgen.job.conversations import Conversation
    from jobgen.train.data import ChatTokenizer
    from jobgen.train.modeling import load_tokenizer

    if model not in _DATASETS_CHAT:  # once per worker process
        _DATASETS_CHAT[model] = ChatTokenizer(load_tokenizer(model), 2048)
    chat = _DATASETS_CHAT[model]
    out: dict = {"input_ids": [], "labels": []}
    for system, roles, texts in zip(batch["system"], batch["roles"], batch["texts"]):
        ids, labels = chat(Conversation("", system, tuple(zip(roles, texts))))
        out["input_ids"].append(ids)
        out["labels"].append(labels)
    return out


def run_datasets(data: str, model: str, processes: int) -> dict:
    if os.environ.get("BENCH_DATASETS_PATH"):  # appended: this environment's own packages still win
        sys.path.append(os.environ["BENCH_DATASETS_PATH"])
    import datasets

    from jobgen.job.conversations import load_conversations

    datasets.disable_caching()
    started, cpu = time.perf_counter(), cpu_seconds()
    # The records as the trainer reads them (jobgen's reader): datasets' own JSON loader cannot
    # hold ShareGPT's optional system turn and mixed turns in one Arrow schema without a cast.
    rows = [{"system": c.system, "roles": [r for r, _ in c.turns], "texts": [t for _, t in c.turns]}
            for c in load_conversations(data)]
    import pyarrow

    # A fingerprint given: datasets would otherwise hash the whole table with dill.
    table = datasets.Dataset(pyarrow.Table.from_pylist(rows), fingerprint="jobgen-benchmark-rows")
    del rows
    mapped = table.map(datasets_encode, fn_kwargs={"model": model}, batched=True, num_proc=processes,
                       remove_columns=table.column_names, new_fingerprint="jobgen-benchmark")
    tokens = sum(len(x) for x in mapped["input_ids"])
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    return {"tokens": tokens, "seconds": seconds, "processes": processes, "tokens_per_s_per_cpu": tokens / seconds / processes,
            "cpu_seconds": cpu, "tokens_per_cpu_second": tokens / cpu, "peak_rss_mb": memory()["VmHWM"]}


def trained_tokenizer(work: Path, data: Path, vocab_size: int, tiny_model: str) -> str:
    """The tiny model's folder with a tokenizer of `vocab_size` trained on the data's first 2,000
    conversations in place of its own (the store reads only the tokenizer)."""
    import shutil

    from jobgen.train.tiny import build_tokenizer

    folder = work / f"vocab-{vocab_size}"
    if not (folder / "tokenizer.json").exists():
        corpus = []
        with open(data, encoding="utf-8") as handle:
            records = (json.loads(line.rstrip(",\n")) for line in handle if line.startswith("{"))
            for _, record in zip(range(2000), records):
                corpus += [turn["value"] for turn in record["conversations"]]
        shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
        build_tokenizer(corpus + ["user\n", "assistant\n", "system\n"], vocab_size).save_pretrained(folder)
    return str(folder)


def given_tokenizer(work: Path, tokenizer: str, tiny_model: str) -> str:
    """The tiny model's folder with the tokenizer saved in `tokenizer` in place of its own."""
    import shutil

    from transformers import AutoTokenizer

    folder = work / f"tokenizer-{Path(tokenizer).resolve().name}"
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return str(folder)


# --- the driver ------------------------------------------------------------------------------------


def in_process(variant: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, __file__, "--run", variant, *args], env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--old-conversations", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=0)
    parser.add_argument("--datasets", action="store_true")
    parser.add_argument("--datasets-path", help="a folder `pip install --target` put datasets in (kept out of this environment)")
    parser.add_argument("--workdir", help="keep the generated data here (default: a temporary folder)")
    parser.add_argument("--jsonl", action="store_true", help="write the data as JSONL (read line by line) instead of a JSON array")
    parser.add_argument("--variants", nargs="+", default=["old", "prepare", "restart"], choices=["old", "prepare", "restart"],
                        help="which to run (the summary needs all three; `prepare` alone prints its peak RSS)")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="a tokenizer of this many tokens trained on the generated text (default: the tiny model's 384)")
    parser.add_argument("--tokenizer", help="a folder with a saved Hugging Face tokenizer to tokenize with instead")
    parser.add_argument("--run", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        variant, *rest = args.run
        function = {"old": run_old, "prepare": run_prepare, "restart": run_restart, "datasets": run_datasets}[variant]
        print(json.dumps(function(*[int(a) if a.isdigit() else a for a in rest])))
        return

    if args.datasets_path:
        os.environ["BENCH_DATASETS_PATH"] = os.path.abspath(args.datasets_path)
    sys.path.insert(0, str(REPO / "src"))
    from jobgen.train.encode import usable_cpus
    from jobgen.train.tiny import build

    processes = args.processes or usable_cpus()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="data-prepare-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"data-{args.conversations}.json{'l' if args.jsonl else ''}"
    if not data.exists():
        generate(data, args.conversations, jsonl=args.jsonl)
    old_data = work / f"data-{args.old_conversations}.json"  # the same first conversations
    if "old" in args.variants and not old_data.exists():
        generate(old_data, args.old_conversations)
    if not (work / "tiny" / "model").exists():
        build(str(work / "tiny"), conversations=16)
    model = str(work / "tiny" / "model")
    if args.vocab_size:
        model = trained_tokenizer(work, data, args.vocab_size, model)
    elif args.tokenizer:
        model = given_tokenizer(work, args.tokenizer, model)
    print(f"# {args.conversations} conversations, {data.stat().st_size / 1e6:.0f} MB; {processes} processes; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        cache = tempfile.mkdtemp(dir=work, prefix="cache-")
        for variant, run_args in (("old", (str(old_data), model, str(args.old_conversations))),
                                  ("prepare", (str(data), model, cache, str(processes))),
                                  ("restart", (str(data), model, cache))):
            if variant not in args.variants:
                continue
            outcome = in_process(variant, *run_args)
            outcome.update(variant=variant, repeat=repeat, load=round(os.getloadavg()[0], 1))
            print(json.dumps(outcome), flush=True)
            results.setdefault(variant, []).append(outcome)
        subprocess.run(["rm", "-rf", cache])
    if args.datasets:  # once: minutes, and a comparison, not a target
        outcome = in_process("datasets", str(data), model, str(processes))
        outcome.update(variant="datasets", repeat=0, load=round(os.getloadavg()[0], 1))
        print(json.dumps(outcome), flush=True)
        results["datasets"] = [outcome]

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    if set(args.variants) != {"old", "prepare", "restart"}:
        if "prepare" in results:
            print(f"\nmedians of {args.repeats}: preparation {median('prepare', 'seconds'):.1f} s; peak RSS of the preparing "
                  f"process {median('prepare', 'peak_rss_mb'):.0f} MB, of a worker {median('prepare', 'worker_peak_rss_mb'):.0f} MB")
        return

    old_rate, new_rate = median("old", "tokens_per_s_per_cpu"), median("prepare", "tokens_per_s_per_cpu")
    old_per_conversation = median("old", "rss_growth_mb") / median("old", "conversations")
    old_rank_mb = old_per_conversation * args.conversations
    print(f"\nmedians of {args.repeats}:")
    print(f"  tokens/s per CPU (wall): old {old_rate / 1e6:.3f} M, prepared store {new_rate / 1e6:.3f} M ({new_rate / old_rate:.1f}x)")
    old_cpu, new_cpu = median("old", "tokens_per_cpu_second"), median("prepare", "tokens_per_cpu_second")
    print(f"  tokens per CPU second: old {old_cpu / 1e6:.3f} M, prepared store {new_cpu / 1e6:.3f} M ({new_cpu / old_cpu:.1f}x)")
    print(f"  tokens/s of the node: old {old_rate / 1e6:.3f} M (one CPU per rank), prepared store "
          f"{new_rate * processes / 1e6:.3f} M ({new_rate * processes / old_rate:.1f}x)")
    print(f"  preparation of {args.conversations}: {median('prepare', 'seconds'):.1f} s on {processes} processes "
          f"({median('prepare', 'tokens') / 1e6:.0f} M tokens); old path, extrapolated from "
          f"{args.old_conversations}: {args.conversations / median('old', 'conversations') * median('old', 'seconds'):.0f} s per rank")
    print(f"  per-rank RSS for the data: old {old_rank_mb:.0f} MB ({old_per_conversation * 1000:.1f} MB per 1000, "
          f"measured on {args.old_conversations}), store {median('restart', 'rss_growth_mb'):.0f} MB "
          f"({median('restart', 'rss_growth_mb') / old_rank_mb:.3f}x); private after an epoch "
          f"{median('restart', 'after_epoch_anon_growth_mb'):.0f} MB, shared page cache {median('restart', 'after_epoch_file_mb'):.0f} MB")
    print(f"  restart's data phase: {median('restart', 'seconds'):.2f} s")
    if args.datasets:
        rate, cpu_rate = median("datasets", "tokens_per_s_per_cpu"), median("datasets", "tokens_per_cpu_second")
        print(f"  datasets map (one run): {median('datasets', 'seconds'):.1f} s, {rate / 1e6:.3f} M tokens/s per CPU "
              f"(store {new_rate / rate:.1f}x), {cpu_rate / 1e6:.3f} M tokens per CPU second (store {new_cpu / cpu_rate:.1f}x)")


if __name__ == "__main__":
    main()
