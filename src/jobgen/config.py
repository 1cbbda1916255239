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
from jobgen.textfile import not_utf8_message

# libyaml's loader where PyYAML has it: the same safe subset, faster on the CLI's start-up path.
SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# A job is three levels deep and a few dozen values; these bounds only stop a file that would
# make validating it hang (YAML aliases that expand to millions of values, or nest forever).
MAX_DEPTH = 32
MAX_VALUES = 10_000


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
        first = min(str(key) for key in unknown)  # YAML keys may be numbers or null too
        raise JobgenError(f"{path}: unknown key '{first}' in site profile; known keys: defaults, templates, description")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise JobgenError(f"{path}: 'defaults' must be a mapping of job keys")
    template_dir = None
    templates = data.get("templates")
    if templates is not None and (not isinstance(templates, str) or "\0" in templates):
        raise JobgenError(f"{path}: 'templates' is {templates!r:.80}; expected the name of a folder, relative to the profile")
    if templates:
        template_dir = (path.parent / templates).resolve()
        if not os.path.isdir(template_dir):  # False, not an error, for a name too long to exist
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
        value = parse_yaml(raw) if raw.strip() else ""
    except ValueError:
        value = raw  # not YAML: the text itself, which validation then accepts or names
    check_shape(value, f"--set {key.strip()}")
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
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise JobgenError(f"{path}: no such file") from None
    except OSError as error:
        raise JobgenError(f"{path}: cannot read: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JobgenError(f"{path}: {not_utf8_message(raw)}") from None
    try:
        data = parse_yaml(text)
    except ValueError as error:
        raise JobgenError(f"{path}: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobgenError(f"{path}: expected a mapping of keys (resources:, training:, ...), found {type(data).__name__}")
    check_shape(data, str(path))
    return data


def parse_yaml(text: str) -> Any:
    """`text` as YAML (the safe subset); ValueError with one line saying where and what is wrong."""
    try:
        return yaml.load(text, Loader=SafeLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"invalid YAML{where}: {error.problem or error.context or 'not valid YAML'}") from None
    except yaml.reader.ReaderError as error:
        raise ValueError(_unacceptable_character(text, error.character)) from None
    except yaml.YAMLError:
        raise ValueError("invalid YAML") from None
    except RecursionError:
        raise ValueError(f"invalid YAML: nested more than {MAX_DEPTH} levels deep") from None
    except Exception as error:  # noqa: BLE001 - a tag's constructor (int, date, binary) fails in its own way
        reason = str(error).split(";")[0].splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"invalid YAML: a value cannot be read: {reason}") from None


def _unacceptable_character(text: str, character: int) -> str:
    # libyaml reports a byte offset and PyYAML a character offset; the first such character is
    # the one both stopped at.
    index = text.find(chr(character))
    line = text.count("\n", 0, index) + 1
    column = index - (text.rfind("\n", 0, index) + 1) + 1
    return f"invalid YAML: character U+{character:04X} at line {line}, column {column} is not allowed in YAML text"


def check_shape(value: Any, where: str) -> None:
    """Refuse what no job has and what would make validating it hang or its messages unreadable:
    aliases that expand to millions of values (`a: &a [x, x]`, `b: [*a, *a]`, ...), a value that
    contains itself, nesting deeper than any job's, a key with a line break or control character."""
    stack, count = [(value, 1)], 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise JobgenError(f"{where}: more than {MAX_VALUES} values once YAML aliases are expanded; a job has a few dozen")
        if depth > MAX_DEPTH:
            raise JobgenError(f"{where}: nested more than {MAX_DEPTH} levels deep (or a YAML alias that contains itself)")
        if isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not key.isprintable():
                    raise JobgenError(f"{where}: key {key!r} has a character that is not printable; keys are names like 'nodes'")
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
