"""What a preemption costs, measured on the Slurm test cluster (tests/cluster/slurm-cluster.sh start).

    python benchmarks/preemption.py [--preemptions 3] [--step-delay 1]

One 2-node LoRA job of the tiny model is preempted N times by an exclusive job in the `high`
partition; after each requeue it is released at once (as root, `scontrol update StartTime=now`,
which stands in for Slurm's ~2 minute requeue delay). Reported, as medians over the preemptions:
  - steps lost: steps trained before the preemption that the next segment trains again (target 0)
  - signal -> committed checkpoint: from the preempting job's submission (an upper bound on the
    signal's arrival) to the COMPLETE marker of the checkpoint the next segment resumes from
  - restart -> first new step: from the segment's start (the batch script's first line) to the
    first optimizer step it logs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobgen.rundir.status import _epoch, pair_segments  # noqa: E402


def scontrol(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(t.split("=", 1) for t in out.split() if "=" in t)


def wait(condition, what: str, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (value := condition()):
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "output" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preemptions", type=int, default=3)
    parser.add_argument("--step-delay", type=float, default=1.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jobgen-preemption-"))
    subprocess.run([sys.executable, "-m", "jobgen.train.tiny", str(work / "tiny")], check=True, capture_output=True)
    steps = 8 * (args.preemptions + 1)
    job = {
        "name": "jobgen-bench-preemption",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:30:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1},
        "training": {"model": str(work / "tiny/model"), "data": str(work / "tiny/data.json"), "method": "lora",
                     "precision": "fp32", "per_device_batch_size": 2, "max_length": 64, "epochs": 10, "max_steps": steps,
                     "save_interval": 1000},
        "requeue": {"max_restarts": args.preemptions + 1, "warning_seconds": 30},
    }
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "JOBGEN_DEBUG_STEP_DELAY": str(args.step_delay)}
    job_id = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", str(work / "job.yaml")],
                            cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()
    run_dir = work / "runs" / "jobgen-bench-preemption"
    signalled_at = []
    for n in range(args.preemptions):
        last = max((m["step"] for m in metrics(run_dir)), default=0)
        wait(lambda: max((m["step"] for m in metrics(run_dir)), default=0) >= last + 3, "training to progress")
        signalled_at.append(time.time())
        subprocess.run(["sbatch", "-p", "high", "--exclusive", "-N4", "--output=/dev/null", "--wrap", "sleep 2"], check=True, capture_output=True)
        wait(lambda: scontrol(job_id).get("JobState") == "PENDING" and int(scontrol(job_id).get("Restarts", 0)) > n, "the requeue")
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    wait(lambda: scontrol(job_id).get("JobState") in ("COMPLETED", "FAILED"), "the end", timeout=600)

    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    segments = pair_segments(events)
    rows = metrics(run_dir)
    lost, to_commit, to_first_step = [], [], []
    for n, (stopped, resumed) in enumerate(zip(segments, segments[1:])):
        before = [m for m in rows if m["time"] <= _epoch(resumed["started_at"]) + 1]
        lost.append(max(m["step"] for m in before) - resumed["first_step"])
        marker = run_dir / "output" / "checkpoints" / f"step-{resumed['first_step']:06d}" / "COMPLETE"
        # Later checkpoints may have replaced it (keep_checkpoints); the exit report kept its time.
        commit = marker.stat().st_mtime if marker.exists() else _epoch(stopped["ended_at"])
        to_commit.append(commit - signalled_at[n])
        first_new = min(m["time"] for m in rows if m["step"] == resumed["first_step"] + 1 and m["time"] >= _epoch(resumed["started_at"]))
        to_first_step.append(first_new - _epoch(resumed["started_at"]))
    print(f"job {job_id}: {len(segments)} segments, outcome {segments[-1]['outcome']}, steps {sorted(m['step'] for m in rows) == list(range(1, steps + 1)) and 'each once' or 'NOT each once'}")
    print(f"steps lost per preemption        median {statistics.median(lost):g}   all {lost}")
    print(f"signal -> committed checkpoint   median {statistics.median(to_commit):.1f} s   all {[round(x, 1) for x in to_commit]}")
    print(f"restart -> first new step        median {statistics.median(to_first_step):.1f} s   all {[round(x, 1) for x in to_first_step]}")


if __name__ == "__main__":
    main()
