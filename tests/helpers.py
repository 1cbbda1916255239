"""Small helpers the tests share: running the real CLI, and the real shell checkers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))


def jobgen(*args: str, cwd: Path | None = None, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """The installed `jobgen` command, exactly as a user runs it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jobgen.cli", *args], cwd=cwd, env=full_env, capture_output=True, text=True, check=check
    )


def node_script_of(script: str) -> str:
    """The per-node script a batch script embeds, so it can be checked on its own."""
    match = re.search(r"<<'JOBGEN_NODE_SCRIPT'\n(.*?)^JOBGEN_NODE_SCRIPT$", script, re.S | re.M)
    assert match, "no embedded node script"
    return match.group(1)


def shell_findings(*paths: Path) -> str:
    """`bash -n` and `shellcheck -S warning` findings for each file; empty when clean."""
    findings = []
    for path in paths:
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if syntax.returncode:
            findings.append(f"bash -n {path}: {syntax.stderr}")
    check = subprocess.run(["shellcheck", "-S", "warning", "-s", "bash", *map(str, paths)], capture_output=True, text=True)
    if check.returncode:
        findings.append(check.stdout + check.stderr)
    return "\n".join(findings)


def cannot_run(reason: str) -> None:
    """Skips a test that needs what this machine lacks; under CI=true that is a failure: CI must run it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but: {reason}", pytrace=False)
    pytest.skip(reason)
