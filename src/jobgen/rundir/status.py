"""What `jobgen status` and `jobgen logs` read: the run directory's records and the scheduler's word."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from jobgen.rundir import files as runfiles
from jobgen.errors import JobgenError
from jobgen.rundir.run import RunDir, find_run
from jobgen.schedulers import get_scheduler


def collect(target: str) -> dict[str, Any]:
    run = find_run(target)
    submissions = run.submissions()
    latest = submissions[-1] if submissions else None
    state = _scheduler_state(latest) if latest else None
    segments = attach_health(attach_startups(pair_segments(run.segments()), run.path), run.path)
    return {
        "run_dir": str(run.path),
        "submissions": submissions,
        "scheduler_state": state,
        "segments": segments,
        "goodput": goodput(segments),
        "excluded_nodes": excluded_nodes(run.path),
    }


def _scheduler_state(latest: dict[str, Any]) -> Optional[dict[str, Any]]:
    """What the scheduler says of the latest submission; None where the run directory is its
    whole record (a job run in the foreground)."""
    try:
        scheduler = get_scheduler(latest["scheduler"])
        if scheduler.runs_in_foreground:
            return None
        found = scheduler.state(latest["job_id"])
    except JobgenError as error:
        return {"job_id": latest["job_id"], "state": "UNKNOWN", "reason": str(error)}
    return found.as_dict() if found else {"job_id": latest["job_id"], "state": "UNKNOWN", "reason": "the scheduler no longer knows this job"}


def pair_segments(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per segment: a start line, closed by its end line if the script lived to write it."""
    segments: list[dict[str, Any]] = []
    for event in events:
        if event.get("event") == "start":
            segments.append({
                "job_id": event["job_id"], "restart": event["restart"], "started_at": event["started_at"],
                "ended_at": None, "first_step": None, "last_step": None, "outcome": "running or lost",
                "train_seconds": None,
            })
        elif event.get("event") == "end" and segments and segments[-1]["ended_at"] is None:
            segments[-1].update({
                "ended_at": event["at"], "first_step": event.get("first_step"), "last_step": event.get("last_step"),
                "outcome": event.get("outcome") or "unknown", "train_seconds": event.get("train_seconds"),
            })
    return segments


def attach_startups(segments: list[dict[str, Any]], run_path: Path) -> list[dict[str, Any]]:
    """Each segment's time from its trainer's start to its first new step, and where it went
    (imports, process group, ...: OUTPUT_DIR/startup.jsonl), where the trainer got that far."""
    from jobgen.rundir.metrics import startups

    found = {(str(entry.get("job_id")), entry.get("restart")): entry for entry in startups(run_path)}
    for segment in segments:
        entry = found.get((str(segment["job_id"]), segment["restart"]))
        segment["startup_seconds"] = entry["total"] if entry else None
        segment["startup"] = entry["seconds"] if entry else None
    return segments


def attach_health(segments: list[dict[str, Any]], run_path: Path) -> list[dict[str, Any]]:
    """Each segment's health gate (RUN_DIR/health.jsonl): its outcome, problems and the best
    all-reduce bus bandwidth it measured; None where the gate did not run."""
    import json

    found: dict[tuple[str, Any], dict[str, Any]] = {}
    path = run_path / runfiles.HEALTH_HISTORY
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                entry = json.loads(line)
                found[(str(entry.get("job_id")), entry.get("restart"))] = entry
            except ValueError:
                continue
    for segment in segments:
        entry = found.get((str(segment["job_id"]), segment["restart"]))
        segment["health"] = None if entry is None else {
            "ok": entry.get("ok"), "problems": entry.get("problems") or [],
            "bus_bandwidth_gbps": entry.get("bus_bandwidth_best_gbps"), "seconds": sum((entry.get("phases") or {}).values()),
        }
    return segments


def excluded_nodes(run_path: Path) -> list[str]:
    """Nodes a requeue excluded after a failure attributed to them (kept across restarts)."""
    path = run_path / runfiles.EXCLUDED_NODES
    return [line.strip() for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _health_cell(segment: dict[str, Any]) -> tuple[str, str]:
    health = segment.get("health")
    if not health:
        return "-", "-"
    bandwidth = "-" if health["bus_bandwidth_gbps"] is None else f"{health['bus_bandwidth_gbps']:.2f} GB/s"
    return ("ok" if health["ok"] else f"{len(health['problems'])} problem(s)"), bandwidth


def goodput(segments: list[dict[str, Any]]) -> Optional[float]:
    """Training time the trainer reports, over the time the segments held their nodes."""
    allocated = useful = 0.0
    for segment in segments:
        if not segment["ended_at"]:
            continue
        allocated += max(0.0, _epoch(segment["ended_at"]) - _epoch(segment["started_at"]))
        useful += float(segment["train_seconds"] or 0)
    return round(useful / allocated, 3) if allocated > 0 else None


def format_table(report: dict[str, Any]) -> str:
    lines = [f"run directory  {report['run_dir']}"]
    state = report["scheduler_state"]
    if state:
        extra = ", ".join(
            f"{k} {state[k]}" for k in ("reason", "nodes", "elapsed", "restarts") if state.get(k) not in (None, "")
        )
        lines.append(f"job {state['job_id']}  {state['state']}" + (f"  ({extra})" if extra else ""))
    if report["segments"]:
        lines.append("")
        header = ("job", "restart", "started", "ended", "steps", "outcome", "to first step", "health", "bus bw")
        rows = [
            (
                s["job_id"], str(s["restart"]), s["started_at"], s["ended_at"] or "-",
                "-" if s["last_step"] is None else f"{s['first_step']}->{s['last_step']}", s["outcome"],
                "-" if s.get("startup_seconds") is None else f"{s['startup_seconds']:.0f} s",
                *_health_cell(s),
            )
            for s in report["segments"]
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        for s in report["segments"]:
            for problem in (s.get("health") or {}).get("problems", []):
                lines.append(f"health check of job {s['job_id']}: {problem}")
    else:
        lines.append("no segment has started yet")
    if report.get("excluded_nodes"):
        lines.append(f"excluded nodes (after failures attributed to them): {', '.join(report['excluded_nodes'])}")
    if report["goodput"] is not None:
        lines.append(f"\ngoodput {report['goodput']:.1%} (training time / time the finished segments held their nodes)")
    return "\n".join(lines)


def log_path(target: str, node: Optional[int], rank: Optional[int] = None) -> Path:
    """The batch log, or node K's: the script and each node write their own into RUN_DIR/logs on
    every scheduler and launcher, named by the job id the script ran as (a PBS continuation runs
    under a new id; a run submitted by hand has only the script's own records)."""
    run = find_run(target)
    starts = [event for event in run.segments() if event.get("event") == "start"]
    if starts:
        job_id = starts[-1]["job_id"]
    elif run.submissions():
        job_id = run.latest()["job_id"]
    else:  # submitted by hand and stopped before its first segment: its newest batch log
        job_id = _newest_batch_log_job_id(run)
    if rank is not None:
        return run.path / runfiles.rank_log(job_id, rank)
    return run.path / (runfiles.node_log(job_id, node) if node is not None else runfiles.batch_log(job_id))


def _newest_batch_log_job_id(run: RunDir) -> str:
    found = [(p, runfiles.batch_log_job_id(p.name)) for p in run.logs.glob("*")]
    found = [(p, job_id) for p, job_id in found if job_id]
    if not found:
        raise JobgenError(f"{run.path} has no log yet")
    return max(found, key=lambda item: item[0].stat().st_mtime)[1]


def foreground_exit_status(run: RunDir) -> int:
    """0 when the last segment of a job run in the foreground completed, else 1."""
    segments = pair_segments(run.segments())
    return 0 if segments and segments[-1]["outcome"] == "completed" else 1


def _epoch(stamp: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
