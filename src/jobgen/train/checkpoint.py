"""Checkpoints: the one place that writes, verifies, finds, loads and prunes them.

Layout of `OUTPUT_DIR/checkpoints/step-000123/`:

    deepspeed/...           engine.save_checkpoint(): model (trainable parameters only), the
                            optimizer partition of every rank and the LR scheduler
    universal/rank-00000.pt each rank's pieces of the fp32 weights and optimizer moments, with
                            their offsets in each parameter: loads on any world size (reshard.py)
    rng/rank-00000.pt       python, numpy, torch (and CUDA) RNG states of each rank
    trainer_state.json      step, epoch and steps done in it, global batch, world size, config
                            digest, the training section, the LR scheduler state, the
                            chat template's digest
    manifest.json           step, world size, config digest, every file with size and sha256
    COMPLETE                written last
`OUTPUT_DIR/checkpoints/.snapshot-token` names the run for its peer snapshots (peer_snapshot.py),
which a restart may write out here as a checkpoint: its manifest then says `written_from`.

Every rank writes into `.tmp-step-000123`; after a barrier the files are hashed (spread over the
ranks), rank 0 writes the manifest and COMPLETE, fsyncs and renames the directory. A kill at any
moment leaves a complete checkpoint or a `.tmp-*` directory, which is removed on the next start.

Saves in the background (`training.async_save`) are jobgen/train/background_save.py; they end
in the same commit.
On the world size that wrote it, a checkpoint loads through DeepSpeed (the same partitions, bit
for bit); on any other, from universal/ (jobgen/train/reshard.py), with the LR schedule from
trainer_state.json and, for rank r, rank r's RNG states where the old world had a rank r (a new
rank seeds itself from the seed, the step and its rank).
On start the newest checkpoint whose files match its manifest is used; one that does not is
skipped with a warning and renamed `corrupt-step-...` (kept for inspection, never used or
pruned). Directories are assumed to be on a file system every rank sees.

Pruning keeps the newest `keep_checkpoints`, and the one `best.json` names (training.keep_best:
the best by eval loss, jobgen/train/best.py), which a commit points there once it is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

from jobgen.errors import UserError
from jobgen.files import fsync_directory
from jobgen.train import best as best_checkpoint
from jobgen.train import reshard
from jobgen.train.exit_report import write_json_atomically

log = logging.getLogger("jobgen.train")

STEP_DIR = re.compile(r"^step-(\d+)$")
TEMP_PREFIX = ".tmp-"
DEEPSPEED_TAG = "deepspeed"
COMPLETE = "COMPLETE"
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
    def __init__(self, root: str, dist: Any, keep: int) -> None:
        self.root, self.dist, self.keep = root, dist, keep
        self.pause = SavePause.from_env(os.path.dirname(root), dist.rank)

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
                return _found(path)
            if self.dist.is_main:
                # Set aside (not deleted: evidence), so pruning never keeps it over newer good ones.
                aside = os.path.join(self.root, "corrupt-" + os.path.basename(path))
                shutil.rmtree(aside, ignore_errors=True)
                os.rename(path, aside)
                log.warning("skipping checkpoint %s: %s (moved to %s)", path, problem, aside)
            self.dist.barrier()
        return None

    def find_step(self, step: int) -> Optional[Found]:
        """Collective: the complete checkpoint of `step` if its files match its manifest, else None
        (with a warning; it is left where it is)."""
        path = os.path.join(self.root, step_name(step))
        if not self.dist.broadcast_object(os.path.exists(os.path.join(path, COMPLETE)) if self.dist.is_main else None):
            log.warning("checkpoint %s is not there or not complete", path)
            return None
        problem = self._verify(path)
        if problem is not None:
            log.warning("checkpoint %s does not match its manifest: %s", path, problem)
            return None
        return _found(path)

    def problem_with(self, path: str) -> Optional[str]:
        """Collective: None if every file of the complete checkpoint `path` matches its manifest."""
        return self._verify(path)

    def is_complete(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.root, name, COMPLETE))

    def newest_complete_step(self) -> Optional[int]:
        """The step of the newest checkpoint with COMPLETE (its files not checked), or None."""
        newest = self._complete_dirs()[:1]
        return int(STEP_DIR.match(os.path.basename(newest[0])).group(1)) if newest else None

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

        temp = self.fresh_temp(step)
        engine.save_checkpoint(temp, tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True)
        self.pause.at("write", step)
        shard = reshard.shard_path(temp, self.dist.rank)
        torch.save(reshard.local_shard(engine, self.dist.rank), shard)
        fsync_file(shard)
        rng_path = self.rng_path(temp)
        torch.save(rng_states(), rng_path)
        fsync_file(rng_path)
        if self.dist.is_main:
            state = dict(state, step=step, world_size=self.dist.world_size)
            write_json_atomically(os.path.join(temp, TRAINER_STATE), state)
        self.dist.barrier()  # every rank's files are on disk
        return self.commit_written(temp, step, state["config_digest"])

    def commit_written(self, temp: str, step: int, config_digest: str, world_size: Optional[int] = None,
                       written_from: Optional[str] = None) -> str:
        """Collective, once every rank's files of `step` are durable in `temp`: hashed (spread over
        the ranks) and committed by rank 0. `world_size`: the world that trained them, if not this one."""
        final = os.path.join(self.root, step_name(step))
        names = self.dist.broadcast_object(list_files(temp) if self.dist.is_main else None)
        entries = self._hash_spread(temp, names, expected=None)[0]
        if self.dist.is_main:
            self.commit(temp, step, config_digest, {name: entries[name] for name in names}, world_size, written_from)
        self.dist.barrier()
        return final

    def fresh_temp(self, step: int) -> str:
        """Collective: the empty `.tmp-` directory every rank writes `step`'s files into."""
        temp = os.path.join(self.root, TEMP_PREFIX + step_name(step))
        if self.dist.is_main:
            shutil.rmtree(temp, ignore_errors=True)
            os.makedirs(os.path.join(temp, "rng"), exist_ok=True)
            os.makedirs(os.path.join(temp, reshard.DIRECTORY), exist_ok=True)
        self.dist.barrier()
        return temp

    def rng_path(self, checkpoint: str) -> str:
        """This rank's RNG states in `checkpoint` (a complete one or a `.tmp-` directory)."""
        return os.path.join(checkpoint, "rng", f"rank-{self.dist.rank:05d}.pt")

    def commit(self, temp: str, step: int, config_digest: str, files: dict, world_size: Optional[int] = None,
               written_from: Optional[str] = None) -> str:
        """Rank 0, once every rank's files in `temp` are durable: manifest, COMPLETE, rename, prune."""
        final = os.path.join(self.root, step_name(step))
        manifest = {"step": step, "world_size": world_size or self.dist.world_size, "config_digest": config_digest,
                    "files": files}
        if written_from:  # not written by the training loop: where its files came from
            manifest["written_from"] = written_from
        write_json_atomically(os.path.join(temp, MANIFEST), manifest)
        self.pause.at("commit", step)
        with open(os.path.join(temp, COMPLETE), "w") as handle:
            handle.write(f"{step}\n")
            handle.flush()
            os.fsync(handle.fileno())
        for parent, _, _ in os.walk(temp):  # the files' names are durable too (deepspeed/, rng/)
            fsync_directory(parent)
        with open(os.path.join(temp, TRAINER_STATE), encoding="utf-8") as handle:
            best = json.load(handle).get(best_checkpoint.STATE_KEY)
        if os.path.exists(final):  # a checkpoint of this step from an earlier attempt
            shutil.rmtree(final)
        os.rename(temp, final)
        fsync_directory(self.root)
        if best and best.get("step") == step:  # only now complete and in place: the pointer may name it
            best_checkpoint.write_pointer(self.root, step_name(step), best)
        self._prune()
        return final

    def _prune(self) -> None:
        best = best_checkpoint.pointed_checkpoint(self.root)  # out of the rotation: kept beside the newest
        rotated = [path for path in self._complete_dirs() if os.path.basename(path) != best]
        for path in rotated[self.keep :]:
            doomed = os.path.join(self.root, TEMP_PREFIX + "delete-" + os.path.basename(path))
            os.rename(path, doomed)  # never a half-deleted directory that still looks complete
            shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, engine: Any, found: Found, scheduler: Any, seed: int) -> None:
        """Collective: restore weights, optimizer, LR schedule and RNG states, on any world size."""
        import torch

        written_by = int(found.manifest["world_size"])
        if written_by == self.dist.world_size:
            load_path, _ = engine.load_checkpoint(
                found.path,
                tag=DEEPSPEED_TAG,
                load_module_strict=False,  # frozen base weights come from the model, not the checkpoint
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
            if load_path is None:
                raise RuntimeError(f"DeepSpeed could not load checkpoint {found.path}")
        else:
            reshard.load(engine, found.path, written_by, self.dist.rank, self.dist.world_size)
            scheduler.load_state_dict(found.state["lr_scheduler"])
            # The optimizer's learning rate is the schedule's at the checkpoint, as DeepSpeed's
            # optimizer state would have given it back.
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr
            step = int(found.state["step"])
            engine.global_steps, engine.global_samples = step, step * int(found.state.get("global_batch", 0))
        if self.dist.rank < written_by:
            set_rng_states(torch.load(self.rng_path(found.path), weights_only=False))
        else:  # a rank the old world did not have: its own stream, the same on every such resume
            seed_everything(seed + 1_000_003 * (int(found.state["step"]) + 1) + self.dist.rank)


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


def _found(path: str) -> Found:
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
        manifest = json.load(handle)
    with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as handle:
        state = json.load(handle)
    return Found(path, manifest, state)


def check_compatible(found: Found, config_digest: str, changed: list[str]) -> None:
    """Raise UserError if `found` cannot be resumed by this run. The world size may differ."""
    name = os.path.basename(found.path)
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


def list_files(directory: str) -> list[str]:
    names = []
    for parent, _, files in os.walk(directory):
        for file in files:
            names.append(os.path.relpath(os.path.join(parent, file), directory))
    return sorted(names)


def fsync_file(path: str) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def rng_states() -> dict:
    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_rng_states(states: dict) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
