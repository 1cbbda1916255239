"""Running a scheduler's own commands, and turning their refusals into one clear line."""

from __future__ import annotations

import shutil
import subprocess

from jobgen.errors import JobgenError


def require(command: str, scheduler: str) -> str:
    path = shutil.which(command)
    if path is None:
        raise JobgenError(
            f"'{command}' is not on PATH: {scheduler} submission needs a {scheduler} login node "
            "(or use --scheduler local to run on this machine)"
        )
    return path


def run(argv: list[str], what: str, timeout: float = 60) -> str:
    """stdout of argv; a failure becomes a JobgenError carrying the scheduler's own last message."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise JobgenError(f"'{argv[0]}' is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise JobgenError(f"{what}: '{argv[0]}' did not answer within {timeout:.0f} s") from None
    if result.returncode != 0:
        raise JobgenError(f"{what}: {scheduler_message(result.stderr or result.stdout)}")
    return result.stdout


def scheduler_message(text: str) -> str:
    """The line that says why: Slurm and PBS print it last, after any usage noise."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"
