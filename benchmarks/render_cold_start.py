"""Cold start of `jobgen render` against `python3 -c pass`, measured alternately in one run.

    python benchmarks/render_cold_start.py [--runs 21]

Prints the median of each and the difference; the target is a render under 0.2 s on a 2-core
machine. Alternating the commands keeps a noisy shared machine from favouring either.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import jinja2, pydantic, click, yaml'": [sys.executable, "-c", "import jinja2, pydantic, click, yaml"],
    # The installed console script, as a user runs it.
    "jobgen render (2-node slurm)": [
        str(Path(sys.executable).with_name("jobgen")), "render", "--scheduler", "slurm",
        str(REPO / "configs/examples/llama-lora-2node.yaml"),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["python -c pass"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:50s} median {median * 1000:7.1f} ms   (+{(median - base) * 1000:6.1f} ms over python -c pass)")


if __name__ == "__main__":
    main()
