"""Cold start of `jobgen render` against `python3 -c pass`, measured alternately in one run.

    python benchmarks/render_cold_start.py [--runs 31] [--compare-to REV]

Prints the median of each command and its excess over `python -c pass`; the target is a render
under 0.2 s on a 2-core machine. Alternating the commands keeps a noisy shared machine from
favouring either. `--compare-to REV` also times the render of a git revision (checked out in a
temporary worktree, run with this venv) and prints the ratio of the two, both measured here and now.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/examples/llama-lora-2node.yaml"
RENDER_ARGS = ["render", "--scheduler", "slurm", CONFIG]


def commands(compare_dir: Path | None) -> dict[str, tuple[list[str], dict | None]]:
    runs: dict[str, tuple[list[str], dict | None]] = {
        "python -c pass": ([sys.executable, "-c", "pass"], None),
        "python -c 'import jinja2, pydantic, click, yaml'": (
            [sys.executable, "-c", "import jinja2, pydantic, click, yaml"], None
        ),
        # The installed console script, as a user runs it.
        "jobgen render (2-node slurm)": ([str(Path(sys.executable).with_name("jobgen")), *RENDER_ARGS], None),
    }
    if compare_dir is not None:
        # Both sides as `python -m jobgen.cli`, so the only difference is the code.
        for label, src in (("this tree", REPO / "src"), ("compared revision", compare_dir / "src")):
            env = {**os.environ, "PYTHONPATH": str(src)}
            runs[f"python -m jobgen.cli render ({label})"] = ([sys.executable, "-m", "jobgen.cli", *RENDER_ARGS], env)
    return runs


def measure(runs: dict[str, tuple[list[str], dict | None]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (command, env) in runs.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=31)
    parser.add_argument("--compare-to", metavar="REV", help="also time this git revision's render, e.g. HEAD~1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="jobgen-bench-") as scratch:
        compare_dir = None
        if args.compare_to:
            compare_dir = Path(scratch) / "tree"
            add = ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(compare_dir), args.compare_to]
            subprocess.run(add, check=True)
        try:
            medians = measure(commands(compare_dir), args.runs)
        finally:
            if compare_dir is not None:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(compare_dir)], check=True)
    base = medians["python -c pass"]
    for name, median in medians.items():
        print(f"{name:55s} median {median * 1000:7.1f} ms   (+{(median - base) * 1000:6.1f} ms over python -c pass)")
    if compare_dir is not None:
        ratio = medians["python -m jobgen.cli render (this tree)"] / medians["python -m jobgen.cli render (compared revision)"]
        print(f"render, this tree / {args.compare_to}: {ratio:.3f}  ({args.runs} alternating runs each)")


if __name__ == "__main__":
    main()
