"""Checkpoints: the one place that writes, verifies, finds, loads and prunes them.

Layout of `OUTPUT_DIR/checkpoints/step-000123/`:

    deepspeed/...           engine.save_checkpoint(): model (trainable parameters only), the
                            optimizer partition of every rank and the LR scheduler
    rng/rank-00000.pt       python, numpy, torch (and CUDA) RNG states of each rank
    trainer_state.json      step, epoch and batches consumed in it, world size, config digest,
                            the training section, the LR scheduler state
    manifest.json           step, world size, config digest, every file with size and sha256
    COMPLETE                written last

Every rank writes into `.tmp-step-000123`; after a barrier the files are hashed (spread over the
ranks), rank 0 writes the manifest and COMPLETE, fsyncs and renames the directory. A kill at any
moment leaves a complete checkpoint or a `.tmp-*` directory, which is removed on the next start.

In the background (`training.async_save`, `start_save`), training pauses only for the snapshot:
DeepSpeed's save runs with a checkpoint engine that copies each state dict into host memory
instead of writing it (as torch.distributed.checkpoint.async_save stages to CPU), and the RNG
states are taken. A thread then writes, fsyncs and hashes this rank's files, and the ranks agree
over a gloo group of their own (a background collective must never interleave with the training
loop's collectives on the default group): once every rank's files are durable, rank 0 commits
exactly as above and every rank learns the outcome. One save at most is in flight: the next one,
and a stop, wait for it first.
On start the newest checkpoint whose files match its manifest is used; one that does not is
skipped with a warning and renamed `corrupt-step-...` (kept for inspection, never used or
pruned). Directories are assumed to be on a file system every rank sees.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from jobgen.train.distributed import pg_timeout
from jobgen.train.errors import UserError
from jobgen.train.exit_report import fsync_directory, write_json_atomically

log = logging.getLogger("jobgen.train")

STEP_DIR = re.compile(r"^step-(\d+)$")
TEMP_PREFIX = ".tmp-"
DEEPSPEED_TAG = "deepspeed"
COMPLETE = "COMPLETE"
BACKGROUND_NICENESS = 10  # added to the save thread's (Linux: per thread)
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"


def step_name(step: int) -> str:
    return f"step-{step:06d}"


@dataclass(frozen=True)
class Found:
    path: str
    manifest: dict
    state: dict


class CheckpointStore:
    def __init__(
        self, root: str, dist: Any, keep: int, background: bool = False,
        on_commit: Optional[Callable[[str, float], None]] = None,
    ) -> None:
        """Collective when `background`: creates the gloo group the background saves agree over.

        `on_commit(path, seconds)` runs on every rank once a background save is committed
        (in the background thread; seconds from the snapshot to the commit)."""
        self.root, self.dist, self.keep = root, dist, keep
        self.on_commit = on_commit
        self.pause = SavePause.from_env(os.path.dirname(root), dist.rank)
        self._in_flight: Optional[_InFlight] = None
        self._group = None
        if background:
            import torch.distributed

            self._group = torch.distributed.new_group(backend="gloo", timeout=pg_timeout())

    # ----------------------------------------------------------------- start
    def remove_stale_temps(self) -> None:
        """Rank 0 deletes half-written `.tmp-*` directories; all ranks wait for it."""
        if self.dist.is_main and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(TEMP_PREFIX):
                    log.warning("removing incomplete checkpoint %s", os.path.join(self.root, name))
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        self.dist.barrier()

    def find_latest(self) -> Optional[Found]:
        """Collective: the newest complete checkpoint whose files match its manifest, or None."""
        candidates = self.dist.broadcast_object(self._complete_dirs() if self.dist.is_main else None)
        for path in candidates:
            problem = self._verify(path)
            if problem is None:
                with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
                    manifest = json.load(handle)
                with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as handle:
                    state = json.load(handle)
                return Found(path, manifest, state)
            if self.dist.is_main:
                # Set aside (not deleted: evidence), so pruning never keeps it over newer good ones.
                aside = os.path.join(self.root, "corrupt-" + os.path.basename(path))
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(path, aside)
                log.warning("skipping checkpoint %s: %s (moved to %s)", path, problem, aside)
            self.dist.barrier()
        return None

    def _complete_dirs(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            match = STEP_DIR.match(name)
            if match and os.path.exists(os.path.join(self.root, name, COMPLETE)):
                steps.append((int(match.group(1)), os.path.join(self.root, name)))
        return [path for _, path in sorted(steps, reverse=True)]

    def _verify(self, path: str) -> Optional[str]:
        """Collective: None if every file in the manifest exists with its size and sha256."""
        try:
            with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
                files = json.load(handle)["files"]
            if not isinstance(files, dict) or not files:
                files = None
        except (OSError, ValueError, KeyError, TypeError):
            files = None
        problems = self._hash_spread(path, sorted(files) if files else [], expected=files)
        if files is None:
            return "manifest.json is missing or unreadable"
        return problems[0] if problems else None

    def _hash_spread(self, path: str, names: list[str], expected: Optional[dict]) -> list:
        """Hash files across ranks. With `expected`: list of mismatch messages; else: {name: entry}."""
        mine = {}
        for index, name in enumerate(names):
            if index % self.dist.world_size != self.dist.rank:
                continue
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                mine[name] = None
                continue
            mine[name] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
        merged: dict = {}
        for part in self.dist.all_gather_object(mine):
            merged.update(part)
        if expected is None:
            return [merged]
        problems = []
        for name in names:
            got, want = merged.get(name), expected[name]
            if got is None:
                problems.append(f"{name} is missing")
            elif got != want:
                problems.append(f"{name} does not match its manifest entry (size {got['size']}, expected {want['size']})")
        return problems

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, step: int, state: dict) -> str:
        """Collective: write a complete checkpoint of `step`; returns its path."""
        import torch

        final = os.path.join(self.root, step_name(step))
        temp = os.path.join(self.root, TEMP_PREFIX + step_name(step))
        if self.dist.is_main:
            shutil.rmtree(temp, ignore_errors=True)
            os.makedirs(os.path.join(temp, "rng"), exist_ok=True)
        self.dist.barrier()
        engine.save_checkpoint(temp, tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True)
        self.pause.at("write", step)
        rng_path = os.path.join(temp, "rng", f"rank-{self.dist.rank:05d}.pt")
        torch.save(rng_states(), rng_path)
        _fsync_file(rng_path)
        if self.dist.is_main:
            state = dict(state, step=step, world_size=self.dist.world_size)
            write_json_atomically(os.path.join(temp, TRAINER_STATE), state)
        self.dist.barrier()  # every rank's files are on disk
        names = self.dist.broadcast_object(_list_files(temp) if self.dist.is_main else None)
        entries = self._hash_spread(temp, names, expected=None)[0]
        if self.dist.is_main:
            self._commit(temp, step, state["config_digest"], {name: entries[name] for name in names})
        self.dist.barrier()
        return final

    def _commit(self, temp: str, step: int, config_digest: str, files: dict) -> str:
        """Rank 0, once every rank's files in `temp` are durable: manifest, COMPLETE, rename, prune."""
        final = os.path.join(self.root, step_name(step))
        manifest = {"step": step, "world_size": self.dist.world_size, "config_digest": config_digest, "files": files}
        write_json_atomically(os.path.join(temp, MANIFEST), manifest)
        self.pause.at("commit", step)
        with open(os.path.join(temp, COMPLETE), "w") as handle:
            handle.write(f"{step}\n")
            handle.flush()
            os.fsync(handle.fileno())
        for parent, _, _ in os.walk(temp):  # the files' names are durable too (deepspeed/, rng/)
            fsync_directory(parent)
        if os.path.exists(final):  # a checkpoint of this step from an earlier attempt
            shutil.rmtree(final)
        os.rename(temp, final)
        fsync_directory(self.root)
        self._prune()
        return final

    # ------------------------------------------------------- background save
    def start_save(self, engine: Any, step: int, state: dict) -> float:
        """Collective: wait for the save in flight, snapshot `step` into host memory, and write and
        commit it in a background thread. Returns the seconds spent waiting for the previous save."""
        waited = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - waited
        temp = os.path.join(self.root, TEMP_PREFIX + step_name(step))
        if self.dist.is_main:
            shutil.rmtree(temp, ignore_errors=True)
            os.makedirs(os.path.join(temp, "rng"), exist_ok=True)
        self.dist.barrier()
        capture = _CapturingEngine(engine.checkpoint_engine)
        engine.checkpoint_engine = capture
        try:
            engine.save_checkpoint(temp, tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True)
        finally:
            engine.checkpoint_engine = capture.inner
        job = _InFlight(step, temp, capture.inner, capture.captured, time.perf_counter())
        job.rng = (os.path.join(temp, "rng", f"rank-{self.dist.rank:05d}.pt"), rng_states())
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
            raise RuntimeError(f"checkpoint {step_name(job.step)} could not be written: {value}")
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
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
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
                    write_json_atomically(os.path.join(job.temp, TRAINER_STATE), job.trainer_state)
                for path in [job.rng[0], *(path for path, _ in job.captured)]:
                    _fsync_file(path)
                    entries[os.path.relpath(path, job.temp)] = {"size": os.path.getsize(path), "sha256": sha256_file(path)}
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
        for name in _list_files(job.temp):
            if name not in files:  # written outside the checkpoint engine (DeepSpeed's zero_to_fp32.py)
                full = os.path.join(job.temp, name)
                _fsync_file(full)
                files[name] = {"size": os.path.getsize(full), "sha256": sha256_file(full)}
        return self._commit(job.temp, job.step, job.trainer_state["config_digest"], dict(sorted(files.items())))

    def _prune(self) -> None:
        for path in self._complete_dirs()[self.keep :]:
            doomed = os.path.join(self.root, TEMP_PREFIX + "delete-" + os.path.basename(path))
            os.rename(path, doomed)  # never a half-deleted directory that still looks complete
            shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, engine: Any, found: Found) -> None:
        """Collective: restore engine (weights, optimizer, scheduler) and this rank's RNG states."""
        import torch

        load_path, _ = engine.load_checkpoint(
            found.path,
            tag=DEEPSPEED_TAG,
            load_module_strict=False,  # frozen base weights come from the model, not the checkpoint
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load checkpoint {found.path}")
        states = torch.load(
            os.path.join(found.path, "rng", f"rank-{self.dist.rank:05d}.pt"), weights_only=False
        )
        set_rng_states(states)


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


class SavePause:
    """Testing aid: `JOBGEN_DEBUG_SAVE_PAUSE=PHASE@STEP:SECONDS` makes the save of STEP sleep
    SECONDS at PHASE, after leaving OUTPUT_DIR/debug-save-pause-PHASE-rankR, so a test can kill
    the job there. Phases: snapshot (training paused, state copied), write (the first file
    written, none durable yet), commit (rank 0: manifest written, COMPLETE not yet)."""

    PHASES = ("snapshot", "write", "commit")

    def __init__(self, directory: str, rank: int, phase: str = "", step: int = 0, seconds: float = 0.0) -> None:
        self.directory, self.rank, self.phase, self.step, self.seconds = directory, rank, phase, step, seconds

    @classmethod
    def from_env(cls, directory: str, rank: int) -> "SavePause":
        raw = os.environ.get("JOBGEN_DEBUG_SAVE_PAUSE", "")
        if not raw:
            return cls(directory, rank)
        match = re.fullmatch(r"(\w+)@(\d+):(\d+(?:\.\d*)?)", raw)
        if not match or match.group(1) not in cls.PHASES:
            raise UserError(
                f"JOBGEN_DEBUG_SAVE_PAUSE is {raw!r}; expected PHASE@STEP:SECONDS with PHASE one of {', '.join(cls.PHASES)}"
            )
        return cls(directory, rank, match.group(1), int(match.group(2)), float(match.group(3)))

    def at(self, phase: str, step: int) -> None:
        if phase != self.phase or step != self.step:
            return
        marker = os.path.join(self.directory, f"debug-save-pause-{phase}-rank{self.rank}")
        with open(marker, "w") as handle:
            handle.write(f"{step}\n")
        time.sleep(self.seconds)


def check_compatible(found: Found, world_size: int, config_digest: str, changed: list[str]) -> None:
    """Raise UserError if `found` cannot be resumed by this run."""
    name = os.path.basename(found.path)
    written_by = found.manifest["world_size"]
    if written_by != world_size:
        raise UserError(
            f"checkpoint {name} was written by {written_by} ranks, this run has {world_size}: rerun with "
            f"{written_by} ranks (resources.nodes x launch.procs_per_node), or move {os.path.dirname(found.path)} "
            "aside to start from scratch (its ZeRO optimizer partitions and data order are per rank)"
        )
    if found.manifest["config_digest"] != config_digest:
        raise UserError(
            f"checkpoint {name} was written with different training settings ({', '.join(changed) or 'unknown'}); "
            f"restore them, or use a new training.output_dir to start from scratch"
        )


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _list_files(directory: str) -> list[str]:
    names = []
    for parent, _, files in os.walk(directory):
        for file in files:
            names.append(os.path.relpath(os.path.join(parent, file), directory))
    return sorted(names)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def rng_states() -> dict:
    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
