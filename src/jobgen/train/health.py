"""The health gate: after the process group forms and before any model weight is read, every node
shows what it has, and a node that differs from the others ends the job with one line naming it.

Per node (its local rank 0 gathers these; the other ranks only say which device they are on):
- the GPUs the job asked for: count, names, driver and CUDA versions on a GPU job, and that each
  rank is on a device of its own;
- the versions of Python, torch, deepspeed, transformers, peft, bitsandbytes and jobgen, and a
  hash of jobgen's installed source files;
- the data file's size and SHA-256, and a local model folder's config and weight index, hashed
  once per node and cached in RUN_DIR/health-cache/NODE.json by (path, size, mtime), so that a
  restart does not read a large file again;
- figures: the all-reduce bus bandwidth of the whole job (nccl-tests' busbw = algbw * 2(n-1)/n, a
  few sizes) and each rank's matmul rate, compared with the job's median.

The outcome goes to RUN_DIR/health.json (per node: found, differed, figures) and one summary line
per segment to RUN_DIR/health.jsonl. A fact that differs between nodes is a mismatch (the job
fails, not requeued: a person must fix the environment); a node with fewer GPUs than asked, two
ranks on one GPU or a GPU far slower than the others is that node's problem (requeued without it).
On the CPU the figures are recorded but decide nothing: a CPU node's cores are often shared.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import socket
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Optional

from jobgen.errors import UserError
from jobgen.rundir.files import HEALTH, HEALTH_CACHE, HEALTH_HISTORY
from jobgen.train.exit_report import now_iso, write_json_atomically

log = logging.getLogger("jobgen.train")

PACKAGES = ("torch", "deepspeed", "transformers", "peft", "bitsandbytes", "jobgen")
# A GPU below this fraction of the job's median matmul rate is a slow node.
SLOW_FRACTION = 0.5
CHUNK = 8 * 2**20


def node_name() -> str:
    """The scheduler's name for this node (node.sh sets it from the job's node list; Slurm's own,
    on a cluster of virtual nodes too), else the host's."""
    return os.environ.get("JOBGEN_NODE_NAME") or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


class HealthCheckFailed(Exception):
    """The gate found problems: `lines`, one per problem; `nodes`, those to exclude on a requeue
    (only when every problem belongs to a node of its own; a mismatch is nobody's to exclude)."""

    def __init__(self, lines: list[str], nodes: list[str], node_attributed: bool) -> None:
        super().__init__("health check: " + "; ".join(lines))
        self.lines, self.nodes, self.node_attributed = lines, nodes, node_attributed


# ------------------------------------------------------------------ facts
def package_versions() -> dict[str, Optional[str]]:
    found: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def source_hash() -> str:
    """SHA-256 over the installed jobgen package's files (names and contents), byte-compiled ones aside."""
    import jobgen

    root = os.path.dirname(os.path.abspath(jobgen.__file__))
    digest = hashlib.sha256()
    for folder, dirs, names in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            with open(path, "rb") as handle:
                digest.update(handle.read())
    return digest.hexdigest()[:16]


# A file this large is hashed with a line saying so (at the first start on a node: later starts
# read the node's cache), and its progress reaches the hang supervisor as it goes.
LARGE_FILE = 2**30
PROGRESS_EVERY = 1.0  # seconds between progress reports while hashing


def hash_into(digest: Any, handle: Any, chunk: int, done: int, progress: Optional[Callable[[int], None]]) -> int:
    """Reads `handle` into `digest` by `chunk` bytes, telling `progress` the bytes read so far
    (`done` before this file) about once a second; returns the new total. Both hash caches (this
    module's, the store's) read files through it."""
    reported = time.monotonic()
    while block := handle.read(chunk):
        digest.update(block)
        done += len(block)
        if progress is not None and time.monotonic() - reported >= PROGRESS_EVERY:
            progress(done)
            reported = time.monotonic()
    return done


class HashCache:
    """Content hashes by (path, size, mtime), one JSON file per node in RUN_DIR/health-cache.
    `progress(bytes hashed so far)` is called about once a second while a file is read: hashing
    a large data set at its first start can take longer than the start-up's hang bound."""

    def __init__(self, run_dir: str, node: str, progress: Optional[Callable[[int], None]] = None) -> None:
        self.path = os.path.join(run_dir, HEALTH_CACHE, f"{node}.json")
        try:
            with open(self.path, encoding="utf-8") as handle:
                self.entries: dict[str, str] = json.load(handle)
        except (OSError, ValueError):
            self.entries = {}
        self.hits = self.misses = 0
        self.hashed = 0  # bytes read by this cache's misses
        self.progress = progress

    def file_hash(self, path: str) -> dict[str, Any]:
        stat = os.stat(path)
        key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
        if key in self.entries:
            self.hits += 1
        else:
            self.misses += 1
            if stat.st_size >= LARGE_FILE:
                log.info("health check: hashing %s (%.1f GB) on this node for the first time; later starts read "
                         "its hash from %s", path, stat.st_size / 1e9, self.path)
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                self.hashed = hash_into(digest, handle, CHUNK, self.hashed, self.progress)
            self.entries[key] = digest.hexdigest()
        return {"size": stat.st_size, "sha256": self.entries[key]}

    def save(self) -> None:
        if self.misses:
            write_json_atomically(self.path, self.entries)


def data_hash(cache: HashCache, data: Any) -> dict[str, Any]:
    """Size and SHA-256 of training.data: a file's own, else of its files (a folder's data files) together."""
    from jobgen.job.sources import data_files

    files = data_files(data)
    if len(files) == 1:
        return cache.file_hash(files[0])
    each = [cache.file_hash(name) for name in files]
    digest = hashlib.sha256("\n".join(facts["sha256"] for facts in each).encode()).hexdigest()
    return {"size": sum(facts["size"] for facts in each), "sha256": digest}


def _said(data: Any) -> str:
    return data if isinstance(data, str) else ", ".join(data)


def model_folder_facts(folder: str, cache: HashCache) -> dict[str, Any]:
    """A local model folder: its config and weight index hashed, its weight files' names and sizes
    (a sharded model's index names them; a single-file model is its one weight file)."""
    facts: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == "config.json" or name.endswith(".index.json"):
            facts[name] = cache.file_hash(path)["sha256"][:16]
        elif name.endswith((".safetensors", ".bin")) and os.path.isfile(path):
            facts[name] = f"{os.path.getsize(path)} bytes"
    return facts


def gpu_facts(asked: int) -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    facts: dict[str, Any] = {"visible": count, "asked": asked, "names": ", ".join(names), "cuda": torch.version.cuda}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        facts["driver"] = ",".join(sorted(set(out.stdout.split()))) or None
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    return facts


def device_id(cuda: bool, local_rank: int) -> Optional[str]:
    if not cuda:
        return None
    import torch

    props = torch.cuda.get_device_properties(local_rank)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{getattr(props, 'pci_bus_id', '?')}:{getattr(props, 'pci_device_id', local_rank)}"


# ---------------------------------------------------------------- figures
def bus_bandwidth(dist: Any, sizes: tuple[int, ...], iterations: int = 5) -> dict[str, float]:
    """All-reduce bus bandwidth in GB/s per message size (bytes), as nccl-tests computes it:
    algbw = size / time, busbw = algbw * 2 (n - 1) / n. The same iterations on every rank."""
    import torch
    import torch.distributed as tdist

    n = dist.world_size
    figures = {}
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=dist.device)
        tdist.all_reduce(tensor)  # warm-up: connections, buffers
        _sync(dist)
        started = time.perf_counter()
        for _ in range(iterations):
            tdist.all_reduce(tensor)
        _sync(dist)
        seconds = (time.perf_counter() - started) / iterations
        figures[str(size)] = round(size / seconds * (2 * (n - 1) / n) / 1e9, 3) if n > 1 else 0.0
    return figures


def matmul_rate(cuda: bool, device: Any) -> float:
    """TFLOP/s of square matmuls on this rank's device (bf16 on a GPU, fp32 on the CPU)."""
    import torch

    size, dtype, repeats = (4096, torch.bfloat16, 20) if cuda else (384, torch.float32, 8)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.matmul(a, b)
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    if cuda:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return round(2 * size**3 * repeats / seconds / 1e12, 4)


def _sync(dist: Any) -> None:
    if dist.cuda:
        import torch

        torch.cuda.synchronize(dist.device)


# ------------------------------------------------------------- comparing
def describe(key: str, value: Any) -> str:
    if key.startswith("data ") or key.startswith("model "):
        return f"{key} {value}"
    return f"{key} {value if value is not None else 'not installed'}"


def compare(nodes: dict[str, dict[str, Any]], reference: str) -> tuple[list[str], dict[str, list[str]]]:
    """Facts that differ between nodes: one line per node off the majority (ties: `reference`'s
    value is taken as right), e.g. "node gpu17: torch 2.5.1, the other 3 nodes 2.6.0"."""
    lines: list[str] = []
    differed: dict[str, list[str]] = {name: [] for name in nodes}
    keys = sorted({key for facts in nodes.values() for key in facts})
    for key in keys:
        values = {name: json.dumps(facts.get(key), sort_keys=True) for name, facts in nodes.items()}
        counts = Counter(values.values())
        if len(counts) < 2:
            continue
        top = max(counts.values())
        majority = values[reference] if counts[values[reference]] == top else next(v for v, c in counts.items() if c == top)
        others = counts[majority]
        right = json.loads(majority)
        for name, value in values.items():
            if value == majority:
                continue
            differed[name].append(key)
            other = "the other node" if others == 1 else f"the other {others} nodes"
            lines.append(f"node {name}: {describe(key, json.loads(value))}, {other} {_short(right)}")
    return lines, differed


def _short(value: Any) -> str:
    return "not installed" if value is None else str(value)


def flatten(facts: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in facts.get("versions", {}).items():
        flat[key] = value
    flat["jobgen source"] = facts.get("jobgen_source")
    if "data" in facts:
        flat["data size"] = facts["data"].get("size")
        flat["data sha256"] = (facts["data"].get("sha256") or "")[:16] or facts["data"].get("error")
    for name, value in facts.get("model", {}).items():
        flat[f"model {name}"] = value
    gpus = facts.get("gpus")
    if gpus:
        for key in ("names", "driver", "cuda"):
            flat[f"GPU {key}"] = gpus.get(key)
    return flat


@dataclass
class Gate:
    """Runs the check on every rank; `phases` holds where its time went (seconds)."""

    dist: Any
    run_dir: str
    data: Any  # training.data: a path or a list
    model: str
    gpus_per_node: int
    progress: Optional[Callable[[int], None]] = None  # the rank's heartbeat, while the files are hashed
    phases: dict[str, float] = field(default_factory=dict)

    def _mark(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - since, 3)
        return now

    def run(self) -> dict[str, Any]:
        dist = self.dist
        started = t = time.perf_counter()
        node = node_name()
        mine: dict[str, Any] = {"node": node, "rank": dist.rank, "local_rank": dist.local_rank,
                                "device": device_id(dist.cuda, dist.local_rank)}
        cache_hits = cache_misses = 0
        if dist.local_rank == 0:
            facts: dict[str, Any] = {"versions": package_versions(), "jobgen_source": source_hash(),
                                     "host": socket.gethostname()}
            if self.gpus_per_node:
                facts["gpus"] = gpu_facts(self.gpus_per_node)
            t = self._mark("versions and source", t)
            cache = HashCache(self.run_dir, node, self.progress)
            try:
                facts["data"] = {"path": _said(self.data), **data_hash(cache, self.data)}
            except (OSError, UserError) as exc:
                facts["data"] = {"path": _said(self.data), "error": getattr(exc, "strerror", None) or str(exc)}
            t = self._mark("data hash", t)
            if os.path.isdir(self.model):
                facts["model"] = model_folder_facts(self.model, cache)
            cache.save()
            cache_hits, cache_misses = cache.hits, cache.misses
            t = self._mark("model hash", t)
            mine["facts"] = facts
        everyone = dist.all_gather_object(mine)
        t = self._mark("exchange", t)
        sizes = (2**22, 2**24, 2**26) if dist.cuda else (2**18, 2**20, 2**22)
        busbw = bus_bandwidth(dist, sizes) if dist.world_size > 1 else {}
        t = self._mark("bandwidth", t)
        rate = matmul_rate(dist.cuda, dist.device)
        t = self._mark("matmul", t)
        rates = dist.all_gather_floats([rate, time.perf_counter() - started, float(cache_misses), float(cache_hits)])
        self._mark("exchange", t)
        return self._judge(everyone, [row[0] for row in rates], busbw, [int(row[2]) for row in rates])

    def _judge(self, everyone: list[dict], rates: list[float], busbw: dict[str, float], misses: list[int]) -> dict[str, Any]:
        dist = self.dist
        nodes: dict[str, dict[str, Any]] = {}
        order: list[str] = []
        for entry in everyone:
            name = entry["node"]
            if name not in nodes:
                order.append(name)
                nodes[name] = {"ranks": [], "found": {}, "figures": {"matmul_tflops": {}}}
            nodes[name]["ranks"].append(entry["rank"])
            nodes[name]["figures"]["matmul_tflops"][str(entry["rank"])] = rates[entry["rank"]]
            if "facts" in entry:
                nodes[name]["found"] = entry["facts"]
        mismatches, differed = compare({name: flatten(nodes[name]["found"]) for name in order}, order[0])
        node_problems: list[tuple[str, str]] = []
        for name in order:
            found = nodes[name]["found"]
            gpus = found.get("gpus")
            if gpus and gpus["visible"] < gpus["asked"]:
                node_problems.append((name, f"node {name}: {gpus['visible']} of {gpus['asked']} GPUs visible"))
            if found.get("data", {}).get("error"):
                node_problems.append((name, f"node {name}: data file {found['data']['path']}: {found['data']['error']}"))
        if dist.cuda:
            devices: dict[tuple[str, str], list[int]] = {}
            for entry in everyone:
                devices.setdefault((entry["node"], entry["device"]), []).append(entry["rank"])
            for (name, device), ranks in devices.items():
                if len(ranks) > 1:
                    node_problems.append((name, f"node {name}: ranks {', '.join(map(str, ranks))} share one GPU ({device})"))
        median = statistics.median(rates)
        slow = [(entry["node"], entry["rank"]) for entry in everyone if rates[entry["rank"]] < SLOW_FRACTION * median]
        notes = [f"node {name}: rank {rank} matmul {rates[rank]:.3g} TFLOP/s, the job's median {median:.3g}" for name, rank in slow]
        if dist.cuda:  # on the CPU a shared core makes this noise: recorded, not held against the node
            node_problems += [(name, line) for (name, _), line in zip(slow, notes)]
        for name in order:
            nodes[name]["differed"] = differed.get(name, [])
            nodes[name]["figures"]["bus_bandwidth_gbps"] = busbw
        problems = mismatches + [line for _, line in node_problems]
        outcome = {
            "job_id": os.environ.get("JOBGEN_JOB_ID"), "restart": _int_env("JOBGEN_RESTART_COUNT"), "at": now_iso(),
            "ok": not problems, "problems": problems, "notes": [] if dist.cuda else notes,
            "backend": dist.backend, "world_size": dist.world_size,
            "bus_bandwidth_gbps": busbw, "bus_bandwidth_best_gbps": max(busbw.values(), default=None),
            "matmul_tflops_median": median, "hashed_files": sum(misses),
            "phases": self.phases, "nodes": nodes,
        }
        if mismatches:
            bad = sorted({name for name in order if differed.get(name)})
            outcome["failure"] = "mismatch"
        elif node_problems:
            bad = sorted({name for name, _ in node_problems})
            outcome["failure"] = "node"
        else:
            bad = []
        outcome["bad_nodes"] = bad
        return outcome


def _int_env(name: str) -> Optional[int]:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return None


def record(run_dir: str, outcome: dict[str, Any]) -> None:
    write_json_atomically(os.path.join(run_dir, HEALTH), outcome)
    summary = {k: outcome.get(k) for k in ("job_id", "restart", "at", "ok", "problems", "bus_bandwidth_best_gbps",
                                             "matmul_tflops_median", "hashed_files", "phases", "bad_nodes")}
    with open(os.path.join(run_dir, HEALTH_HISTORY), "a", encoding="utf-8") as handle:
        handle.write(json.dumps(summary) + "\n")


def check(dist: Any, run_dir: str, data: Any, model: str, gpus_per_node: int,
          progress: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """Collective: runs the gate, rank 0 records it; raises HealthCheckFailed on every rank.
    `progress`: the rank's heartbeat, told the bytes hashed so far while a file is read."""
    gate = Gate(dist, run_dir, data, model, gpus_per_node, progress)
    started = time.perf_counter()
    outcome = gate.run()
    outcome["seconds"] = round(time.perf_counter() - started, 3)
    if dist.is_main:
        record(run_dir, outcome)
        best = outcome["bus_bandwidth_best_gbps"]
        log.info("health check of %d node(s) in %.1f s (%s): %s; all-reduce bus bandwidth %s",
                 len(outcome["nodes"]), outcome["seconds"],
                 ", ".join(f"{k} {v:.2f} s" for k, v in gate.phases.items()),
                 "ok" if outcome["ok"] else f"{len(outcome['problems'])} problem(s)",
                 f"{best:.3f} GB/s" if best is not None else "- (one rank)")
        for line in outcome["notes"]:
            log.info("health note (not held against the node on the CPU): %s", line)
    if not outcome["ok"]:
        raise HealthCheckFailed(outcome["problems"], outcome["bad_nodes"], outcome.get("failure") == "node")
    return outcome
