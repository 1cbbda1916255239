"""`scripts/demo` ends by saying what to run next. Its PATH is its own, so a user's shell has no
`jobgen` afterwards, and the run directory is relative to .jobgen-demo: each command it prints
must work as printed, from the checkout's root. Checked here on a run laid out as the demo leaves
it (the demo itself trains for a minute: tests/test_embedded_job.py covers its job)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

from tests.helpers import REPO
from tests.test_run_readers import write_run


def next_steps() -> tuple[str, list[str]]:
    """The text scripts/demo prints last (its final here-document) and the commands in it."""
    script = (REPO / "scripts" / "demo").read_text()
    found = re.search(r"^cat <<EOF\n(.*?)^EOF$", script, re.S | re.M)
    assert found, "scripts/demo prints no next steps"
    text = found.group(1)
    return text, [line.split("#")[0].strip() for line in text.splitlines() if line.strip().startswith(".venv/bin/jobgen ")]


def test_the_demo_ends_with_next_steps_that_work_as_printed_from_the_checkouts_root(tmp_path: Path) -> None:
    text, commands = next_steps()
    assert "source .venv/bin/activate" in text
    assert {command.split()[1] for command in commands} >= {"status", "logs", "plot", "runs"}
    # A checkout's root as the demo leaves it: its .venv and configs, and the run in .jobgen-demo.
    root = tmp_path / "checkout"
    root.mkdir()
    for name in (".venv", "configs"):
        (root / name).symlink_to(REPO / name)
    state = tmp_path / "state"
    run_dir = write_run(root / ".jobgen-demo" / "runs" / "tiny-lora", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "completed", 0, 12, 0)]},
    ], name="tiny-lora")
    (run_dir / "output").mkdir()
    (run_dir / "output" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "total_steps": 12, "loss": 6 - step / 10, "time": 1767225600 + step, "job_id": "local-1",
                    "restart": 0, "tokens_per_second": 1000.0}) + "\n" for step in range(1, 13)))
    env = {**os.environ, "XDG_STATE_HOME": str(state), "PATH": "/usr/bin:/bin"}  # no jobgen on PATH, as after the demo
    for command in commands:
        ran = subprocess.run(shlex.split(command), cwd=root, env=env, capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, f"{command}: {ran.stderr}"
    # The name the comment offers, from any folder.
    anywhere = subprocess.run([str(root / ".venv" / "bin" / "jobgen"), "status", "tiny-lora"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
    assert anywhere.returncode == 0 and f"run directory  {run_dir}" in anywhere.stdout, anywhere.stderr
