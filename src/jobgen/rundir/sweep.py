"""A sweep on disk: a folder (the base job's run directory) holding one run directory per point
and the record that lists them.

    SWEEP/sweep.json            the points: index (the array task), name, values, run directory;
                                the scheduler and every submission of the sweep
    SWEEP/job.<scheduler>.sh    a job array's script (Slurm), the same text as submission.txt
    SWEEP/POINT_NAME/           each point's run directory, as `jobgen submit` lays out any run's

On Slurm the points are one job array: task K is point K, named ARRAYID_K in the point's
submissions.jsonl, its logs and its segments, so `jobgen status|logs|cancel POINT_DIR` and
`ARRAYID_K` work as for any job. Elsewhere each point is a job of its own (PBS Pro's subjobs and
Torque's array members cannot resubmit themselves as one point's continuation, which is how
jobgen requeues there), or on the local scheduler one run after another.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.job.layers import ResolvedJob
from jobgen.job.sweep import Point, Sweep
from jobgen.rundir import files as runfiles
from jobgen.rundir.run import RunDir
from jobgen.rundir.progress import StopRequests
from jobgen.rundir.submission import refuse_if_active, run_dir_for, submit as submit_one
from jobgen.schedulers import get_scheduler
from jobgen.script.render import job_yaml, render, render_array


@dataclass(frozen=True)
class SweepPlan:
    path: Path  # the sweep's folder
    points: list[tuple[Point, ResolvedJob, RunDir]]
    max_running: Optional[int]
    # A job array's one script and where it goes; None where each point is a job of its own.
    array_script: Optional[str]
    script_path: Optional[Path]

    def scripts(self, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> list[tuple[Path, str]]:
        """What would be submitted: the array's script, or each point's."""
        if self.array_script is not None and self.script_path is not None:
            return [(self.script_path, self.array_script)]
        return [(run.script(scheduler_name), render(resolved, scheduler_name, template_dirs)) for _, resolved, run in self.points]


def plan(base: ResolvedJob, points: list[ResolvedJob], sweep: Sweep, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> SweepPlan:
    folder = run_dir_for(base).path
    if (folder / runfiles.SUBMISSIONS).exists() and not (folder / runfiles.SWEEP_RECORD).exists():
        raise JobgenError(
            f"{folder} is the run directory of a job that is not a sweep: give the sweep another name or run_dir "
            "(its points' run directories go inside it)"
        )
    scheduler = get_scheduler(scheduler_name)
    array_script = script_path = None
    if scheduler.job_arrays:
        array_script = render_array(points, sweep.max_running, scheduler_name, template_dirs)
        script_path = folder / runfiles.script(scheduler_name)
    return SweepPlan(
        path=folder,
        points=[(point, resolved, run_dir_for(resolved)) for point, resolved in zip(sweep.points, points)],
        max_running=sweep.max_running,
        array_script=array_script,
        script_path=script_path,
    )


def submit(planned: SweepPlan, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> list[tuple[Point, str]]:
    """Submits every point; returns each point's job id (ARRAYID_K for a job array's task)."""
    scheduler = get_scheduler(scheduler_name)
    for _, _, run in planned.points:
        refuse_if_active(run)
    planned.path.mkdir(parents=True, exist_ok=True)
    submitted: list[tuple[Point, str]] = []
    if planned.array_script is not None and planned.script_path is not None:
        for _, resolved, run in planned.points:
            run.logs.mkdir(parents=True, exist_ok=True)
            write_atomic(run.job_file, job_yaml(resolved.job))
        write_atomic(planned.script_path, planned.array_script)
        write_atomic(planned.path / runfiles.SUBMISSION_TEXT, planned.array_script)
        _write_record(planned, scheduler_name, [])  # before the tasks start: they may be read at once
        array_id = scheduler.submit(planned.points[0][1].job, planned.script_path, planned.path)
        for point, _, run in planned.points:
            job_id = f"{array_id}_{point.index}"
            run.record_submission(job_id, scheduler.name, script=str(planned.script_path), sweep=str(planned.path), array_job_id=array_id)
            submitted.append((point, job_id))
        _write_record(planned, scheduler_name, submitted, array_id)
        return submitted
    _write_record(planned, scheduler_name, [])
    if not scheduler.runs_in_foreground:
        for point, resolved, run in planned.points:
            job_id, _ = submit_one(resolved, scheduler_name, template_dirs)
            submitted.append((point, job_id))
            _write_record(planned, scheduler_name, submitted)
        return submitted
    with StopRequests() as stops:  # one point after another, until the last or a stop
        for point, resolved, run in planned.points:
            if stops.received:
                print(f"jobgen: stopped: sweep points {point.index + 1} to {len(planned.points)} not started", file=sys.stderr)
                break
            print(f"jobgen: sweep point {point.index + 1} of {len(planned.points)}: {point.name}", file=sys.stderr)
            job_id, _ = submit_one(resolved, scheduler_name, template_dirs, stops)
            submitted.append((point, job_id))
            _write_record(planned, scheduler_name, submitted)
    return submitted


def _write_record(planned: SweepPlan, scheduler_name: str, submitted: list[tuple[Point, str]], array_id: Optional[str] = None) -> None:
    job_ids = {point.index: job_id for point, job_id in submitted}
    record = {
        "scheduler": scheduler_name,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "array_job_id": array_id,
        "max_running": planned.max_running,
        "keys": list(planned.points[0][0].values) if planned.points else [],
        "points": [
            {"index": point.index, "name": point.name, "values": _validated_values(point, resolved),
             "run_dir": str(run.path), "job_id": job_ids.get(point.index)}
            for point, resolved, run in planned.points
        ],
    }
    write_atomic(planned.path / runfiles.SWEEP_RECORD, json.dumps(record, indent=2) + "\n")


def _validated_values(point: Point, resolved: ResolvedJob) -> dict[str, Any]:
    """The point's values as its job holds them (YAML 1.1 reads `1e-4` as text; the job, 0.0001)."""
    dumped = resolved.job.model_dump(mode="json")
    found = {}
    for key in point.values:
        value: Any = dumped
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        found[key] = value
    return found


def is_sweep(target: str) -> bool:
    return (Path(target) / runfiles.SWEEP_RECORD).is_file()


def find_sweep(target: str) -> Optional[str]:
    """The sweep folder `target` names: the folder itself, its name (`jobgen runs` shows its points
    as NAME/POINT), or a job array's id (1234, whose tasks 1234_K the user's index records); None
    when it names no sweep."""
    if is_sweep(target):
        return target
    if not target.isdigit():
        if Path(target).exists():
            return None
        from jobgen.rundir.run import one_run_named  # the sweep's name, as `jobgen runs` shows its points

        named = one_run_named(target)
        return str(named) if named is not None and is_sweep(str(named)) else None
    from jobgen.rundir.run import index_entries

    for entry in reversed(index_entries()):
        job_id, run_dir = str(entry.get("job_id")), entry.get("run_dir")
        if job_id.startswith(f"{target}_") and job_id[len(target) + 1:].isdigit() and isinstance(run_dir, str):
            folder = str(Path(run_dir).parent)
            return folder if is_sweep(folder) else None
    return None


def read_record(target: str) -> dict[str, Any]:
    path = Path(target) / runfiles.SWEEP_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise JobgenError(f"{path}: not a readable sweep record ({error})") from None
    if not isinstance(record, dict) or not isinstance(record.get("points"), list):
        raise JobgenError(f"{path}: not a sweep record: it lists no points")
    return record


def point_dirs(target: str) -> list[tuple[dict[str, Any], RunDir]]:
    """Each point of the sweep in folder `target`, with its run directory."""
    return [(point, RunDir(Path(point["run_dir"]))) for point in read_record(target)["points"] if isinstance(point, dict)]


def collect(target: str) -> dict[str, Any]:
    """`jobgen status SWEEP`: per point its values, state, step, last loss and goodput (read as
    `jobgen status` and `jobgen runs` read one run)."""
    from jobgen.rundir.index import state as run_state
    from jobgen.rundir.status import collect as collect_run

    record = read_record(target)
    rows = []
    for point, run in point_dirs(target):
        row = {"index": point.get("index"), "name": point.get("name"), "values": point.get("values") or {},
               "run_dir": str(run.path), "job_id": point.get("job_id"), "state": "not submitted",
               "step": None, "total_steps": None, "last_loss": None, "goodput": None, "final_model": None}
        if (run.path / runfiles.SUBMISSIONS).exists():
            report = collect_run(str(run.path))
            latest = report["submissions"][-1] if report["submissions"] else {}
            row.update(
                job_id=latest.get("job_id", row["job_id"]), state=run_state(latest, report["segments"]),
                step=report["step"], total_steps=report["total_steps"], last_loss=report["last_loss"],
                goodput=report["goodput"], final_model=(report.get("final_model") or {}).get("path"),
            )
        rows.append(row)
    return {"sweep": str(Path(target).resolve()), "scheduler": record.get("scheduler"),
            "array_job_id": record.get("array_job_id"), "max_running": record.get("max_running"),
            "keys": record.get("keys") or [], "points": rows}


def format_table(report: dict[str, Any]) -> str:
    keys = report["keys"] or sorted({key for row in report["points"] for key in row["values"]})
    array = f", job array {report['array_job_id']}" if report.get("array_job_id") else ""
    limit = f", at most {report['max_running']} running" if report.get("max_running") else ""
    lines = [f"sweep  {report['sweep']}  ({len(report['points'])} points on {report['scheduler']}{array}{limit})", ""]
    header = ("point", *keys, "job", "state", "step", "loss", "goodput")
    rows = []
    for row in report["points"]:
        step = "-" if row["step"] is None else f"{int(row['step'])}" + ("" if row["total_steps"] is None else f"/{int(row['total_steps'])}")
        rows.append((
            str(row["index"]), *(_value_text(row["values"].get(key)) for key in keys), str(row["job_id"] or "-"),
            row["state"], step, "-" if row["last_loss"] is None else f"{row['last_loss']:.4f}",
            "-" if row["goodput"] is None else f"{row['goodput']:.1%}",
        ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.append("")
    lines.append("each point's run directory is SWEEP/<name>: " + ", ".join(row["name"] for row in report["points"][:3])
                 + (", ..." if len(report["points"]) > 3 else ""))
    return "\n".join(lines)


def _value_text(value: Any) -> str:
    if value is None:
        return "-"
    return json.dumps(value) if isinstance(value, (list, dict, bool)) else str(value)
