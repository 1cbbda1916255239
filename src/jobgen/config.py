"""Building a Job from its layers: bundled defaults < site profile < job file < --set overrides.

The bundled defaults are the models' own defaults. A site profile is a YAML file an admin keeps:

    defaults:            # any part of a job file
      resources: {partition: gpu, account: ml}
      launch: {network: infiniband, socket_ifname: ib0}
    templates: templates # optional folder of template overrides, relative to the profile

Profiles are found by name in $JOBGEN_SITE_PATH (colon-separated folders), ~/.config/jobgen/sites,
/etc/jobgen/sites and the bundled configs/sites, in that order; a path to a .yaml file also works.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from jobgen.errors import JobgenError, describe_validation_error
from jobgen.models import Job
from jobgen.resources import bundled_path

# libyaml's loader where PyYAML has it: the same safe subset, faster on the CLI's start-up path.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class SiteProfile:
    name: str
    path: Optional[Path]
    defaults: dict[str, Any] = field(default_factory=dict)
    template_dir: Optional[Path] = None


@dataclass(frozen=True)
class ResolvedJob:
    job: Job
    site: SiteProfile
    warnings: list[str]


def site_search_path() -> list[Path]:
    folders = [Path(p) for p in os.environ.get("JOBGEN_SITE_PATH", "").split(":") if p]
    folders += [Path.home() / ".config/jobgen/sites", Path("/etc/jobgen/sites"), bundled_path("configs") / "sites"]
    return folders


def load_site(name: Optional[str]) -> SiteProfile:
    if not name:
        return SiteProfile(name="", path=None)
    path = Path(name)
    if not (name.endswith((".yaml", ".yml")) and path.is_file()):
        candidates = [folder / f"{name}.yaml" for folder in site_search_path()]
        found = [c for c in candidates if c.is_file()]
        if not found:
            looked = ", ".join(str(c.parent) for c in candidates)
            raise JobgenError(f"site profile '{name}' not found; looked in {looked} (set JOBGEN_SITE_PATH to add a folder)")
        path = found[0]
    data = _read_yaml(path)
    unknown = set(data) - {"defaults", "templates", "description"}
    if unknown:
        raise JobgenError(f"{path}: unknown key '{sorted(unknown)[0]}' in site profile; known keys: defaults, templates, description")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise JobgenError(f"{path}: 'defaults' must be a mapping of job keys")
    template_dir = None
    if data.get("templates"):
        template_dir = (path.parent / str(data["templates"])).resolve()
        if not template_dir.is_dir():
            raise JobgenError(f"{path}: 'templates' folder {template_dir} does not exist")
    return SiteProfile(name=name, path=path, defaults=defaults, template_dir=template_dir)


def resolve_job(config: Path, site_name: Optional[str] = None, overrides: tuple[str, ...] = ()) -> ResolvedJob:
    """The validated job with every layer applied, and the warnings that do not stop it."""
    site = load_site(site_name)
    layered = merge(copy.deepcopy(site.defaults), _read_yaml(config))
    for override in overrides:
        apply_override(layered, override)
    try:
        job = Job.model_validate(layered)
    except ValidationError as error:
        raise JobgenError(describe_validation_error(error, Job, str(config))) from None
    return ResolvedJob(job=job, site=site, warnings=job_warnings(job))


def merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in `top` replaces `base`."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """`resources.nodes=4`: the value is read as YAML, so numbers, booleans and lists work."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise JobgenError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set resources.nodes=4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.strip().split(".")
    target = data
    for part in parts[:-1]:
        existing = target.get(part)
        if existing is None:
            existing = target[part] = {}
        if not isinstance(existing, dict):
            raise JobgenError(f"--set {assignment!r}: '{part}' is not a section")
        target = existing
    target[parts[-1]] = value


def job_warnings(job: Job) -> list[str]:
    """Choices that run but are probably not what the user wants."""
    warnings = []
    if job.training.zero_stage == 3 and job.resources.nodes > 1:
        warnings.append(
            "training.zero_stage 3 across nodes gathers every layer over the network each step; "
            "ZeRO-2 is usually faster when the model fits"
        )
    estimate = job.training.step_seconds_estimate
    usable = job.resources.time_limit_seconds - (job.requeue.warning_seconds if job.requeue.enabled else 0)
    if estimate and job.training.save_interval * estimate > usable:
        warnings.append(
            f"training.save_interval {job.training.save_interval} steps x {estimate:g} s is longer than the "
            f"{usable} s the time limit leaves: a lost node would lose the whole segment; lower save_interval"
        )
    probe = job.launch.entrypoint == "jobgen-probe"
    if not probe and job.training.method in ("lora", "qlora") and not 64 <= job.global_batch <= 256:
        warnings.append(
            f"global batch {job.global_batch} (per-device {job.training.per_device_batch_size} x "
            f"{job.world_size} processes x accumulation {job.training.gradient_accumulation}) is outside "
            "64-256, the usual range for LoRA fine-tunes"
        )
    return warnings


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise JobgenError(f"{path}: no such file") from None
    except OSError as error:
        raise JobgenError(f"{path}: cannot read: {error.strerror}") from None
    try:
        data = yaml.load(text, Loader=SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or "not valid YAML"
        raise JobgenError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobgenError(f"{path}: expected a mapping of keys (resources:, training:, ...), found {type(data).__name__}")
    return data
