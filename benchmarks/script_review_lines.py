"""How much of a rendered two-node LoRA script a reviewing admin must read.

For the example job configs/examples/llama-lora-2node.yaml rendered for Slurm, PBS Pro and Torque
(the golden files under examples/, which tests/test_examples.py keeps equal to `jobgen render`):
its total lines, and the lines above the marked line after which jobgen's machinery, the same for
every job, begins: what is specific to the job. A script without the marker must be read whole.
Each count is given as all lines / lines that are neither blank nor a comment.

    python benchmarks/script_review_lines.py [--rev REV]

--rev reads the golden files of a git revision instead of the working tree (e.g. the one before).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = {
    "slurm": "examples/sbatch/llama-lora-2node.sbatch",
    "pbs": "examples/pbs/llama-lora-2node.pbs",
    "torque": "examples/pbs/llama-lora-2node.torque.pbs",
}
MARKER = "# ---- jobgen machinery below"


def counts(lines: list[str]) -> str:
    code = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return f"{len(lines)} / {len(code)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="read the golden files at this git revision")
    args = parser.parse_args()
    print(f"{'scheduler':<10} {'whole script':>14} {'to review':>14}   (all lines / not blank or comment)")
    for scheduler, path in GOLDEN.items():
        if args.rev:
            text = subprocess.run(["git", "show", f"{args.rev}:{path}"], cwd=REPO, check=True,
                                  capture_output=True, text=True).stdout
        else:
            text = (REPO / path).read_text()
        lines = text.splitlines()
        marker = next((i for i, line in enumerate(lines) if line.startswith(MARKER)), len(lines))
        print(f"{scheduler:<10} {counts(lines):>14} {counts(lines[:marker]):>14}")


if __name__ == "__main__":
    main()
