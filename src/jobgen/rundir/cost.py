"""What each interruption of a run cost: the steps trained again and the time without new
training, from the paired segments (jobgen.rundir.status) and the trainer's per-step records
(metrics.jsonl: step, time, job_id, restart).

Times are measured from the last step the interrupted segment logged, not from the failure itself,
which no record holds: a power-off is known to the scheduler, not to the run directory. So each
figure is an upper bound of the real one by at most one step's time."""

from __future__ import annotations

from typing import Any, Optional


def interruptions(segments: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per segment that took over from an ended one and resumed from a known step."""
    times = _step_times(records)
    found = []
    for before, after in zip(segments, segments[1:]):
        if before["last_step"] is None or after["first_step"] is None:
            continue
        logged_before = times.get(_key(before), {})
        logged_after = times.get(_key(after), {})
        last_seen = max(logged_before.values(), default=None)
        found.append({
            "job_id": after["job_id"], "restart": after["restart"], "after": before["outcome"], "nodes": before.get("nodes") or [],
            "reached": before["last_step"], "resumed_from": after["first_step"],
            "steps_trained_again": max(0, before["last_step"] - after["first_step"]),
            "seconds_to_first_new_step": _since(last_seen, logged_after.get(after["first_step"] + 1)),
            "seconds_to_where_it_was": _since(last_seen, logged_after.get(max(before["last_step"], after["first_step"]) + 1)),
            # Where the seconds to the first new step went: the stop (detection, the node's end),
            # the wait for the next segment (a requeue, the queue), and its trainer's start-up.
            "seconds_to_segment_end": _since(last_seen, _epoch(before.get("ended_at"))),
            "seconds_to_next_start": _since(_epoch(before.get("ended_at")), _epoch(after.get("started_at"))),
            "start_up_seconds": after.get("startup_seconds"),
            "start_up": after.get("startup"),
        })
    return found


def format_lines(found: list[dict[str, Any]]) -> list[str]:
    if not found:
        return []
    lines = ["what each interruption cost (seconds from the last step logged before it):"]
    for cost in found:
        cause = cost["after"] + (f" ({' '.join(cost['nodes'])})" if cost["nodes"] else "")
        again = cost["steps_trained_again"]
        first = cost["resumed_from"] + 1
        span = f"{first}-{cost['reached']}" if first < cost["reached"] else f"{cost['reached']}"
        steps = f"{again} step(s) trained again ({span})" if again else "no step trained again"
        seconds = []
        if cost["seconds_to_first_new_step"] is not None:
            seconds.append(f"first new step after {cost['seconds_to_first_new_step']:.0f} s")
        if again and cost["seconds_to_where_it_was"] is not None:
            seconds.append(f"past step {cost['reached']} after {cost['seconds_to_where_it_was']:.0f} s")
        if where := _where_it_went(cost):
            seconds.append(where)
        lines.append(f"  restart {cost['restart']} of job {cost['job_id']}, after {cause}: {'; '.join([steps, *seconds])}")
    return lines


def _where_it_went(cost: dict[str, Any]) -> str:
    """'8 s to the segment's end, 0 s to the next start, 7.9 s start-up (imports 3.4, ...)'."""
    parts = []
    if cost.get("seconds_to_segment_end") is not None:
        parts.append(f"{cost['seconds_to_segment_end']:.0f} s to the segment's end")
    if cost.get("seconds_to_next_start") is not None:
        parts.append(f"{cost['seconds_to_next_start']:.0f} s to the next start")
    if cost.get("start_up_seconds") is not None:
        phases = sorted((cost.get("start_up") or {}).items(), key=lambda item: -item[1])[:3]
        largest = ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases)
        parts.append(f"{cost['start_up_seconds']:.1f} s start-up" + (f" ({largest}, ...)" if largest else ""))
    return "where: " + ", ".join(parts) if parts else ""


def _epoch(stamp: Optional[str]) -> Optional[float]:
    from datetime import datetime

    if not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _key(segment: dict[str, Any]) -> tuple[str, int]:
    restart = str(segment.get("restart"))
    return str(segment["job_id"]), int(restart) if restart.isdigit() else -1  # -1: matches no record


def _step_times(records: list[dict[str, Any]]) -> dict[tuple[str, int], dict[int, float]]:
    """Each segment's steps and the time each was first logged (an evaluation may log a step again)."""
    times: dict[tuple[str, int], dict[int, float]] = {}
    for record in records:
        step, at, restart = record.get("step"), record.get("time"), record.get("restart")
        if isinstance(step, int) and isinstance(at, (int, float)) and record.get("job_id") is not None and isinstance(restart, int):
            times.setdefault((str(record["job_id"]), restart), {}).setdefault(step, float(at))
    return times


def _since(start: Optional[float], end: Optional[float]) -> Optional[float]:
    return None if start is None or end is None else round(end - start, 1)
