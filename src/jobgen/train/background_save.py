"""Checkpoint saves in the background (`training.async_save`): training pauses only for the snapshot.

DeepSpeed's save runs with a checkpoint engine that copies each state dict into host memory
instead of writing it (as torch.distributed.checkpoint.async_save stages to CPU), and the RNG
states are taken. A thread then writes, fsyncs and hashes this rank's files, and the ranks agree
over a gloo group of their own (a background collective must never interleave with the training
loop's collectives on the default group): once every rank's files are durable, rank 0 commits
exactly as a synchronous save does (CheckpointStore.commit) and every rank learns the outcome.
One save at most is in flight: the next one, and a stop, wait for it first.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from jobgen.train import checkpoint as ckpt
from jobgen.train import reshard
from jobgen.train.exit_report import write_json_atomically

NICENESS = 10  # added to the save thread's (Linux: per thread)


class BackgroundSaves:
    def __init__(self, store: ckpt.CheckpointStore, on_commit: Optional[Callable[[str, float], None]] = None) -> None:
        """Collective: creates the gloo group the background saves agree over.

        `on_commit(path, seconds)` runs on every rank once a save is committed (in the
        background thread; seconds from the snapshot to the commit)."""
        import torch.distributed

        self.store, self.dist, self.pause = store, store.dist, store.pause
        self.on_commit = on_commit
        self._in_flight: Optional[_InFlight] = None
        self._group = torch.distributed.new_group(backend="gloo", timeout=self.dist.timeout)

    def start(self, engine: Any, step: int, state: dict) -> float:
        """Collective: wait for the save in flight, snapshot `step` into host memory, and write and
        commit it in a background thread. Returns the seconds spent waiting for the previous save."""
        waited = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - waited
        temp = self.store.fresh_temp(step)
        inner, captured = capture_state(engine, temp, self.dist.rank)
        job = _InFlight(step, temp, inner, captured, time.perf_counter())
        job.rng = (self.store.rng_path(temp), ckpt.rng_states())
        if self.dist.is_main:
            job.trainer_state = copy.deepcopy(dict(state, step=step, world_size=self.dist.world_size))
        self.pause.at("snapshot", step)
        job.thread = threading.Thread(target=self._write_in_background, args=(job,), name=f"save-{step}", daemon=True)
        self._in_flight = job
        job.thread.start()
        return waited

    def wait(self) -> Optional[str]:
        """Wait for the save in flight (every rank: until it is committed); its path, or None if
        none was. Raises on every rank if any rank failed to write it (no COMPLETE then)."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return None
        job.thread.join()
        kind, value = job.outcome
        if kind != "committed":
            raise RuntimeError(f"checkpoint {ckpt.step_name(job.step)} could not be written: {value}")
        return value

    @property
    def busy(self) -> bool:
        """True while this rank's background save is still writing or agreeing on its commit."""
        return self._in_flight is not None and self._in_flight.thread.is_alive()

    def _write_in_background(self, job: "_InFlight") -> None:
        import torch
        import torch.distributed

        job.outcome = ("failed", "the save thread ended early")
        try:
            # Where training keeps every core busy (the CPU), the step goes first; this thread's
            # files still get written while training waits on I/O or a collective.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
        except (OSError, AttributeError):
            pass
        try:
            entries, error = {}, None
            try:
                torch.save(job.rng[1], job.rng[0])
                self.pause.at("write", job.step)
                for path, snapshot in job.captured:
                    job.inner.save(snapshot, path)
                if job.trainer_state is not None:
                    write_json_atomically(os.path.join(job.temp, ckpt.TRAINER_STATE), job.trainer_state)
                for path in [job.rng[0], *(path for path, _ in job.captured)]:
                    ckpt.fsync_file(path)
                    entries[os.path.relpath(path, job.temp)] = {"size": os.path.getsize(path), "sha256": ckpt.sha256_file(path)}
            except Exception as exc:  # noqa: BLE001 - reported to every rank, raised by wait()
                error = f"rank {self.dist.rank}: {type(exc).__name__}: {exc}"
            job.captured = []  # the host copy is no longer needed
            gathered: list = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, (entries, error), group=self._group)
            errors = [e for _, e in gathered if e]
            outcome = ("failed", errors[0]) if errors else None
            if self.dist.is_main and outcome is None:
                try:
                    outcome = ("committed", self._commit_gathered(job, gathered))
                except Exception as exc:  # noqa: BLE001
                    outcome = ("failed", f"rank 0: {type(exc).__name__}: {exc}")
            box = [outcome]
            torch.distributed.broadcast_object_list(box, src=0, group=self._group)
            job.outcome = box[0]
        except Exception as exc:  # noqa: BLE001 - e.g. a rank died: the agreement timed out
            job.outcome = ("failed", f"{type(exc).__name__}: {exc}")
        if job.outcome[0] == "committed" and self.on_commit is not None:
            self.on_commit(job.outcome[1], time.perf_counter() - job.started)

    def _commit_gathered(self, job: "_InFlight", gathered: list) -> str:
        files: dict = {}
        for entries, _ in gathered:
            files.update(entries)
        for name in ckpt.list_files(job.temp):
            if name not in files:  # written outside the checkpoint engine (DeepSpeed's zero_to_fp32.py)
                full = os.path.join(job.temp, name)
                ckpt.fsync_file(full)
                files[name] = {"size": os.path.getsize(full), "sha256": ckpt.sha256_file(full)}
        return self.store.commit(job.temp, job.step, job.trainer_state["config_digest"], dict(sorted(files.items())))


def capture_state(engine: Any, directory: str, rank: int) -> tuple[Any, list]:
    """Collective (DeepSpeed's save has barriers): this rank's share of a checkpoint in `directory`
    as host copies, nothing written: [(path, state)] of DeepSpeed's files and the universal shard,
    and DeepSpeed's own checkpoint engine, which writes them in its format."""
    capture = _CapturingEngine(engine.checkpoint_engine)
    engine.checkpoint_engine = capture
    try:
        engine.save_checkpoint(directory, tag=ckpt.DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True)
    finally:
        engine.checkpoint_engine = capture.inner
    # Already a host copy: written by the same engine as DeepSpeed's files (torch.save).
    capture.captured.append((reshard.shard_path(directory, rank), reshard.local_shard(engine, rank)))
    return capture.inner, capture.captured


@dataclass
class _InFlight:
    step: int
    temp: str
    inner: Any  # DeepSpeed's own checkpoint engine: writes the files in DeepSpeed's format
    captured: list  # [(path, host copy of the state dict)]
    started: float
    rng: tuple = ()  # (path, this rank's RNG states at the snapshot)
    trainer_state: Optional[dict] = None
    thread: Optional[threading.Thread] = None
    outcome: tuple = ("failed", "not started")


class _CapturingEngine:
    """Stands in for DeepSpeed's checkpoint engine during the snapshot: `save` keeps a host copy
    of the state dict instead of writing it; everything else is the real engine's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.captured: list = []

    def save(self, state_dict: Any, path: str) -> None:
        self.captured.append((path, host_copy(state_dict, {})))

    def preserves_storage_sharing(self) -> bool:
        return False  # host_copy already copies each tensor on its own; no second clone

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def host_copy(value: Any, memo: dict) -> Any:
    """`value` with every tensor copied to host memory, so that training can change the originals.

    A tensor met twice is copied once (memo by id). Non-tensor leaves are deep-copied (DeepSpeed's
    loss scaler changes in place) unless they cannot be, like its config object, which training
    does not change."""
    import torch

    if isinstance(value, torch.Tensor):
        key = id(value)
        if key not in memo:
            memo[key] = value.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(value, dict):
        result = copy.copy(value)  # keeps OrderedDict/defaultdict and their factories
        for key, item in value.items():
            result[key] = host_copy(item, memo)
        return result
    if isinstance(value, list):
        return [host_copy(item, memo) for item in value]
    if type(value) is tuple:
        return tuple(host_copy(item, memo) for item in value)
    if isinstance(value, (str, bytes, int, float, bool, type(None), torch.Size, torch.dtype, torch.device)):
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - not copyable: a read-only object such as DeepSpeed's config
        return value
