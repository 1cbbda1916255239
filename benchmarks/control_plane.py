"""The control plane at scale, simulated: file-system operations on the shared run directory
for N nodes x 8 ranks, counted.

    .venv/bin/python benchmarks/control_plane.py [--nodes 4 64 512 4096] [--json OUT]

Runs jobgen's own code against one folder (the run directory) on this machine:

- steady state: each node's hang supervisor (`Supervisor._watch`, the real loop) in a thread of
  its own, over a simulated clock (time.monotonic, time.time and the loop's wait are the
  simulation's; threading's own waits are real), while every node's 8 ranks beat once a second
  through jobgen's Heartbeat writer into the node's local folder (not counted: node-local memory);
- the store's waiting ranks: `prepare_once` on every rank while node 0's preparer builds for
  300 simulated seconds (time.sleep is the simulation's; fcntl.lockf is made exclusive between
  threads, as it is between processes); each node's local rank 0 tells its other ranks through
  the node's relay file (jobgen.train.node_relay), in a node-local folder, not counted;
- the health gate's file work on every node (the hash cache, the data file, the model folder) and
  rank 0's record of it;
- the rank logs of one segment, created as `jobgen.train.console` creates them.

Counted by wrapping os and builtins.open here (nowhere else): every open, stat, create (an open
that may create, mkdir), rename, fsync, listdir and other change (chmod, unlink, utime, link)
whose path is under the run directory, attributed to the simulated node whose thread made it.
Where N is large only a sample of nodes runs (nodes 0-3 always, other nodes drawn at random): the
others' summaries are in place, read as a real node's would be, and the sampled nodes' counts are
scaled to N. Needs the Supervisor's fields and loop, prepare_once with its node relay and the
log names.
"""

from __future__ import annotations

import argparse
import builtins
import errno
import fcntl
import heapq
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("JOBGEN_SRC", os.path.join(ROOT, "src")))

from jobgen.rundir import files as runfiles  # noqa: E402
from jobgen.train import heartbeat, store  # noqa: E402
from jobgen.train.node_relay import NodeRelay  # noqa: E402

RANKS_PER_NODE = 8
SAMPLE = 48  # nodes that run, at most, where N is larger
WARM_UP, MEASURE = 40.0, 120.0  # simulated seconds
PREPARATION = 300.0
KINDS = ("open", "stat", "create", "rename", "fsync", "listdir", "other")


# ------------------------------------------------------------ counting
class Ops:
    """Counts per (node, kind) of operations under `root` made by threads that say their node."""

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root) + os.sep
        self.local = threading.local()
        self.counts: dict[int, Counter] = defaultdict(Counter)
        self.on = False
        self.fds: dict[int, str] = {}
        self.held: dict[str, int] = {}  # lockf: path -> the thread that holds it
        self._real: dict[str, object] = {}

    def count(self, path: object, kind: str) -> None:
        node = getattr(self.local, "node", None)
        if not self.on or node is None:
            return
        if isinstance(path, int):
            if path not in self.fds:
                return
        elif not isinstance(path, (str, bytes, os.PathLike)) or not os.path.abspath(os.fsdecode(path)).startswith(self.root):
            return
        self.counts[node][kind] += 1

    def install(self) -> None:
        real = self._real
        for name in ("open", "stat", "lstat", "replace", "rename", "fsync", "listdir", "scandir", "mkdir", "unlink",
                     "remove", "rmdir", "link", "utime", "chmod", "close"):
            real[name] = getattr(os, name)
        real["builtins.open"] = builtins.open
        real["lockf"] = fcntl.lockf
        ops = self

        def os_open(path, flags, mode=0o777, *, dir_fd=None):
            ops.count(path, "create" if flags & os.O_CREAT else "open")
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if os.path.abspath(os.fsdecode(path)).startswith(ops.root):
                ops.fds[fd] = os.fsdecode(path)
            return fd

        def os_close(fd):
            path = ops.fds.pop(fd, None)
            if path is not None and ops.held.get(path) == threading.get_ident():
                del ops.held[path]
            return real["close"](fd)

        def open_(file, mode="r", *args, **kwargs):
            if not isinstance(file, int):
                ops.count(file, "create" if any(c in mode for c in "wax") else "open")
            return real["builtins.open"](file, mode, *args, **kwargs)

        def simple(name, kind):
            def wrapped(path, *args, **kwargs):
                ops.count(path, kind)
                return real[name](path, *args, **kwargs)
            return wrapped

        def lockf(fd, cmd, *args):
            path = ops.fds.get(fd if isinstance(fd, int) else fd.fileno())
            if path is not None and cmd & fcntl.LOCK_EX:  # exclusive between threads, as between processes
                owner = ops.held.setdefault(path, threading.get_ident())
                if owner != threading.get_ident():
                    raise OSError(errno.EAGAIN, "held by another simulated node")
            return real["lockf"](fd, cmd, *args)

        os.open, os.close, builtins.open, fcntl.lockf = os_open, os_close, open_, lockf
        for name, kind in (("stat", "stat"), ("lstat", "stat"), ("replace", "rename"), ("rename", "rename"),
                           ("fsync", "fsync"), ("listdir", "listdir"), ("scandir", "listdir"), ("mkdir", "create"),
                           ("unlink", "other"), ("remove", "other"), ("rmdir", "other"), ("link", "other"),
                           ("utime", "other"), ("chmod", "other")):
            setattr(os, name, simple(name, kind))

    def uninstall(self) -> None:
        for name, fn in self._real.items():
            if name == "builtins.open":
                builtins.open = fn
            elif name == "lockf":
                fcntl.lockf = fn
            else:
                setattr(os, name, fn)

    def total(self, nodes: list[int], weight: dict[int, float]) -> Counter:
        out: Counter = Counter()
        for node in nodes:
            for kind, n in self.counts[node].items():
                out[kind] += n * weight[node]
        return out


# ------------------------------------------------------------ simulated time
class SimClock:
    """Threads sleep on it; `run` advances it to the next wake once every thread sleeps."""

    def __init__(self, threads: int) -> None:
        self.now = 0.0
        self.lock = threading.Lock()
        self.sleepers = threading.Condition(self.lock)
        self.main = threading.Condition(self.lock)
        self.active = threads
        self.wakes: list[float] = []
        self.stopped = False

    def sleep(self, seconds: float) -> bool:
        with self.lock:
            if self.stopped:
                return True
            wake = self.now + max(seconds, 1e-6)
            heapq.heappush(self.wakes, wake)
            self.active -= 1
            self.main.notify()
            while self.now < wake and not self.stopped:
                self.sleepers.wait()
            return self.stopped

    def exited(self) -> None:
        with self.lock:
            self.active -= 1
            self.main.notify()

    def run(self, until: float, at: dict[float, object]) -> None:
        """Advance to `until`; at the times in `at` (sorted), call the callable with all asleep."""
        marks = sorted(at)
        with self.lock:
            while True:
                while self.active > 0:
                    self.main.wait()
                if not self.wakes or self.wakes[0] > until:
                    break
                t = self.wakes[0]
                while marks and marks[0] <= t:
                    at[marks.pop(0)]()
                woken = 0
                while self.wakes and self.wakes[0] <= t:
                    heapq.heappop(self.wakes)
                    woken += 1
                self.now, self.active = t, woken
                self.sleepers.notify_all()
            self.stopped = True
            self.sleepers.notify_all()


class SimStop:
    """What the supervisor's loop waits on: the simulated clock."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock

    def wait(self, seconds: float) -> bool:
        return self.clock.sleep(seconds)

    def set(self) -> None:
        pass

    def is_set(self) -> bool:
        return self.clock.stopped


def patch_time(clock: SimClock) -> dict:
    real = {"monotonic": time.monotonic, "time": time.time, "sleep": time.sleep}
    base = real["time"]()
    time.monotonic = lambda: clock.now
    time.time = lambda: base + clock.now
    time.sleep = clock.sleep
    return real


def unpatch_time(real: dict) -> None:
    time.monotonic, time.time, time.sleep = real["monotonic"], real["time"], real["sleep"]


def sample(n: int) -> list[int]:
    if n <= SAMPLE:
        return list(range(n))
    rng = random.Random(n)
    return list(range(4)) + sorted(rng.sample(range(4, n), SAMPLE - 4))


def weights(n: int, nodes: list[int]) -> dict[int, float]:
    """Nodes 0-3 count once; each sampled other node stands for (N - 4) / (its sample size)."""
    fixed = [k for k in nodes if k < 4]
    others = [k for k in nodes if k >= 4]
    return {k: 1.0 if k < 4 else (n - len(fixed)) / len(others) for k in nodes}


def largest_folder(root: str) -> tuple[int, str]:
    best = (0, "")
    for folder, dirs, names in os.walk(root):
        count = len(dirs) + len(names)
        if count > best[0]:
            best = (count, os.path.relpath(folder, root))
    return best


# ------------------------------------------------------------ the scenarios
def steady_state(n: int, root: str, ops: Ops) -> dict:
    run_dir = os.path.join(root, "run")
    os.makedirs(os.path.join(run_dir, runfiles.HEARTBEATS), exist_ok=True)
    nodes = sample(n)
    for k in range(n):  # every node's summary is there, as a running node's would be
        if k not in nodes:
            with open(os.path.join(run_dir, runfiles.HEARTBEATS, f"node-{k}.json"), "w") as handle:
                json.dump({"job_id": "1", "restart": "0", "node_rank": k, "seq": 1, "at": time.time(), "ranks": [
                    {"rank": k * RANKS_PER_NODE + r, "node": f"n{k}", "step": 1, "phase": "training", "waiting": False,
                     "alive": True, "state": "waiting"} for r in range(RANKS_PER_NODE)]}, handle)
    clock = SimClock(len(nodes) + 1)
    real = patch_time(clock)
    supervisors, beats = [], []
    for k in nodes:
        local = tempfile.mkdtemp(prefix=f"node{k}-", dir=os.path.join(root, "local"))
        sup = heartbeat.Supervisor(run_dir, "1", "0", k, n, None)
        sup.local_dir = local
        sup._stop = SimStop(clock)
        supervisors.append(sup)
        for r in range(RANKS_PER_NODE):
            beat = heartbeat.Heartbeat.__new__(heartbeat.Heartbeat)  # the writer without its touching thread
            beat.dir, beat.rank, beat.node = local, k * RANKS_PER_NODE + r, f"n{k}"
            beat.state = {"rank": beat.rank, "pid": os.getpid(), "node": beat.node, "step": 0, "phase": "training",
                          "waiting": False}
            beat._alive = os.path.join(local, f"rank{beat.rank}.alive")
            beats.append(beat)

    def ranks() -> None:  # every rank makes a step a second and touches its alive file
        step = 0
        while not clock.sleep(1.0):
            step += 1
            for beat in beats:
                beat.beat(step, "training")
                with open(beat._alive, "a"):
                    os.utime(beat._alive, (time.time(), time.time()))
        clock.exited()

    def supervise(sup) -> None:
        ops.local.node = sup.node_rank
        try:
            sup._watch()
        finally:
            clock.exited()

    for beat in beats:
        beat.beat(0, "training")
        open(beat._alive, "a").close()
    threads = [threading.Thread(target=ranks)] + [threading.Thread(target=supervise, args=(s,)) for s in supervisors]
    for thread in threads:
        thread.start()
    marks = {WARM_UP: lambda: setattr(ops, "on", True), WARM_UP + MEASURE: lambda: setattr(ops, "on", False)}
    clock.run(WARM_UP + MEASURE + 0.5, marks)
    for thread in threads:
        thread.join()
    unpatch_time(real)
    hung = [s.node_rank for s in supervisors if s.hung]
    total = ops.total(nodes, weights(n, nodes))
    return {"per_s": {k: v / MEASURE for k, v in total.items()}, "hung": hung,
            "largest": largest_folder(run_dir)}


def preparation(n: int, root: str, ops: Ops) -> dict:
    """Every rank in prepare_once while node 0's preparer builds for PREPARATION simulated s."""
    cache = os.path.join(root, "prepared")
    os.makedirs(cache, exist_ok=True)
    target = os.path.join(cache, "KEY")
    nodes = sample(min(n, 16))
    clock = SimClock(len(nodes) * RANKS_PER_NODE)
    real = patch_time(clock)

    def build(temp: str) -> None:
        clock.sleep(PREPARATION)
        os.makedirs(temp)
        open(os.path.join(temp, store.COMPLETE), "w").close()

    node_tmp = tempfile.mkdtemp(prefix="jobgen-bench-node-")  # each node's own temporary folder: not counted

    def rank(k: int, local: int) -> None:
        ops.local.node = k
        try:
            relay = NodeRelay(os.path.join(node_tmp, f"n{k}"), leader=local == 0)
            store.prepare_once(target, build, preparer=local == 0, relay=relay)
        finally:
            clock.exited()

    threads = [threading.Thread(target=rank, args=(k, r)) for k in nodes for r in range(RANKS_PER_NODE)]
    ops.on = True
    for thread in threads[:1]:  # node 0's preparer takes the lock first
        thread.start()
    with clock.lock:
        while clock.active > len(threads) - 1:
            clock.main.wait()
    for thread in threads[1:]:
        thread.start()
    waiting = [k for k in nodes if k != 0]
    late: list[int] = []
    clock.run(PREPARATION * 2, {PREPARATION - 100: lambda: late.append(sum(sum(ops.counts[k].values()) for k in waiting))})
    for thread in threads:
        thread.join()
    ops.on = False
    unpatch_time(real)
    shutil.rmtree(node_tmp, ignore_errors=True)
    done = sum(sum(ops.counts[k].values()) for k in waiting)
    return {"per_node_s": done / len(waiting) / PREPARATION, "late_per_node_s": (done - late[0]) / len(waiting) / 100}


def make_inputs(folder: str) -> tuple[str, str]:
    """A data file and a model folder (config, weight index, two weight files), on the shared file system."""
    data = os.path.join(folder, "data.json")
    model = os.path.join(folder, "model")
    os.makedirs(model)
    with open(data, "w") as handle:
        json.dump([{"conversations": []}], handle)
    for name in ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                 "model-00002-of-00002.safetensors"):
        with open(os.path.join(model, name), "w") as handle:
            handle.write("{}")
    return data, model


def segment_files(n: int, root: str, ops: Ops) -> dict:
    """One segment start: the health gate's file work on every node, rank 0's record, the rank logs."""
    from jobgen.train import console, health

    run_dir = os.path.join(root, "run")
    os.makedirs(os.path.join(run_dir, runfiles.LOGS), exist_ok=True)
    data, model = make_inputs(os.path.join(run_dir, "inputs"))
    ops.on = True
    for k in range(n):
        ops.local.node = k
        cache = health.HashCache(run_dir, f"n{k}")
        health.data_hash(cache, data)
        health.model_folder_facts(model, cache)
        cache.save()
    ops.local.node = 0
    health.record(run_dir, {"job_id": "1", "restart": 0, "ok": True, "problems": [], "nodes": {}})
    gate = sum(sum(c.values()) for c in ops.counts.values())
    for k in range(n):
        ops.local.node = k
        for r in range(k * RANKS_PER_NODE, (k + 1) * RANKS_PER_NODE):
            opener = getattr(console, "open_rank_log", None)
            if opener is not None:
                fd = opener(run_dir, "1", r)
            else:  # before: route_output's own two lines
                path = console.rank_log_path(run_dir, "1", r)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.close(fd)
    ops.on = False
    logs = sum(sum(c.values()) for c in ops.counts.values()) - gate
    return {"gate_per_node": gate / n, "logs_per_node": logs / n, "largest": largest_folder(run_dir)}


def measure(n: int) -> dict:
    root = tempfile.mkdtemp(prefix=f"control-plane-{n}-")
    os.makedirs(os.path.join(root, "local"))
    try:
        row: dict = {"nodes": n}
        for name, scenario in (("steady", lambda ops: steady_state(n, root, ops)),
                               ("preparation", lambda ops: preparation(n, root, ops)),
                               ("segment", lambda ops: segment_files(n, root, ops))):
            ops = Ops(os.path.join(root, "run") if name != "preparation" else os.path.join(root, "prepared"))
            ops.install()
            try:
                started = time.perf_counter()
                row[name] = scenario(ops)
                row[name]["seconds"] = round(time.perf_counter() - started, 1)
            finally:
                ops.uninstall()
            if name == "steady":
                shutil.rmtree(os.path.join(root, "run"))
        return row
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 64, 512, 4096])
    parser.add_argument("--sample", type=int, default=SAMPLE, help="nodes that run where N is larger (at least 5)")
    parser.add_argument("--warm-up", type=float, default=WARM_UP, help="simulated seconds before counting")
    parser.add_argument("--measure", type=float, default=MEASURE, help="simulated seconds counted")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    globals().update(SAMPLE=max(5, args.sample), WARM_UP=args.warm_up, MEASURE=args.measure)
    threading.stack_size(512 * 1024)
    rows = []
    print("| nodes | steady: ops/s | per node/s | open | stat | create | rename | fsync | listdir | other "
          "| largest folder (steady) | waiting ranks: ops/node/s (mean; last 100 s) | segment: gate ops/node | rank-log ops/node "
          "| largest folder (segment) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for n in args.nodes:
        row = measure(n)
        rows.append(row)
        per_s = row["steady"]["per_s"]
        total = sum(per_s.values())
        kinds = " | ".join(f"{per_s.get(k, 0):,.1f}" for k in KINDS)
        steady_big, seg_big = row["steady"]["largest"], row["segment"]["largest"]
        print(f"| {n:,} | {total:,.0f} | {total / n:.2f} | {kinds} | {steady_big[0]:,} ({steady_big[1]}) "
              f"| {row['preparation']['per_node_s']:.2f}; {row['preparation']['late_per_node_s']:.2f} | {row['segment']['gate_per_node']:.1f} "
              f"| {row['segment']['logs_per_node']:.1f} | {seg_big[0]:,} ({seg_big[1]}) |", flush=True)
        if row["steady"]["hung"]:
            print(f"  (a supervisor decided a hang: nodes {row['steady']['hung']})", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    main()
