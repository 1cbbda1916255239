"""`jobgen status` shows each segment's data phase: a first start that tokenized, a restart that found the store."""

from __future__ import annotations

from jobgen.rundir.status import format_table


def _segment(job_id: str, restart: int, startup: dict) -> dict:
    return {"job_id": job_id, "restart": restart, "started_at": "2026-11-24T10:00:00Z", "ended_at": "2026-11-24T10:05:00Z",
            "first_step": 0, "last_step": 5, "outcome": "preempted", "startup_seconds": sum(startup.values()),
            "startup": startup, "health": None}


def test_status_table_has_a_data_column_with_each_segments_data_phase():
    report = {"run_dir": "runs/r", "scheduler_state": None, "goodput": None, "segments": [
        _segment("11", 0, {"imports": 7.0, "data": 42.4, "model load": 1.0}),
        _segment("11", 1, {"imports": 7.0, "data": 0.31, "model load": 1.0}),
    ]}
    header, first, second = format_table(report).splitlines()[2:5]
    assert header.split()[-4:] == ["data", "health", "bus", "bw"]
    assert "42.4 s" in first and "0.3 s" in second


def test_status_table_without_the_phase_is_as_before():
    report = {"run_dir": "runs/r", "scheduler_state": None, "goodput": None,
              "segments": [_segment("11", 0, {"imports": 7.0, "model load": 1.0})]}
    assert " data " not in format_table(report).splitlines()[2]
