"""Site profiles: what an admin writes once for a cluster, where jobgen finds it, and its limits.

A profile is a YAML file; every key is optional and an unknown one is refused:

    description: One line for `jobgen sites list`.
    scheduler: slurm          # used when a command gives no --scheduler
    defaults:                 # any part of a job file, checked as one; the job file's values win
      resources: {partition: gpu, gpus_per_node: 8, cpus_per_node: 64}
      launch: {network: infiniband, launcher: srun}
      environment: {modules: [cuda/12.4]}
    limits:                   # per partition (Slurm) or queue (PBS Pro, Torque)
      gpu: {max_nodes: 16, max_time: "2-00:00:00", max_gpus_per_node: 8, max_cpus_per_node: 128}
    policy:                   # what jobs on this cluster may not do
      allow_trust_remote_code: false   # refuse training.trust_remote_code (a model's own code)
    templates: templates      # folder of template overrides, relative to the profile
    examples: examples        # folder of job files that `jobgen sites check` renders too

Profiles are found by name in `site_folders()`, first match wins; a path to a .yaml file also
works. A user's default site is `site: NAME` in `user_config_file()`; `--site none` opts out.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Iterator, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from jobgen.errors import JobgenError, describe_errors, describe_validation_error
from jobgen.job.models import SCHEDULER_NAME, Job, parse_time_limit, refuse_number_as_time
from jobgen.resources import bundled_path
from jobgen.job.yamlfile import read_yaml_mapping

NO_SITE = "none"
PROFILE_KEYS = ("description", "scheduler", "defaults", "limits", "policy", "templates", "examples")


class PartitionLimits(BaseModel):
    """What one partition or queue allows; a job asking for more is refused before it is submitted."""

    model_config = ConfigDict(extra="forbid")

    max_nodes: Optional[int] = Field(None, ge=1)
    max_time: Optional[str] = Field(None, description="[D-]HH:MM:SS")
    max_gpus_per_node: Optional[int] = Field(None, ge=0)
    max_cpus_per_node: Optional[int] = Field(None, ge=1)

    @field_validator("max_time", mode="before")
    @classmethod
    def _time_is_text(cls, value: object) -> object:
        return refuse_number_as_time(value, "max_time", "48:00:00")

    @field_validator("max_time")
    @classmethod
    def _time_parses(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_time_limit(value)
            return value.strip()
        return value


class SitePolicy(BaseModel):
    """What an admin forbids every job on the cluster."""

    model_config = ConfigDict(extra="forbid")

    allow_trust_remote_code: bool = Field(
        True, description="false: refuse jobs with training.trust_remote_code (code shipped with a model runs on the nodes)"
    )


class ProfileFile(BaseModel):
    """The keys of a profile file; `defaults` is checked against the job model separately."""

    model_config = ConfigDict(extra="forbid")

    description: Optional[str] = None
    scheduler: Optional[str] = Field(None, pattern=r"^[a-z][a-z0-9_-]*$")
    defaults: dict[str, Any] = Field(default_factory=dict)
    limits: dict[Annotated[str, StringConstraints(pattern=SCHEDULER_NAME)], PartitionLimits] = Field(default_factory=dict)
    policy: SitePolicy = Field(default_factory=SitePolicy)
    templates: Optional[str] = None
    examples: Optional[str] = None


@dataclass(frozen=True)
class SiteProfile:
    """A loaded profile; `name` empty and `path` None mean no site."""

    name: str
    path: Optional[Path]
    defaults: dict[str, Any] = field(default_factory=dict)
    template_dir: Optional[Path] = None
    scheduler: Optional[str] = None
    limits: dict[str, PartitionLimits] = field(default_factory=dict)
    examples_dir: Optional[Path] = None
    description: str = ""
    policy: SitePolicy = field(default_factory=SitePolicy)


@dataclass(frozen=True)
class SiteFolder:
    """One folder of the site search path, and why it is there (shown by `jobgen sites list`)."""

    origin: str
    path: Path


def user_config_dir() -> Path:
    """$XDG_CONFIG_HOME/jobgen, ~/.config/jobgen when unset (a relative value is ignored, as XDG says)."""
    config_home = os.environ.get("XDG_CONFIG_HOME", "")
    return (Path(config_home) if os.path.isabs(config_home) else Path.home() / ".config") / "jobgen"


def user_config_file() -> Path:
    return user_config_dir() / "config.yaml"


def site_folders() -> Iterator[SiteFolder]:
    """Where profiles are looked up by name, first match first; the bundled examples come last.

    Lazily: installed site packages (entry-point group `jobgen.sites`) are looked up only when a
    search gets past /etc/jobgen/sites, so a site's own profile costs no entry-point scan."""
    for folder in os.environ.get("JOBGEN_SITE_PATH", "").split(":"):
        if folder:
            yield SiteFolder("$JOBGEN_SITE_PATH", Path(folder))
    yield SiteFolder("user config", user_config_dir() / "sites")
    yield SiteFolder("system", Path("/etc/jobgen/sites"))
    from jobgen.plugins import site_package_folders

    for name, package in site_package_folders():
        yield SiteFolder(f"site package {name}", package / "sites")
    yield SiteFolder("bundled", bundled_path("configs") / "sites")


def find_site(name: str, first_only: bool = False) -> list[tuple[SiteFolder, Path]]:
    """Every profile file named `name` on the search path: the first is used, the others are shadowed."""
    found = []
    for folder in site_folders():
        path = folder.path / f"{name}.yaml"
        if path.is_file():
            found.append((folder, path))
            if first_only:
                break
    return found


def all_sites() -> dict[str, list[tuple[SiteFolder, Path]]]:
    """Every profile on the search path by name, each with the files of that name in search order."""
    sites: dict[str, list[tuple[SiteFolder, Path]]] = {}
    for folder in site_folders():
        try:
            paths = sorted(folder.path.glob("*.yaml"))
        except OSError:
            continue  # an unreadable folder holds nothing this user can use
        for path in paths:
            if path.is_file():
                sites.setdefault(path.stem, []).append((folder, path))
    return dict(sorted(sites.items()))


def chosen_site(option: Optional[str]) -> Optional[str]:
    """The site a command uses: --site NAME, else the user's default; `none` in either means no site."""
    name = option if option is not None else default_site()
    return None if name in (None, "", NO_SITE) else name


def default_site() -> Optional[str]:
    """`site:` in the user's config file, None when the file or the key is absent."""
    path = user_config_file()
    if not path.is_file():
        return None
    data = read_yaml_mapping(path, "site: NAME")
    try:
        return _UserConfig.model_validate(data).site
    except ValidationError as error:
        raise JobgenError(describe_validation_error(error, _UserConfig, str(path))) from None


class _UserConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    site: Optional[str] = Field(None, description="the site profile every command uses unless given --site")


def load_site(name: Optional[str]) -> SiteProfile:
    """The profile `name` (a name on the search path, or a .yaml file), checked; no site for None."""
    if not name:
        return SiteProfile(name="", path=None)
    path = Path(name)
    if not (name.endswith((".yaml", ".yml")) and path.is_file()):
        found = find_site(name, first_only=True)
        if not found:
            looked = ", ".join(str(folder.path) for folder in site_folders())
            raise JobgenError(f"site profile '{name}' not found; looked in {looked} (set JOBGEN_SITE_PATH to add a folder)")
        path = found[0][1]
    return read_profile(path, name)


def read_profile(path: Path, name: str) -> SiteProfile:
    data = read_yaml_mapping(path, "defaults:, limits:, ...")
    unknown = set(data) - set(PROFILE_KEYS)
    if unknown:
        first = min(str(key) for key in unknown)  # YAML keys may be numbers or null too
        raise JobgenError(f"{path}: unknown key '{first}' in site profile; known keys: {', '.join(PROFILE_KEYS)}")
    if not isinstance(data.get("defaults") or {}, dict):
        raise JobgenError(f"{path}: 'defaults' must be a mapping of job keys")
    for key in ("templates", "examples"):
        folder = data.get(key)
        if folder is not None and (not isinstance(folder, str) or "\0" in folder):
            raise JobgenError(f"{path}: '{key}' is {folder!r:.80}; expected the name of a folder, relative to the profile")
    try:
        profile = ProfileFile.model_validate({key: value for key, value in data.items() if value is not None})
    except ValidationError as error:
        raise JobgenError(describe_validation_error(error, ProfileFile, str(path))) from None
    _check_defaults(profile.defaults, path)
    return SiteProfile(
        name=name,
        path=path,
        defaults=profile.defaults,
        template_dir=_folder(path, "templates", profile.templates),
        scheduler=profile.scheduler,
        limits=profile.limits,
        examples_dir=_folder(path, "examples", profile.examples),
        description=(profile.description or "").strip(),
        policy=profile.policy,
    )


def _folder(path: Path, key: str, name: Optional[str]) -> Optional[Path]:
    if not name:
        return None
    folder = (path.parent / name).resolve()
    if not os.path.isdir(folder):  # False, not an error, for a name too long to exist
        raise JobgenError(f"{path}: '{key}' folder {folder} does not exist")
    return folder


def _check_defaults(defaults: dict[str, Any], path: Path) -> None:
    """Each default is checked as the job field it sets, where the profile is, not in every job.

    A profile holds part of a job, so what only a whole job can satisfy is left to the job: the
    fields a job must give (training.model, ...) and checks across fields (procs vs GPUs)."""
    probe = copy.deepcopy(defaults)
    training = probe.setdefault("training", {})
    if isinstance(training, dict):
        training.setdefault("model", "-")
        training.setdefault("data", "-")
    try:
        Job.model_validate(probe)
    except ValidationError as error:
        problems = [item for item in error.errors() if item["loc"] and item["type"] != "missing"]
        if problems:
            raise JobgenError(describe_errors(problems, Job, f"{path}: defaults")) from None


def check_limits(job: Job, site: SiteProfile, source: str, partition_word: str = "partition") -> None:
    """Refuses a job that asks its partition for more than the site allows: one line per limit,
    naming the field to change. `partition_word` is what the site's scheduler calls a partition
    (PBS: a queue); the caller, who knows the scheduler, says it."""
    partition = job.resources.partition
    limits = site.limits.get(partition) if partition else None
    if limits is None:
        return
    resources, word = job.resources, partition_word
    over: list[tuple[str, str, str]] = []  # (field, what the partition allows, what the job asks)
    if limits.max_nodes is not None and resources.max_nodes > limits.max_nodes:
        over.append(("resources.nodes", f"at most {limits.max_nodes} nodes", f"{resources.nodes}"))
    if limits.max_time is not None and resources.time_limit_seconds > parse_time_limit(limits.max_time):
        over.append(("resources.time_limit", f"at most {limits.max_time}", resources.time_limit))
    if limits.max_gpus_per_node is not None and resources.gpus_per_node > limits.max_gpus_per_node:
        over.append(("resources.gpus_per_node", f"at most {limits.max_gpus_per_node} GPUs per node", f"{resources.gpus_per_node}"))
    if limits.max_cpus_per_node is not None and job.cpus_per_node > limits.max_cpus_per_node:
        # cpus_per_node defaults to one per process, so the job may not have written it.
        over.append(("resources.cpus_per_node", f"at most {limits.max_cpus_per_node} CPUs per node", f"{job.cpus_per_node}"))
    if over:
        raise JobgenError("\n".join(
            f"{source}: {word} {partition} allows {allowed}; the job asks for {asked}: "
            f"lower '{name}' or choose another {word} (limits of site {site.name})"
            for name, allowed, asked in over
        ))


def check_policy(job: Job, site: SiteProfile, source: str) -> None:
    """Refuses a job that does what the site's policy forbids, naming the field and the profile."""
    if job.training is not None and job.training.trust_remote_code and not site.policy.allow_trust_remote_code:
        raise JobgenError(
            f"{source}: training.trust_remote_code is true, but site {site.name} forbids running a model's own code "
            f"(policy.allow_trust_remote_code: false in {site.path}); use a model that transformers supports"
        )
