"""`jobgen submit --resume-from CHECKPOINT`: resume a run from a checkpoint of its own that is not
its newest (the newest diverged, or trained on bad data).

The trainer always resumes from the newest complete checkpoint (jobgen.train.checkpoint), so the
checkpoints after the chosen one are moved out of its sight, never deleted: into
OUTPUT_DIR/checkpoints-set-aside/after-step-NNNNNN-TIME/, a folder the trainer never looks in or
prunes, so no later restart can jump back to them. Their lines of metrics.jsonl go there too
(metrics-after.jsonl), so the run's loss curve is the one it resumes on. Only while no job of the
run is queued or running (the caller checks, as every submit does).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.rundir import files
from jobgen.rundir.files import BEST_CHECKPOINT, METRICS_FILE

CHECKPOINTS = "checkpoints"
SET_ASIDE = "checkpoints-set-aside"
COMPLETE = "COMPLETE"
STEP = re.compile(r"^(?:step-)?(\d+)$")
# Names in checkpoints/ that hold a step: complete, half-written (.tmp-), or damaged (corrupt-).
STEP_FOLDER = re.compile(r"^(?:\.tmp-|corrupt-)?step-(\d+)$")


def chosen_step(output: Path, choice: str) -> int:
    """The step of `choice` (step-000300, 300, or that folder's path) among the run's complete
    checkpoints; JobgenError naming the option, the value and those it could be."""
    match = STEP.match(Path(choice).name)
    folder = output / CHECKPOINTS
    complete = complete_steps(output)
    have = ", ".join(f"step-{s:06d}" for s in complete) or "none"
    if match is None or int(match.group(1)) not in complete:
        raise JobgenError(f"--resume-from: {choice!r} is not a complete checkpoint of this run in {folder} "
                          f"(it has: {have}); give one of them")
    return int(match.group(1))


def complete_steps(output: Path) -> list[int]:
    """The steps of the run's complete checkpoints (OUTPUT/checkpoints/step-N with COMPLETE), in order."""
    folder = output / CHECKPOINTS
    return sorted(int(m.group(1)) for m in map(STEP.match, _names(folder))
                  if m and m.group(0).startswith("step-") and (folder / m.group(0) / COMPLETE).exists())


def set_aside_after(output: Path, step: int, dry_run: bool = False) -> list[Path]:
    """Move every checkpoint of a step after `step` (and their metrics lines, and best.json when it
    names one of them) into a new folder of SET_ASIDE; returns the checkpoints moved, or, with
    `dry_run`, that would be."""
    folder = output / CHECKPOINTS
    later = sorted((folder / name for name in _names(folder)
                    if (m := STEP_FOLDER.match(name)) and int(m.group(1)) > step), key=lambda p: p.name)
    if dry_run or not later:
        return later
    aside = output / SET_ASIDE / f"after-step-{step:06d}-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir(parents=True)
    best = output / BEST_CHECKPOINT
    if best.exists() and _names_one_of(best, later):
        os.replace(best, aside / best.name)  # the resumed checkpoint's own state restores it
    for path in later:
        os.replace(path, aside / path.name)
    _split_metrics(output / METRICS_FILE, step, aside / "metrics-after.jsonl")
    return [aside / path.name for path in later]


def _split_metrics(metrics: Path, step: int, after: Path) -> None:
    if not metrics.exists():
        return
    keep, moved = [], []
    for line in metrics.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            late = int(json.loads(line).get("step", 0)) > step
        except (ValueError, TypeError, AttributeError):
            late = False
        (moved if late else keep).append(line)
    if moved:
        after.write_text("".join(moved), encoding="utf-8")
        write_atomic(metrics, "".join(keep))


def _names_one_of(best: Path, paths: list[Path]) -> bool:
    try:
        named = json.loads(best.read_text(encoding="utf-8")).get("checkpoint", "")
    except (OSError, ValueError, AttributeError):
        return False
    return Path(str(named)).name in {p.name for p in paths}


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


# The job's own program (launch.command): its checkpoints are the folders launch.checkpoints
# matches under the working directory, the last number in a name its step, as the batch script
# reads them (templates/job.sh.j2, jobgen_newest_checkpoint), so the same folders are set aside.
OWN_STEP = re.compile(r"([0-9]+)[^0-9]*$")


def own_checkpoints_sealed_after(run_dir: Path | None) -> int | None:
    """The step after which the program's checkpoints carry JobgenCallback's seal (None: it never
    said it seals). A mark without a step, as the first sealing version wrote it: every one."""
    if run_dir is None:
        return None
    try:
        words = (run_dir / files.OWN_CHECKPOINTS_SEALED).read_text().split()
    except FileNotFoundError:
        return None
    return int(words[0]) if words and words[0].isdigit() else 0


def own_checkpoints(workdir: Path, pattern: str, complete_file: str | None,
                    run_dir: Path | None = None) -> dict[int, tuple[Path, bool]]:
    """{step: (folder, complete)} of every folder `pattern` matches under `workdir` whose name has a
    number; complete as the batch script judges it (with the seal, once the run's callback seals)."""
    import glob

    sealed_after = own_checkpoints_sealed_after(run_dir)
    found: dict[int, tuple[Path, bool]] = {}
    for match in sorted(glob.glob(pattern, root_dir=workdir)):
        path = workdir / match
        number = OWN_STEP.search(path.name)
        if number is None or not path.is_dir():
            continue
        step = int(number.group(1))
        complete = ((complete_file is None or (path / complete_file).exists())
                    and (sealed_after is None or step <= sealed_after or (path / files.SEALED_MARK).exists()))
        if step not in found or complete:
            found[step] = (path, complete)
    return found


def own_chosen_step(workdir: Path, pattern: str, complete_file: str | None, choice: str, run_dir: Path | None = None) -> int:
    """The step of `choice` (50, checkpoint-50, or its path) among the program's complete
    checkpoints; JobgenError naming the option, the value and those it could be."""
    found = own_checkpoints(workdir, pattern, complete_file, run_dir)
    complete = sorted(step for step, (_, done) in found.items() if done)
    have = ", ".join(found[step][0].name for step in complete) or "none"
    number = OWN_STEP.search(Path(choice).name)
    if number is None or int(number.group(1)) not in complete:
        holding = f" that hold {complete_file}" if complete_file else ""
        raise JobgenError(f"--resume-from: {choice!r} is not a complete checkpoint of this program (the folders "
                          f"launch.checkpoints, {pattern}, matches under {workdir}{holding}: {have}); give one of them")
    return int(number.group(1))


def set_aside_own_after(workdir: Path, pattern: str, step: int, dry_run: bool = False) -> list[Path]:
    """Move every folder `pattern` matches of a step after `step` (complete or not) into
    BASE/SET_ASIDE/after-step-N-TIME/, BASE the pattern's leading folders without a wildcard;
    returns the folders moved, or, with `dry_run`, that would be. Refused when the new place
    would itself match `pattern`: the batch script would then resume from it."""
    later = sorted((path for number, (path, _) in own_checkpoints(workdir, pattern, None).items() if number > step),
                   key=lambda p: p.name)
    if not later:
        return later
    fixed = []
    for part in Path(pattern).parts[:-1]:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    base = workdir.joinpath(*fixed)
    aside = base / SET_ASIDE / f"after-step-{step:06d}-{time.strftime('%Y%m%dT%H%M%S')}"
    targets = [aside / path.relative_to(base) for path in later]
    for target in targets:
        for place in (target, *target.parents):
            if place == base:  # it has fewer parts than the pattern: never a match
                break
            if _matches(place, workdir / pattern):
                raise JobgenError(f"--resume-from: launch.checkpoints ({pattern}) would match {place}, where the later "
                                  "checkpoints would be set aside: make the pattern name the checkpoint folders only "
                                  "(e.g. output/checkpoint-*), or move them out of its reach yourself")
    if dry_run:
        return later
    for path, target in zip(later, targets):
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    return targets


def _matches(path: Path, pattern: Path) -> bool:
    """Whether an absolute path matches an absolute glob as the shell's does: part by part, `*` never across a `/`."""
    import fnmatch

    parts, wanted = path.parts, pattern.parts
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))
