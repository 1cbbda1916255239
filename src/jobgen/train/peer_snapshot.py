"""Every step's trainable state in the memory of two nodes (`training.snapshot_every`).

A failure nobody announced (a killed rank, a hang, a node powered off) would lose the steps since
the newest checkpoint on disk. So after every `snapshot_every`-th step each rank takes what a
checkpoint holds of it (DeepSpeed's files, its universal shard, its RNG states; rank 0 also the
trainer state) as a host copy, the way a background save does; a thread serializes that into one
file in its node's memory (/dev/shm) and sends it to the same local rank of the next node, which
keeps it too. Every rank's state of a step then lives on two nodes. On a restart, before the
newest checkpoint is looked for, `promote` finds the newest step whose every rank the nodes of this
world still hold, and if it is newer than the newest checkpoint writes it out as a complete
checkpoint of that step (the same files, hashed, with manifest and COMPLETE): from there it is the
normal resume, bit for bit and on any world size.

The ranks agree on taking a snapshot in the step's all_gather, and take it only when every rank's
previous one is done, so training never waits for one (a skipped step is counted and said).

Files: ROOT/jobgen-snapshots-UID/RUN/NODE/step-000012.rank-00003.of-00004.TOKEN, where ROOT is
/dev/shm (else the temporary folder; JOBGEN_SNAPSHOT_DIR overrides), RUN a digest of the output
directory, NODE the scheduler's name of the node (a rank reads only its own node's folder) and
TOKEN the run's (OUTPUT_DIR/checkpoints/.snapshot-token): a run started afresh in a wiped output
directory never takes an earlier run's steps. The newest two steps are kept; a completed run
removes its node's folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import queue
import re
import secrets
import shutil
import tempfile
import threading
import time
from typing import Any, Optional

from jobgen.files import replace_atomically
from jobgen.train import checkpoint as ckpt
from jobgen.train import snapshot_file
from jobgen.train.background_save import capture_state

log = logging.getLogger("jobgen.train")

ROOT_ENV = "JOBGEN_SNAPSHOT_DIR"
TOKEN_FILE = ".snapshot-token"
KEEP_STEPS = 2  # the newest may be missing on a node whose thread was cut off mid-way
NAME = re.compile(r"^step-(\d+)\.rank-(\d+)\.of-(\d+)\.([0-9a-f]+)$")
PARTIAL = re.compile(r"^\.step-.*\.tmp$")  # replace_atomically's temporary name, left by a kill


def node_folder(output_dir: str, node: str) -> str:
    root = os.environ.get(ROOT_ENV) or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    run = hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]
    return os.path.join(root, f"jobgen-snapshots-{os.getuid()}", run, node)


def run_token(store: ckpt.CheckpointStore) -> str:
    """Collective: the run's token, made by rank 0 on the run's first start."""
    token = None
    if store.dist.is_main:
        path = os.path.join(store.root, TOKEN_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except FileNotFoundError:
            token = secrets.token_hex(8)
            os.makedirs(store.root, exist_ok=True)
            replace_atomically(path, token + "\n", durable=True)
    return store.dist.broadcast_object(token)


def snapshot_name(step: int, rank: int, world: int, token: str) -> str:
    return f"step-{step:06d}.rank-{rank:05d}.of-{world:05d}.{token}"


class PeerSnapshots:
    def __init__(self, dist: Any, folder: str, token: str, node: str) -> None:
        """Collective: learns every rank's node and creates the gloo group the copies travel over
        (never the default group, whose collectives the training loop runs meanwhile)."""
        import torch.distributed

        self.dist, self.folder, self.token = dist, folder, token
        self.peer, self.source = ring_neighbours(dist.all_gather_object(node), dist.rank)
        self._group = torch.distributed.new_group(backend="gloo", timeout=dist.timeout)
        # One thread for the run, fed a snapshot at a time: starting a thread per step cost the
        # training thread a few ms each time (it waits until the new thread runs).
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._work, name="snapshots", daemon=True)
        self._thread.start()
        self.taken = self.skipped = 0
        self.size = 0  # bytes of this rank's newest snapshot (kept twice: here and on the peer)
        self.paused: list[float] = []  # seconds training paused for each (the host copy)
        self.kept: list[float] = []  # seconds each took in the thread (serialized, written, sent)
        self.cpu: list[float] = []  # and the CPU seconds of it
        self._written_by_deepspeed: Optional[dict] = None
        self.error: Optional[str] = None  # the first failed snapshot's reason; later ones are not said again

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def take(self, engine: Any, step: int, state: dict) -> None:
        """Collective (DeepSpeed's save has barriers): copy this rank's state of `step` to host
        memory, then keep it here and on the peer node in a thread. Call only when no rank is busy."""
        started = time.perf_counter()
        rank = self.dist.rank
        staging = os.path.join(self.folder, f".staging-{rank:05d}")
        _, captured = capture_state(engine, staging, rank)
        files = [(os.path.relpath(path, staging), value) for path, value in captured]
        files.append((f"rng/rank-{rank:05d}.pt", ckpt.rng_states()))
        if self._written_by_deepspeed is None:  # rank 0: zero_to_fp32.py, the same every time: read once
            self._written_by_deepspeed = _read_all(staging)
        written = dict(self._written_by_deepspeed)
        if self.dist.is_main:
            trainer_state = dict(state, step=step, world_size=self.dist.world_size)
            written[ckpt.TRAINER_STATE] = (json.dumps(trainer_state, indent=2) + "\n").encode()
        self._idle.clear()
        self._queue.put((step, files, written))
        self.taken += 1
        self.paused.append(time.perf_counter() - started)

    def summary(self) -> str:
        """For the log: how many, how large, and what they cost."""
        import statistics

        text = (f"{self.taken} taken, {self.skipped} skipped (a rank's previous one still on its way), "
                f"{self.size / 1e6:.2f} MB a rank")
        if self.paused:
            text += (f"; training paused a median {statistics.median(self.paused) * 1e3:.0f} ms for each, kept and sent in "
                     f"{statistics.median(self.kept or [0.0]) * 1e3:.0f} ms beside it "
                     f"({statistics.median(self.cpu or [0.0]) * 1e3:.0f} ms of CPU)")
        return text + (f"; the first that failed: {self.error}" if self.error else "")

    def wait(self) -> None:
        self._idle.wait()

    def close(self, completed: bool) -> None:
        """After the loop: the thread is ended; a completed run needs its snapshots no more."""
        self._queue.put(None)
        self._thread.join()
        if completed and self.dist.local_rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _work(self) -> None:
        # Not niced as the background save is: serializing holds the GIL, and a thread the kernel
        # seldom runs kept the training thread waiting for it (step 0.974 s niced, 0.896 s not,
        # against 0.857 s without snapshots; BENCHMARKS.md).
        while (job := self._queue.get()) is not None:
            try:
                self._keep(*job)
            finally:
                self._idle.set()

    def _keep(self, step: int, files: list, written: dict) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            # The tensors' own memory goes to the node's file (snapshot_file, not torch.save: on
            # this 2-CPU VM the thread's CPU time is what training loses), and the peer's copy is
            # sent from that file's pages, mapped, not from another copy.
            pieces = snapshot_file.pieces({"states": dict(files), "files": written})
            self.size = sum(len(piece) for piece in pieces)
            world = self.dist.world_size
            own = os.path.join(self.folder, snapshot_name(step, self.dist.rank, world, self.token))
            _write_file(own, pieces)
            if self.peer is not None:
                received = self._exchange(own)
                _write_file(os.path.join(self.folder, snapshot_name(step, self.source, world, self.token)), received)
            prune(self.folder, KEEP_STEPS)
            self.kept.append(time.perf_counter() - started)
            self.cpu.append(time.thread_time() - cpu)
        except Exception as exc:  # noqa: BLE001 - a snapshot is an extra: training goes on, the disk checkpoints hold
            if self.error is None:
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("rank %d: the snapshot of step %d failed (%s); resumes fall back to the checkpoints on disk",
                            self.dist.rank, step, self.error)

    def _exchange(self, path: str) -> memoryview:
        """Send the file at `path` to the peer, receive the source's: a ring, every rank sending
        and receiving at once."""
        import torch
        import torch.distributed as dist

        with open(path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # its pages, not a copy
        try:
            payload_out = torch.frombuffer(mapped, dtype=torch.uint8)
            size_out, size_in = torch.tensor([len(mapped)], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
            _both(dist.isend(size_out, self.peer, group=self._group), dist.irecv(size_in, self.source, group=self._group))
            payload_in = torch.empty(int(size_in.item()), dtype=torch.uint8)
            _both(dist.isend(payload_out, self.peer, group=self._group), dist.irecv(payload_in, self.source, group=self._group))
            del payload_out  # the mapping cannot close while a tensor uses it
        finally:
            try:
                mapped.close()
            except BufferError:  # still exported after an error: the garbage collector closes it
                pass
        return memoryview(payload_in.numpy())


def _both(*works: Any) -> None:
    for work in works:
        work.wait()


def ring_neighbours(nodes: list[str], rank: int) -> tuple[Optional[int], Optional[int]]:
    """(peer, source): the rank at this rank's local position on the next node, which keeps this
    rank's snapshots, and the one on the previous node, whose snapshots this rank keeps (torchrun
    starts as many ranks on every node). (None, None) on one node: no other node to hold them."""
    order = list(dict.fromkeys(nodes))  # the nodes in the order of their first rank
    if len(order) < 2:
        return None, None
    ranks_of = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
    here, position = order.index(nodes[rank]), ranks_of[nodes[rank]].index(rank)
    return (ranks_of[order[(here + 1) % len(order)]][position], ranks_of[order[here - 1]][position])


def promote(store: ckpt.CheckpointStore, folder: str, token: str, node: str) -> Optional[int]:
    """Collective, before the newest checkpoint is looked for: if the nodes of this world hold every
    rank's snapshot of a step newer than the newest complete checkpoint, write the newest such step
    out as a complete checkpoint and return it; else None. Snapshots of other runs are removed."""
    dist = store.dist
    held = inventory(folder, token) if os.path.isdir(folder) else {}
    newest_on_disk = store.newest_complete_step() if dist.is_main else None
    gathered = dist.all_gather_object((node, sorted(held), newest_on_disk))
    disk = gathered[0][2]
    holder: dict = {}  # (step, rank, world) -> the lowest rank of a node that holds it
    for rank, (_, keys, _) in enumerate(gathered):
        for key in keys:
            holder.setdefault(tuple(key), rank)
    step, world = choose(holder, disk)
    if step is None:
        return None
    temp = store.fresh_temp(step)
    error = None
    try:
        for (s, old_rank, w), rank in sorted(holder.items()):
            if (s, w) == (step, world) and rank == dist.rank:
                _unpack(held[(s, old_rank, w)], temp)
    except Exception as exc:  # noqa: BLE001 - a snapshot that cannot be read: the disk checkpoint holds
        error = f"rank {dist.rank}: {type(exc).__name__}: {exc}"
    errors = [e for e in dist.all_gather_object(error) if e]
    if errors:
        if dist.is_main:
            log.warning("the snapshot of step %d could not be written out (%s); resuming from the checkpoints on disk",
                        step, errors[0])
        return None
    digest = None
    if dist.is_main:
        with open(os.path.join(temp, ckpt.TRAINER_STATE), encoding="utf-8") as handle:
            digest = json.load(handle)["config_digest"]
    holders = sorted({gathered[rank][0] for (s, _, w), rank in holder.items() if (s, w) == (step, world)})
    store.commit_written(temp, step, dist.broadcast_object(digest), world_size=world,
                         written_from="snapshot held in the memory of " + ", ".join(holders))
    if dist.is_main:
        newer = f"{step - disk} step(s) newer than checkpoint {ckpt.step_name(disk)}" if disk is not None else "no checkpoint on disk"
        log.info("snapshot of step %d (%d ranks) held in the memory of %s: written out as a checkpoint; %s",
                 step, world, ", ".join(holders), newer)
    return step


def choose(holder: dict, disk: Optional[int]) -> tuple[Optional[int], Optional[int]]:
    """The newest (step, world) with a snapshot of each of its ranks and newer than `disk`."""
    ranks_by: dict = {}
    for step, rank, world in holder:
        ranks_by.setdefault((step, world), set()).add(rank)
    for step, world in sorted(ranks_by, reverse=True):
        if (disk is None or step > disk) and ranks_by[(step, world)] == set(range(world)):
            return step, world
    return None, None


def inventory(folder: str, token: str) -> dict:
    """{(step, rank, world): path} of this run's snapshots in `folder`; another run's, and pieces
    a killed thread left, are removed."""
    found = {}
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        match = NAME.match(name)
        if match and match.group(4) == token:
            found[(int(match.group(1)), int(match.group(2)), int(match.group(3)))] = path
        elif match or PARTIAL.match(name):
            _remove(path)
    return found


def prune(folder: str, keep: int) -> None:
    """Keep the snapshots of the newest `keep` steps in `folder`."""
    names = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := NAME.match(name))]
    newest = sorted({step for step, _ in names}, reverse=True)[:keep]
    for step, name in names:
        if step not in newest:
            _remove(os.path.join(folder, name))


def _unpack(path: str, temp: str) -> None:
    """A snapshot's files into the checkpoint folder `temp`: each state written as DeepSpeed's
    engine writes it (torch.save), the rest as it was."""
    import torch

    # Written by this run's ranks into the user's own 0700 folder: its objects are DeepSpeed's.
    with open(path, "rb") as handle:
        data = bytearray(os.fstat(handle.fileno()).st_size)
        handle.readinto(data)
    snapshot = snapshot_file.load(data)
    for relative, value in [*snapshot["states"].items(), *snapshot["files"].items()]:
        target = os.path.join(temp, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            if isinstance(value, bytes):
                handle.write(value)
            else:
                torch.save(value, handle)
            handle.flush()
            os.fsync(handle.fileno())


def _read_all(staging: str) -> dict:
    found = {}
    if os.path.isdir(staging):
        for relative in ckpt.list_files(staging):
            with open(os.path.join(staging, relative), "rb") as handle:
                found[relative] = handle.read()
    return found


def _write_file(path: str, data: Any) -> None:
    replace_atomically(path, data, mode=0o600)  # whole or not at all: a kill leaves only a temporary file


def usable_folder(folder: str) -> Optional[str]:
    """Make the node's folder, under a per-user parent only its owner can read (a shared
    /dev/shm); None, or why it cannot be written."""
    try:
        os.makedirs(os.path.dirname(os.path.dirname(folder)), mode=0o700, exist_ok=True)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        probe = os.path.join(folder, ".probe")
        replace_atomically(probe, b"", mode=0o600)
        os.remove(probe)
    except OSError as exc:
        return f"{folder}: {exc.strerror or exc}"
    return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
