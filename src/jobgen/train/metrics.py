"""Per-step metrics: `OUTPUT_DIR/metrics.jsonl` (rank 0), a log line each, the experiment trackers
the job reports to (jobgen.train.trackers);
and `OUTPUT_DIR/startup.jsonl`, where each segment's time to its first new step went.

One line per logging step: step; time (Unix seconds when written); loss, token-weighted over
every rank and micro-batch since the previous line (sum(loss*tokens)/sum(tokens), all-gathered);
lr; tokens (input tokens of all ranks since the previous line, prompt included); tokens_per_s and
samples_per_s (all ranks, over the steps' wall time); step_seconds_max/min (slowest and fastest
rank's compute time of the last step); peak_memory_mb (largest over ranks: CUDA max allocated, or
the process's max RSS on the CPU); on a GPU also peak_reserved_mb (what the caching allocator held
at most: the figure an out-of-memory is about) and host_peak_mb (the process's max RSS); total_steps
and seconds_left (see MetricsWriter); job_id and restart, the segment that wrote the line (as in
startup.jsonl and trainer-exit.json: `jobgen plot` gives each line to its segment by them).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from typing import Any, Optional

from jobgen.rundir.files import METRICS_FILE, STARTUP_FILE
from jobgen.rundir.metrics import describe_progress
from jobgen.train.trackers import Trackers

log = logging.getLogger("jobgen.train")


def this_segment() -> dict[str, Any]:
    """Which segment of the job this process belongs to: the job id the batch script ran as and
    its restart count, as segments.jsonl records them (None and 0 outside a jobgen job)."""
    try:
        restart = int(os.environ.get("JOBGEN_RESTART_COUNT", "0") or 0)
    except ValueError:
        restart = 0
    return {"job_id": os.environ.get("JOBGEN_JOB_ID"), "restart": restart}


def host_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def peak_memory_mb(cuda: bool) -> tuple[float, float]:
    """(peak in use, peak held): CUDA allocated and reserved on a GPU, max RSS twice on the CPU."""
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20
    return host_peak_mb(), host_peak_mb()


def process_start_time() -> float:
    """Unix time this process started (Linux: /proc), so the interpreter's own start is counted;
    elsewhere, the time of the first call."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat", encoding="ascii") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class StartupClock:
    """Where a segment's time to its first new step goes: `mark(phase)` closes a phase at each
    milestone, from the process's start. Phases: imports (interpreter, torch, DeepSpeed,
    transformers, peft), process group (and finding the checkpoint), health check, data (the
    tokenizer, and the prepared store found, waited for or made: jobgen.train.store), model load
    (weights, adapters), deepspeed init, checkpoint load, first step."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.last = self.started
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self.last, 3)
        self.last = now

    def record(self, output_dir: str, first_step: int) -> dict:
        """Rank 0: one line in OUTPUT_DIR/startup.jsonl (read by `jobgen status` and `jobgen plot`)."""
        entry = {
            **this_segment(), "first_step": first_step, "started": round(self.started, 3), "total": round(self.last - self.started, 3),
            "seconds": self.seconds,
        }
        with open(os.path.join(output_dir, STARTUP_FILE), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
        return entry

    def summary(self) -> str:
        return ", ".join(f"{phase} {value:.1f}" for phase, value in self.seconds.items())


class MetricsWriter:
    """Rank 0's record of the run: each logging step is one line of metrics.jsonl and one plain
    log line. The record also holds total_steps and seconds_left (this segment's pace since its
    previous line), so a reader can show progress without the job's settings: `jobgen logs -f`
    and `jobgen submit --scheduler local` turn them into one updating line on a terminal."""

    def __init__(self, output_dir: str, enabled: bool, total_steps: int, first_step: int,
                 trackers: Optional[Trackers] = None) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.handle = open(os.path.join(output_dir, METRICS_FILE), "a", encoding="utf-8") if enabled else None
        self.trackers = trackers if enabled else None
        self._previous = (time.time(), first_step)
        self.segment = this_segment()

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        now = time.time()
        then, step_then = self._previous
        per_step = (now - then) / max(1, record["step"] - step_then)
        record = {**record, "total_steps": self.total_steps,
                  "seconds_left": round(per_step * max(0, self.total_steps - record["step"]), 1), **self.segment}
        self._previous = (now, record["step"])
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        if self.trackers is not None:
            self.trackers.log(record)
        log.info("%s", describe_progress(record))

    def close(self, completed: bool = False) -> None:
        if self.handle:
            self.handle.close()
        if self.trackers is not None:
            self.trackers.close(completed)
