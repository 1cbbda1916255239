"""A job written back as YAML: complete, or as set, with what lets a reader rebuild it exactly.

As set, only the values that differ from the models' defaults are written: what the job file,
the site profile and --set chose. The batch script embeds the job so, for the admin who reviews
it; `jobgen-train` adds its own defaults back (`jobgen.job.layers.resolve_job`, as for any job
file). The first lines say which jobgen wrote it and the sha256 of the complete job, and the
trainer runs the job only if it rebuilds that very job (`check_rebuilt`): a jobgen on the nodes
whose defaults differ from the login node's is refused in one line, instead of running a job
nobody reviewed.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import yaml

from jobgen import __version__
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.job.yamlfile import parse_yaml

_COMPLETE = "# complete job: jobgen {version}, sha256 {digest}"
_COMPLETE_LINE = re.compile(r"^# complete job: jobgen (\S+), sha256 ([0-9a-f]{64})$", re.MULTILINE)


def complete_yaml(job: Job) -> str:
    """Every field, defaults spelled out."""
    return _dump(job.model_dump(mode="json"))


def as_set_yaml(job: Job) -> str:
    """The values that differ from the defaults, after lines that name this jobgen and the
    complete job's sha256; the complete job where that would not rebuild it (no job jobgen knows)."""
    heading = "\n".join([
        "# The values that differ from the defaults (`jobgen schema` lists them); jobgen-train adds its",
        "# own defaults back and runs the job only if it rebuilds this one:",
        _COMPLETE.format(version=__version__, digest=digest(job)),
    ]) + "\n"
    text = heading + _dump(job.model_dump(mode="json", exclude_defaults=True))
    if Job.model_validate(parse_yaml(text)) != job:  # read back as the trainer reads it
        text = heading + complete_yaml(job)
    return text


def digest(job: Job) -> str:
    """sha256 of the complete job, the same for equal jobs whatever wrote them."""
    canonical = json.dumps(job.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_rebuilt(job: Job, text: str, source: str) -> None:
    """JobgenError unless `job`, read from `text`, is the complete job its `# complete job:` line
    names; a job file without that line (one a person wrote) passes as it is."""
    found = _COMPLETE_LINE.search(text)
    if found is None or found.group(2) == digest(job):
        return
    written_by = found.group(1)
    if written_by != __version__:
        raise JobgenError(
            f"{source}: jobgen {written_by} wrote this job with only the values that differ from its defaults, "
            f"and jobgen {__version__} here fills in other defaults, so it would run a job other than the one "
            f"rendered: run jobgen {written_by} here (environment.setup), or render and submit the job again with "
            f"jobgen {__version__}"
        )
    raise JobgenError(
        f"{source}: not the job jobgen rendered (the sha256 of the complete job differs): it was edited after "
        "rendering; to run it as it is now, delete its '# complete job:' line"
    )


def _dump(values: dict[str, Any]) -> str:
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(values, Dumper=dumper, sort_keys=False, default_flow_style=False, width=1000)
