"""`jobgen render` against torchx's dry run for the same kind of job, alternately in one run.

    python benchmarks/render_vs_torchx.py --torchx PATH/TO/torchx [--runs 21]

jobgen: `jobgen render --scheduler slurm configs/examples/llama-lora-2node.yaml` (the installed
console script next to this Python). torchx: `torchx run --scheduler slurm --dryrun dist.ddp -j 2x1
--script train.py`, which builds and prints its sbatch request without submitting (torchx in a
virtual environment of its own: `python -m venv tx && tx/bin/pip install torchx`). Each command
runs --runs times, alternating; prints the median wall time and the median CPU time (user + system
of the child, less sensitive to other work on a shared machine) of each, and their ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(command: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torchx", required=True, help="the torchx command of its own virtual environment")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp(prefix="jobgen-torchx-")) / "train.py"
    script.write_text("print('train')\n")
    commands = {
        "jobgen render": [str(Path(sys.executable).parent / "jobgen"), "render", "--scheduler", "slurm",
                          str(REPO / "configs/examples/llama-lora-2node.yaml")],
        "torchx --dryrun": [args.torchx, "run", "--scheduler", "slurm", "--dryrun", "dist.ddp", "-j", "2x1", "--script", str(script)],
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for name, command in commands.items():
        timed(command)  # once each first, so both start from a warm page cache
    for _ in range(args.runs):
        for name, command in commands.items():
            results[name].append(timed(command))
    print(f"{args.runs} runs each, alternating; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    medians = {}
    for name, rows in results.items():
        medians[name] = (statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows))
        print(f"{name:16s} wall {medians[name][0] * 1000:7.0f} ms   cpu {medians[name][1] * 1000:7.0f} ms")
    ours, theirs = medians["jobgen render"], medians["torchx --dryrun"]
    print(f"jobgen / torchx  wall {ours[0] / theirs[0]:.2f}   cpu {ours[1] / theirs[1]:.2f}")


if __name__ == "__main__":
    main()
