"""Building a Job from its layers: bundled defaults < site profile < job file < --set overrides.

The bundled defaults are the models' own defaults; a site profile (`jobgen.job.sites`) gives the
site's; the job file and `--set` overrides come last. The site's limits are checked on the
result by the caller, who knows what the scheduler calls a partition (`jobgen.job.sites.check_limits`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from jobgen.errors import InvalidJob, JobgenError, describe_errors
from jobgen.job.models import Job
from jobgen.job.nccl import not_nccl_warnings
from jobgen.job.sites import SiteProfile, load_site
from jobgen.job.yamlfile import DuplicateKey, Sexagesimal, check_shape, parse_yaml
from jobgen.job.yamlfile import read_yaml_mapping as _read_yaml


@dataclass(frozen=True)
class ResolvedJob:
    job: Job
    site: SiteProfile
    warnings: list[str]


def resolve_job(config: Path, site_name: Optional[str] = None, overrides: tuple[str, ...] = ()) -> ResolvedJob:
    """The validated job with every layer applied, and the warnings that do not stop it."""
    layered, site, replaced = _layers(config, site_name, overrides)
    resolved = validated(layered, site, str(config), overrides)
    return replace(resolved, warnings=replaced + resolved.warnings)


def layered_job(config: Path, site_name: Optional[str] = None, overrides: tuple[str, ...] = ()) -> tuple[dict[str, Any], SiteProfile]:
    """The job's layers merged, not yet validated (a sweep applies each point's values to it)."""
    layered, site, _ = _layers(config, site_name, overrides)
    return layered, site


def _layers(config: Path, site_name: Optional[str], overrides: tuple[str, ...]) -> tuple[dict[str, Any], SiteProfile, list[str]]:
    """layered_job's, and a warning for each list of the site profile that the job file replaced."""
    site = load_site(site_name)
    layered, replaced = layer_values(_read_yaml(config), site, str(config), overrides)
    return layered, site, replaced


def layer_values(values: dict[str, Any], site: SiteProfile, source: str, overrides: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A job's values (a job file's, or the Python API's) over the site profile's, then the
    overrides; and a warning for each list of the site profile that `values` replaced."""
    replaced: list[tuple[str, list[Any], Any]] = []
    layered = merge(copy.deepcopy(site.defaults), values, replaced=replaced)
    for override in overrides:
        apply_override(layered, override)
    return layered, [replaced_list_warning(key, dropped, source, site) for key, dropped, _ in replaced]


def replaced_list_warning(key: str, dropped: list[Any], source: str, site: SiteProfile) -> str:
    """One line: which key's list of the site profile the job file replaced, and what that dropped."""
    them = "it" if len(dropped) == 1 else "them"
    return (f"{key} in {source} replaces the site profile's list ({site.name}), dropping "
            f"{', '.join(str(item) for item in dropped)}: lists are not merged; add {them} to {key} in {source} "
            f"to keep {them}")


def validated(layered: dict[str, Any], site: SiteProfile, source: str, overrides: tuple[str, ...] = ()) -> ResolvedJob:
    """`layered` checked by the models; a mistake is one line per problem, each after `source`, or
    after `--set KEY=VALUE` where that override gave the value at fault."""
    try:
        job = Job.model_validate(layered)
    except ValidationError as error:
        items = error.errors()
        raise InvalidJob(
            "\n".join(describe_errors([item], Job, _source_of(item["loc"], source, overrides)) for item in items),
            fields=tuple(".".join(str(part) for part in item["loc"]) for item in items),
        ) from None
    return ResolvedJob(job=job, site=site, warnings=job_warnings(job))


def _source_of(loc: tuple[Any, ...], source: str, overrides: tuple[str, ...]) -> str:
    """The last --set that gave the value at `loc` (or the section holding it), else `source`."""
    path = [str(part) for part in loc]
    for assignment in reversed(overrides):
        key = assignment.partition("=")[0].strip().split(".")
        if path and path[: len(key)] == key:
            return f"--set {assignment!r}"
    return source


def merge(base: dict[str, Any], top: dict[str, Any], replaced: Optional[list[tuple[str, list[Any], Any]]] = None,
          prefix: str = "") -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in `top` replaces `base`. With
    `replaced`, each list of `base` that a list of `top` replaced and lost items of is appended to
    it as (dotted key, the items dropped, the new list)."""
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value, replaced, f"{prefix}{key}.")
        else:
            old = base.get(key)
            if replaced is not None and isinstance(old, list) and isinstance(value, list):
                dropped = [item for item in old if item not in value]
                if dropped:
                    replaced.append((f"{prefix}{key}", dropped, value))
            base[key] = copy.deepcopy(value)
    return base


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """`resources.nodes=4`: the value is read as YAML, so numbers, booleans and lists work."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise JobgenError(f"--set {assignment!r}: expected dotted.key=value, e.g. --set resources.nodes=4")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except DuplicateKey as error:
        raise JobgenError(f"--set {assignment!r}: {error.without_lines}") from None
    except ValueError:
        value = raw  # not YAML: the text itself, which validation then accepts or names
    if isinstance(value, Sexagesimal):
        value = value.text  # `--set resources.time_limit=24:00:00` means the time, not 86400 (base 60)
    check_shape(value, f"--set {key.strip()}")
    set_dotted(data, key.strip(), value, f"--set {assignment!r}")


def set_dotted(data: dict[str, Any], key: str, value: Any, where: str) -> None:
    """`data[a][b][c] = value` for the key `a.b.c`, making the sections it lacks."""
    parts = key.split(".")
    target = data
    for part in parts[:-1]:
        existing = target.get(part)
        if existing is None:
            existing = target[part] = {}
        if not isinstance(existing, dict):
            raise JobgenError(f"{where}: '{part}' is not a section")
        target = existing
    target[parts[-1]] = value


def job_warnings(job: Job) -> list[str]:
    """Choices that run but are probably not what the user wants."""
    warnings = _training_warnings(job) if job.training is not None else []
    if job.written_name != job.name:
        where = "job name" if job.run_dir else f"job name and the run directory {job.effective_run_dir}"
        warnings.append(f"name {job.name!r} is written {job.written_name!r} for the scheduler's {where}")
    warnings += not_nccl_warnings(job.environment.variables)
    return warnings


def _training_warnings(job: Job) -> list[str]:
    """job_warnings' part about jobgen-train's settings."""
    warnings = []
    if job.training.zero_stage == 3 and job.resources.max_nodes > 1:
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
        if job.training.global_batch_size:  # accumulation follows from it: the product would not be it
            made_of = (f"training.global_batch_size, split over {job.world_size} processes in micro-batches of at most "
                       f"{job.training.per_device_batch_size}")
        else:
            made_of = (f"per-device {job.training.per_device_batch_size} x {job.world_size} processes x accumulation "
                       f"{job.training.gradient_accumulation}")
        warnings.append(f"global batch {job.global_batch} ({made_of}) is outside 64-256, the usual range for LoRA fine-tunes")
    return warnings
