"""A sweep: one job file, many points, each point the job with a few values changed.

    --sweep training.learning_rate=1e-4,2e-4 --sweep training.lora.r=8,16

is a grid: every combination of the values (the first key varies slowest), four points here. A
sweep file (--sweep-file) adds a grid and a list of points, and the most tasks to run at once:

    max_running: 2
    grid:
      training.learning_rate: [1e-4, 2e-4]
    points:                       # each listed point is combined with every grid point
      - {training.lora.r: 8, training.lora.alpha: 16}
      - {training.lora.r: 16, training.lora.alpha: 32}

Each point is named by its values (`learning_rate=1e-4,r=8`: the last part of each key unless two
keys share it; `+` between them in a container job, whose mount list is comma-separated), and runs in its own run directory under the sweep's: RUN_DIR/POINT_NAME. A point's
job is the base job (every layer applied) with its values set as `--set` sets them, validated by
the models like any job; a bad key or value names the point.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from jobgen.errors import JobgenError
from jobgen.job.layers import ResolvedJob, set_dotted, validated
from jobgen.job.yamlfile import DuplicateKey, Sexagesimal, check_shape, parse_yaml, read_yaml_mapping

SWEEP_FILE_KEYS = ("grid", "points", "max_running")
# What the sweep itself decides for every point: where it runs and what the scheduler calls it.
NOT_SWEEPABLE = ("name", "run_dir")
MAX_POINTS = 1000  # a Slurm array's default MaxArraySize is 1001 tasks
_SEPARATOR = ","  # between a name's key=value parts (as Hydra's multirun names its folders)
# A container's mount list is comma-separated (the run directory is mounted): its points use this.
CONTAINER_SEPARATOR = "+"
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]+")  # in a folder name: no '/', spaces, quotes or ':'
MAX_NAME = 120


@dataclass(frozen=True)
class Value:
    """A swept value, and its text as the user wrote it (`1e-4`, not 0.0001) for the point's name."""

    value: Any
    text: str


@dataclass(frozen=True)
class Point:
    index: int  # the task number in a job array: 0, 1, ...
    name: str  # the run directory's name, under the sweep's
    values: dict[str, Value]  # dotted key -> value, in the order the keys were given

    def plain_values(self) -> dict[str, Any]:
        return {key: found.value for key, found in self.values.items()}

    def describe(self) -> str:
        return _SEPARATOR.join(f"{key}={found.text}" for key, found in self.values.items())


@dataclass(frozen=True)
class Sweep:
    points: list[Point]
    max_running: Optional[int]  # at most this many points run at once; None: as many as the queue allows

    @property
    def keys(self) -> list[str]:
        return list(self.points[0].values) if self.points else []


def parse_sweep_option(text: str) -> tuple[str, list[Value]]:
    """`training.learning_rate=1e-4,2e-4`: the key and its values, each read as YAML (as --set reads one)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise JobgenError(f"--sweep {text!r}: expected dotted.key=VALUE,VALUE,..., e.g. --sweep training.learning_rate=1e-4,2e-4")
    values = [_read_value(part.strip(), f"--sweep {key}") for part in _split_top_level(raw)]
    if any(not value.text for value in values):
        raise JobgenError(f"--sweep {text!r}: an empty value; separate the values with single commas")
    _check_key(key, f"--sweep {key}")
    return key, values


def read_sweep_file(path: Path) -> tuple[list[tuple[str, list[Value]]], list[dict[str, Value]], Optional[int]]:
    """A sweep file's grid (key and values), its listed points and its max_running."""
    data = read_yaml_mapping(path, "grid:, points:, max_running:")
    unknown = [key for key in data if key not in SWEEP_FILE_KEYS]
    if unknown:
        raise JobgenError(f"{path}: unknown key '{unknown[0]}'; a sweep file has {', '.join(SWEEP_FILE_KEYS)}")
    grid_data = data.get("grid") or {}
    if not isinstance(grid_data, dict):
        raise JobgenError(f"{path}: 'grid' is a mapping of dotted.key: [values], e.g. training.learning_rate: [1.0e-4, 2.0e-4]")
    grid = []
    for key, values in grid_data.items():
        where = f"{path}: grid: {key}"
        if not isinstance(values, list) or not values:
            raise JobgenError(f"{where}: expected a list of values, e.g. {key}: [1, 2]")
        _check_key(str(key), where)
        grid.append((str(key), [Value(value, _text_of(value)) for value in values]))
    points_data = data.get("points") or []
    if not isinstance(points_data, list):
        raise JobgenError(f"{path}: 'points' is a list of mappings, e.g. - {{training.lora.r: 8, training.lora.alpha: 16}}")
    points = []
    for number, entry in enumerate(points_data, 1):
        where = f"{path}: point {number}"
        if not isinstance(entry, dict) or not entry:
            raise JobgenError(f"{where}: expected a mapping of dotted.key: value, e.g. {{training.lora.r: 8}}")
        for key in entry:
            _check_key(str(key), where)
        points.append({str(key): Value(value, _text_of(value)) for key, value in entry.items()})
    return grid, points, _max_running(data.get("max_running"), f"{path}: max_running")


def make_sweep(
    options: tuple[str, ...] = (), sweep_file: Optional[Path] = None, max_running: Optional[int] = None,
    separator: str = _SEPARATOR,
) -> Optional[Sweep]:
    """The sweep that --sweep and --sweep-file describe; None when they describe none. `separator`
    goes between the key=value parts of a point's name (CONTAINER_SEPARATOR for a container job)."""
    grid = [parse_sweep_option(text) for text in options]
    listed: list[dict[str, Value]] = []
    file_limit = None
    if sweep_file is not None:
        file_grid, listed, file_limit = read_sweep_file(sweep_file)
        grid = file_grid + grid
    if not grid and not listed:
        if max_running is not None:
            raise JobgenError("--max-running limits a sweep: give --sweep KEY=V1,V2 or --sweep-file too")
        return None
    keys = [key for key, _ in grid]
    for key in keys:
        if keys.count(key) > 1:
            raise JobgenError(f"--sweep {key}: given twice; list all its values once, e.g. --sweep {key}=1,2,3")
    combos = []
    for chosen in (listed or [{}]):
        clash = [key for key in chosen if key in keys]
        if clash:
            raise JobgenError(f"sweep: '{clash[0]}' is both a grid key and a listed point's key; give it in one place")
        for values in itertools.product(*(values for _, values in grid)):
            combos.append({**chosen, **dict(zip(keys, values))})
    if len(combos) > MAX_POINTS:
        raise JobgenError(f"sweep: {len(combos)} points; at most {MAX_POINTS} (a Slurm array's usual MaxArraySize): split the sweep")
    names = point_names(combos, separator)
    return Sweep(
        points=[Point(index=i, name=name, values=combo) for i, (name, combo) in enumerate(zip(names, combos))],
        max_running=_max_running(max_running, "--max-running") if max_running is not None else file_limit,
    )


def point_names(combos: list[dict[str, Value]], separator: str = _SEPARATOR) -> list[str]:
    """A folder name per point, from its values: readable (`learning_rate=1e-4,r=8`), safe in a
    path and a shell word, and unique (a clash or an over-long name gets its index)."""
    all_keys = list(dict.fromkeys(key for combo in combos for key in combo))
    short = {key: key.rsplit(".", 1)[-1] for key in all_keys}
    labels = {key: (short[key] if list(short.values()).count(short[key]) == 1 else key) for key in all_keys}
    names = []
    for index, combo in enumerate(combos):
        name = separator.join(f"{labels[key]}={_UNSAFE.sub('-', value.text)}" for key, value in combo.items())
        name = name.strip(".") or f"point{index}"
        if len(name) > MAX_NAME:
            name = f"{name[:MAX_NAME - 10]}..{index}"
        names.append(name)
    clashing = {name for name in names if names.count(name) > 1}
    return [f"{name}{separator}{index}" if name in clashing else name for index, name in enumerate(names)]


def point_jobs(layered: dict[str, Any], site, sweep: Sweep, base_run_dir: str, source: str) -> list[ResolvedJob]:
    """Each point's job: the layered job with the point's values set and its run directory under
    the sweep's, validated; a mistake names the key and the point."""
    resolved = []
    for point in sweep.points:
        data = copy.deepcopy(layered)
        where = f"{source}, sweep point {point.name}"
        for key, found in point.values.items():
            set_dotted(data, key, copy.deepcopy(found.value), f"{where}: {key}")
        data["run_dir"] = f"{base_run_dir.rstrip('/')}/{point.name}"
        resolved.append(validated(data, site, where))
    return resolved


def _check_key(key: str, where: str) -> None:
    parts = key.split(".")
    if not all(parts):
        raise JobgenError(f"{where}: '{key}' is not a dotted key such as training.learning_rate")
    if parts[0] in NOT_SWEEPABLE:
        raise JobgenError(f"{where}: '{key}' cannot be swept: the sweep names each point's run directory itself")


def _read_value(raw: str, where: str) -> Value:
    try:
        value = parse_yaml(raw) if raw else ""
    except DuplicateKey as error:
        raise JobgenError(f"{where}: {error.without_lines}") from None
    except ValueError:
        value = raw
    if isinstance(value, Sexagesimal):
        value = value.text
    check_shape(value, where)
    return Value(value, raw)


def _text_of(value: Any) -> str:
    if isinstance(value, Sexagesimal):
        return value.text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "-".join(_text_of(item) for item in value)
    return str(value)


def _split_top_level(raw: str) -> list[str]:
    """Split on commas outside brackets, so `[q_proj,v_proj],[o_proj]` is two values."""
    parts, depth, current = [], 0, ""
    for ch in raw:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def _max_running(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobgenError(f"{where}: {value!r} is not a positive whole number of points to run at once, e.g. 2")
    return value
