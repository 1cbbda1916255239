"""What the trainer leaves in a run's output folder, read without torch: the per-step metrics and
each segment's start-up record (both written by jobgen.train.metrics, rank 0)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import yaml

from jobgen.rundir.files import JOB_FILE, METRICS_FILE, STARTUP_FILE

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where PyYAML has it: ten times faster


def output_dir(run_path: Path, job: Optional[dict[str, Any]] = None) -> Path:
    """training.output_dir of the run's resolved job (read from the run directory unless given),
    relative to the run directory."""
    try:
        if job is None:
            job = yaml.load((run_path / JOB_FILE).read_text(), Loader=SAFE_LOADER) or {}
        folder = (job.get("training") or {}).get("output_dir") or "output"
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        folder = "output"
    return run_path / folder


def metrics(run_path: Path) -> list[dict[str, Any]]:
    return read_jsonl(output_dir(run_path) / METRICS_FILE)


def startups(run_path: Path) -> list[dict[str, Any]]:
    return read_jsonl(output_dir(run_path) / STARTUP_FILE)


def last_metrics(run_path: Path, job: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The newest training record: step, total_steps, loss, ... (None before the first). A resumed
    keep_best run may log an evaluation alone after it, which this passes over."""
    return last_record(output_dir(run_path, job) / METRICS_FILE, having="loss")


def last_eval(run_path: Path, job: Optional[dict[str, Any]] = None) -> Optional[dict[str, Any]]:
    """The newest metrics record with an eval loss, among the last 64 KiB of records (None if none)."""
    return last_record(output_dir(run_path, job) / METRICS_FILE, having="eval_loss")


def last_record(path: Path, chunk: int = 65536, having: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The last whole record of a JSON-lines file (with the key `having`, when given), read from
    its end: a long run's metrics are many megabytes, and `jobgen runs` reads one record of each run."""
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - chunk))
            data = handle.read()
    except OSError:
        return None
    for line in reversed(data.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:  # the line being written, or the cut first line of the chunk
            continue
        if isinstance(record, dict) and (having is None or having in record):
            return record
    return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written, or cut by a node that died mid-write
    return records


class JsonlTail:
    """The records appended to a JSON-lines file since the last call (whole lines only)."""

    def __init__(self, path: Path, from_end: bool) -> None:
        self.path = path
        self.offset = path.stat().st_size if from_end and path.exists() else 0

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offset += len(whole)
        records = []
        for line in whole.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def describe_progress(record: dict) -> str:
    """One line a person reads: 'step 12/40  loss 2.3456  1,234 tokens/s  0:28 left'."""
    parts = [f"step {record['step']}/{record['total_steps']}" if record.get("total_steps") else f"step {record['step']}"]
    if isinstance(record.get("loss"), (int, float)):
        parts.append(f"loss {record['loss']:.4f}")
    if isinstance(record.get("eval_loss"), (int, float)):
        parts.append(f"eval loss {record['eval_loss']:.4f}")
    if isinstance(record.get("tokens_per_s"), (int, float)):
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if isinstance(record.get("seconds_left"), (int, float)):
        parts.append(f"{format_duration(record['seconds_left'])} left")
    return "  ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
