"""Ctrl-C to a local run of a program of the user's own, at random moments: how often the stop is
misread as a failure, and how long `jobgen submit` takes to return.

    .venv/bin/python benchmarks/local_stop_trials.py [--trials 20] [--seed 1] [--workdir DIR]

Each trial writes the program of tests/test_stop_at_any_moment.py (two simulated nodes, one rank
each, gloo; a save every third step and at the stop; STEP_DELAY 0.3 s), starts `jobgen submit -s
local`, sends it SIGINT after a delay drawn uniformly from 3 to 14 s (the job's start-up, its steps,
its saves and its exit all fall in that window on a 2-CPU machine), and reads the segment's outcome
from RUN_DIR/segments.jsonl. A misread is any outcome other than `interrupted` (stopped) or
`completed` (the program had finished before the signal). Prints each trial, the misreads, and the
median and worst seconds from SIGINT to `jobgen submit`'s exit. Benchmarks report; nothing here
fails on a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_stop_at_any_moment import write_job  # noqa: E402 - the test's own program and job


def trial(work: Path, delay: float) -> tuple[str, float]:
    write_job(work)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "STEP_DELAY": "0.3"}
    submit = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=work,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    stopped = time.monotonic()
    submit.send_signal(signal.SIGINT)
    submit.wait(timeout=900)
    took = time.monotonic() - stopped
    segments = work / "runs" / "own" / "segments.jsonl"
    ends = [json.loads(line) for line in segments.read_text().splitlines()] if segments.exists() else []
    return (ends[-1]["outcome"] if ends else "no record"), took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="jobgen-stop-trials-"))
    misread, times = 0, []
    for number in range(args.trials):
        delay = rng.uniform(3, 14)
        outcome, took = trial(root / f"trial-{number}", delay)
        wrong = outcome not in ("interrupted", "completed")
        misread += wrong
        times.append(took)
        print(f"trial {number}: SIGINT at {delay:4.1f} s: {outcome:<12} returned {took:5.1f} s later{'  MISREAD' if wrong else ''}",
              flush=True)
    print(f"misread {misread} of {args.trials}; seconds from SIGINT to the prompt: median {statistics.median(times):.1f}, "
          f"worst {max(times):.1f}")


if __name__ == "__main__":
    main()
