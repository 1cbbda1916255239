"""A hub model in the Hugging Face cache, as the `huggingface_hub` library lays it out, read without
importing it (nor torch or transformers):

    HUB_CACHE/models--ORG--NAME/refs/REVISION         the commit a branch or tag points at
    HUB_CACHE/models--ORG--NAME/snapshots/COMMIT/...  the files, links into blobs/

HUB_CACHE is found as huggingface_hub.constants finds it: HF_HUB_CACHE, else the legacy
HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, HF_HOME defaulting to $XDG_CACHE_HOME/huggingface, else
~/.cache/huggingface; each with ~ and $VARS expanded. The job's cache is the one its
`environment.variables` give the nodes, else the submitting user's (`job_cache`); on a node, the
environment the trainer runs in (`environment_cache`).

A model is *staged* when its revision resolves to a snapshot folder, and *complete* when that
folder also holds config.json, a tokenizer, and the weights (every file a weight index names, or
one weights file). A staged model runs with the hub offline on the nodes (`go_offline`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Mapping, Optional

DEFAULT_REVISION = "main"
COMMIT = re.compile(r"^[0-9a-f]{40}$")  # file_download.REGEX_COMMIT_HASH
# The variables that choose the cache, in huggingface_hub's order of precedence.
CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # either one switches the library offline
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")  # tokenizer_config.json alone is not one
FIX = "run `jobgen prepare JOB.yaml` on a machine with internet"


@dataclass(frozen=True)
class HubCache:
    """A hub cache folder, and how it was chosen (for messages: `HF_HOME=/shared/hf`)."""

    path: str
    chosen_by: str


@dataclass(frozen=True)
class CachedModel:
    """What the cache holds of `model` at `revision`."""

    model: str
    revision: str
    cache: HubCache
    commit: Optional[str] = None  # the snapshot the revision resolves to; None when not staged
    missing: list[str] = field(default_factory=list)  # needed files the snapshot lacks

    @property
    def staged(self) -> bool:
        return self.commit is not None

    @property
    def complete(self) -> bool:
        return self.staged and not self.missing

    @property
    def snapshot(self) -> Optional[str]:
        return os.path.join(repo_folder(self.cache.path, self.model), "snapshots", self.commit) if self.commit else None

    def at(self) -> str:
        return self.model if self.revision == DEFAULT_REVISION else f"{self.model} at revision {self.revision}"

    def problem(self, offline: str = "") -> Optional[str]:
        """One line for `training.model` when the model is not complete; None when it is.
        `offline`: HF_HUB_OFFLINE's value, where the hub is off (a node cannot download it)."""
        where = f"the cache the nodes use ({self.cache.chosen_by})"
        if not self.staged and offline:
            return f"training.model: {self.at()} is not in {where} and the hub is offline (HF_HUB_OFFLINE={offline}): {FIX}"
        if not self.staged:
            return f"training.model: {self.at()} is not in {where}: {FIX}, or the nodes will try to download it"
        if self.missing:
            return (f"training.model: {self.at()} (commit {self.commit[:12]}) is incomplete in {where}: "
                    f"{', '.join(self.missing)} missing from {self.snapshot}; {FIX}")
        return None


def hub_cache(env: Mapping[str, str]) -> HubCache:
    """The hub cache `env` selects, by huggingface_hub.constants' rules."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name) is not None:
            return HubCache(_expand(env[name]), f"{name}={env[name]}")
    path = os.path.join(hf_home(env), "hub")
    if env.get("HF_HOME") is not None:
        return HubCache(path, f"HF_HOME={env['HF_HOME']}")
    return HubCache(path, f"the default cache {path}")


def hf_home(env: Mapping[str, str]) -> str:
    """huggingface_hub's home folder (its token and, unless HF_HUB_CACHE moves it, hub/)."""
    if env.get("HF_HOME") is not None:
        return _expand(env["HF_HOME"])
    return os.path.join(_expand(env.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))), "huggingface")


def job_cache(variables: Mapping[str, str]) -> HubCache:
    """The cache a job's nodes use: the one its environment.variables choose, else this user's."""
    if any(name in variables for name in CACHE_VARIABLES):
        return hub_cache(variables)
    return hub_cache(os.environ)


def environment_cache() -> HubCache:
    """The cache this process would use (a node's, inside the job)."""
    return hub_cache(os.environ)


def repo_folder(cache_path: str, model: str) -> str:
    """file_download.repo_folder_name for a model: models--ORG--NAME."""
    return os.path.join(cache_path, "models--" + model.replace("/", "--"))


def look_up(model: str, revision: str, cache: HubCache) -> CachedModel:
    """What `cache` holds of hub model `model` at `revision` (a branch, tag or commit)."""
    folder = repo_folder(cache.path, model)
    commit = resolve_commit(folder, revision)
    if commit is None:
        return CachedModel(model, revision, cache)
    return CachedModel(model, revision, cache, commit, missing_files(os.path.join(folder, "snapshots", commit)))


def resolve_commit(folder: str, revision: str) -> Optional[str]:
    """The commit `revision` points at in a repo folder, as snapshot_download offline resolves it;
    None when there is no snapshot for it."""
    commit = revision
    if not COMMIT.match(revision):
        try:
            with open(os.path.join(folder, "refs", revision), encoding="utf-8") as handle:
                commit = handle.read().strip()
        except (OSError, ValueError):
            return None
    return commit if commit and os.path.isdir(os.path.join(folder, "snapshots", commit)) else None


def missing_files(snapshot: str) -> list[str]:
    """What training needs that `snapshot` lacks (a link into blobs/ whose blob is gone counts as
    missing): config.json, a tokenizer, and the weights."""
    def there(name: str) -> bool:
        return os.path.isfile(os.path.join(snapshot, name))

    missing = [] if there("config.json") else ["config.json"]
    if not any(there(name) for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    index = next((name for name in WEIGHT_INDEXES if there(name)), None)
    if index is not None:
        missing += [name for name in _indexed_files(os.path.join(snapshot, index)) if not there(name)]
    elif not any(there(name) for name in WEIGHT_FILES):
        missing.append(f"the weights ({' or '.join(WEIGHT_FILES)})")
    return missing


def user_set_offline(env: Mapping[str, str]) -> bool:
    """Whether `env` already says online or offline: a user's choice is never overridden."""
    return any(env.get(name) not in (None, "") for name in OFFLINE_VARIABLES)


def _indexed_files(index: str) -> list[str]:
    try:
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return [os.path.basename(index) + " (unreadable)"]
    return sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []


def _expand(path: str) -> str:
    return os.path.expandvars(os.path.expanduser(path))
