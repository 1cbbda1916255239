"""What `jobgen status` reads: the run directory's records and the scheduler's word (`jobgen logs`' paths: jobgen.rundir.logs)."""

from __future__ import annotations

import calendar
import time
from pathlib import Path
from typing import Any, Optional

from jobgen.errors import JobgenError
from jobgen.rundir import cost
from jobgen.rundir import files as runfiles
from jobgen.rundir.outcome import attach_messages, format_lines, summary
from jobgen.rundir.run import RunDir, find_run
from jobgen.schedulers import get_scheduler


def collect(target: str) -> dict[str, Any]:
    from jobgen.rundir.metrics import metrics

    run = find_run(target)
    submissions = run.submissions()
    latest = submissions[-1] if submissions else None
    state = _scheduler_state(latest) if latest else None
    segments = pair_segments(run.segments())
    if latest and state and _has_finished(latest["scheduler"], state["state"]):
        _close_open_segment(segments, latest["job_id"], run)
    # metrics.jsonl, many megabytes in a long run (15 MB at 100,000 steps: 0.4 s to read), is read
    # once, and only where there was an interruption or a segment's steps must come from it.
    records = metrics(run.path) if len(segments) > 1 else None
    segments = killed_from_metrics(segments, run.path, records)
    segments = attach_messages(attach_health(attach_startups(segments, run.path), run.path), run)
    # The last loss, the final model, and why a segment failed; a probe's result instead of a goodput.
    outcome = summary(run, segments)
    return {
        "run_dir": str(run.path),
        "submissions": submissions,
        "scheduler_state": state,
        "segments": segments,
        "goodput": None if outcome["probe"] or outcome.get("own_command") else goodput(segments),
        **outcome,
        "excluded_nodes": excluded_nodes(run.path),
        "interruptions": [] if records is None else cost.interruptions(segments, records),
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


KILLED = "killed by the scheduler"


def _has_finished(scheduler_name: str, state: str) -> bool:
    """The scheduler says the job has ended (a state it knows, and not one of a live job)."""
    scheduler = get_scheduler(scheduler_name)
    return bool(scheduler.active_states) and state != "UNKNOWN" and state.upper() not in scheduler.active_states


def _close_open_segment(segments: list[dict[str, Any]], job_id: str, run: RunDir) -> None:
    """The job has ended by the scheduler's word, but its last segment recorded no end: the
    scheduler killed it faster than the script could say so (Torque's qdel: SIGKILL within
    milliseconds). Its log stopped growing when it was killed."""
    if segments and segments[-1]["ended_at"] is None and segments[-1]["job_id"] == job_id:
        log = run.path / runfiles.batch_log(job_id)
        last_output = log.stat().st_mtime if log.exists() else _epoch(segments[-1]["started_at"])
        _killed(segments[-1], time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last_output)), for_good=True)


def _killed(segment: dict[str, Any], next_started_at: str, for_good: bool = False) -> None:
    """A segment that ended with no end line: the scheduler killed its script first. One killed
    while it stopped (its "stopping" line, written when the stop began: a preemption, the time
    limit) ended by that stop; any other was killed outright. So was one stopping for a
    preemption whose job then ended `for_good`: a preempted job comes back under its own id
    (Slurm's and PBS's requeue), and on PBS the same SIGTERM is also qdel's, which Torque follows
    with SIGKILL within milliseconds."""
    stopping = segment.pop("stopping", None)
    segment["outcome"] = KILLED if not stopping or (for_good and stopping == "preempted") else stopping
    segment["killed"] = True
    segment["next_started_at"] = next_started_at


def pair_segments(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per segment: a start line, closed by its end line if the script lived to write it.
    A segment with no end line that the same job id started again after has ended all the same:
    the scheduler killed it too fast for the script to say so (Torque's qrerun, SIGKILL, a lost node),
    or while it stopped ("stopping" line: then that stop is how it ended)."""
    segments: list[dict[str, Any]] = []
    for event in events:
        if event.get("event") == "start":
            if segments and segments[-1]["ended_at"] is None and segments[-1]["job_id"] == event["job_id"]:
                _killed(segments[-1], event["started_at"])
            segments.append({
                "job_id": event["job_id"], "restart": event["restart"], "started_at": event["started_at"],
                "ended_at": None, "first_step": None, "last_step": None, "outcome": "running or lost",
                "train_seconds": None, "nodes": [],
            })
        elif event.get("event") == "stopping" and segments and segments[-1]["ended_at"] is None:
            segments[-1]["stopping"] = event.get("outcome") or None  # why it is stopping, until its end says how it ended
        elif event.get("event") == "end" and segments and segments[-1]["ended_at"] is None:
            segments[-1].pop("stopping", None)
            segments[-1].update({
                "ended_at": event["at"], "first_step": event.get("first_step"), "last_step": event.get("last_step"),
                "outcome": event.get("outcome") or "unknown", "train_seconds": event.get("train_seconds"),
                "nodes": str(event.get("nodes") or "").split(),  # those its failure was put down to
            })
    return segments


def killed_from_metrics(segments: list[dict[str, Any]], run_path: Path,
                        records: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """A killed segment's steps and end as far as the trainer's records show: its first step from
    its start-up record, its last and its end from the last metrics line written before the next
    start of the job (or that start itself, when it logged none). Then unreported_steps.
    `records`: the metrics records where the caller has read them already."""
    from jobgen.rundir.metrics import metrics, startups

    killed = [s for s in segments if s.pop("killed", False) and s["ended_at"] is None]
    if not killed and all(s["ended_at"] is None or s["last_step"] is not None for s in segments):
        return segments  # metrics.jsonl, many megabytes in a long run, is read only when needed
    records = metrics(run_path) if records is None else records
    found = {(str(entry.get("job_id")), entry.get("restart")): entry for entry in startups(run_path)}
    for segment in killed:
        begin, until = _epoch(segment["started_at"]), _epoch(segment.pop("next_started_at"))
        logged = [r for r in records if isinstance(r.get("time"), (int, float)) and begin <= r["time"] < until + 1]
        startup = found.get((str(segment["job_id"]), segment["restart"]))
        if logged:
            last = max(logged, key=lambda r: r["time"])
            segment["last_step"] = last.get("step")
            segment["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last["time"]))
        else:
            segment["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until))
        if startup:
            segment["first_step"] = startup.get("first_step")
            segment["last_step"] = segment["last_step"] if segment["last_step"] is not None else startup.get("first_step")
        following = segments[segments.index(segment) + 1:]
        if segment["last_step"] is None and following and following[0]["job_id"] == segment["job_id"]:
            # No trainer records (the job's own program): the step the next segment resumed from,
            # the newest checkpoint this one left, as its end line would have said.
            segment["last_step"] = following[0]["first_step"]
    return unreported_steps(segments, records, found)


def unreported_steps(segments: list[dict[str, Any]], records: list[dict[str, Any]],
                     startup_of: dict[tuple[str, Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """An ended segment whose end names no steps (a hang: the supervisor ended the ranks before
    they could report them) trained what its own metrics records say: its last step theirs, its
    first its start-up record's."""
    for segment in segments:
        if segment["ended_at"] is None or segment["last_step"] is not None:
            continue
        key = (str(segment["job_id"]), segment["restart"])
        steps = [r["step"] for r in records if isinstance(r.get("step"), int) and (str(r.get("job_id")), r.get("restart")) == key]
        if steps:
            segment["last_step"] = max(steps)
            startup = startup_of.get(key) or {}
            segment["first_step"] = segment["first_step"] if segment["first_step"] is not None else startup.get("first_step", min(steps) - 1)
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


def _data_cell(segment: dict[str, Any]) -> str:
    seconds = (segment.get("startup") or {}).get("data")
    return "-" if seconds is None else f"{seconds:.1f} s"


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
                "-" if s["last_step"] is None else f"{s['first_step']}->{s['last_step']}",
                s["outcome"] + (f" ({' '.join(s['nodes'])})" if s.get("nodes") else ""),
                "-" if s.get("startup_seconds") is None else f"{s['startup_seconds']:.0f} s",
                *_health_cell(s),
            )
            for s in report["segments"]
        ]
        if report.get("probe"):  # a probe trains nothing: no steps, no time to a first step
            header, rows = header[:4] + header[5:6], [row[:4] + row[5:6] for row in rows]
        elif any("data" in (s.get("startup") or {}) for s in report["segments"]):
            # Of the time to the first step: the data phase (tokenizing, or finding the prepared store).
            header = header[:7] + ("data",) + header[7:]
            rows = [row[:7] + (_data_cell(s),) + row[7:] for row, s in zip(rows, report["segments"])]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        for s in report["segments"]:
            for problem in (s.get("health") or {}).get("problems", []):
                lines.append(f"health check of job {s['job_id']}: {problem}")
    else:
        lines.append("no segment has started yet")
    if report.get("excluded_nodes"):
        local = bool(report["submissions"]) and report["submissions"][-1].get("scheduler") == "local"
        # A local run's nodes are all this machine, which its next submit uses all the same.
        what = "failures attributed to (a local run's nodes are all this machine: not kept out)" if local else \
            "excluded nodes (after failures attributed to them)"
        lines.append(f"{what}: {', '.join(report['excluded_nodes'])}")
    if interrupted := cost.format_lines(report.get("interruptions") or []):
        lines.extend(["", *interrupted])
    if outcome := format_lines(report):
        lines.extend(["", *outcome])
    if report["goodput"] is not None:
        lines.append(f"\ngoodput {report['goodput']:.1%} (training time / time the finished segments held their nodes)")
    return "\n".join(lines)


def node_said(run: RunDir, job_id: str) -> Optional[str]:
    """Where job `job_id`'s last segment failed and a node said why before its program started,
    that line (jobgen.rundir.outcome.node_line); else None."""
    from jobgen.rundir.outcome import node_line

    segments = [s for s in pair_segments(run.segments()) if str(s["job_id"]) == job_id]
    return node_line(run, job_id) if segments and segments[-1]["outcome"] == "failed" else None


def foreground_exit_status(run: RunDir) -> int:
    """0 when the last segment of a job run in the foreground completed, else 1."""
    segments = pair_segments(run.segments())
    return 0 if segments and segments[-1]["outcome"] == "completed" else 1


def _epoch(stamp: str) -> float:
    return calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))  # the stamp is UTC
