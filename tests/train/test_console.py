"""Rank 0's output inside a job: its own file, and its node's log through tee
(jobgen/train/console.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from jobgen.rundir.files import rank_log
from tests.train.conftest import subprocess_env

RANK0 = textwrap.dedent(
    """
    import json, os, sys, time
    from jobgen.train import console
    console.route_output(sys.argv[1], "7", 0)
    os.dup(2)  # as DeepSpeed's op builder does: a copy of stderr it never closes
    print("the last line", flush=True)
    started = time.monotonic()
    console.finish_output()
    result = {"tee_ended": console._tee.returncode is not None, "waited": time.monotonic() - started}
    open(sys.argv[2], "w").write(json.dumps(result))
    """
)


def test_rank0_last_line_reaches_the_node_log_and_tee_ends_though_a_library_kept_a_copy_of_stderr(tmp_path: Path) -> None:
    # Before, rank 0 waited for tee until its timeout: on a preemption, until the scheduler's SIGKILL.
    node_log, result = tmp_path / "node.out", tmp_path / "result.json"
    with node_log.open("w") as out:
        done = subprocess.run([sys.executable, "-c", RANK0, str(tmp_path), str(result)], stderr=out,
                              env=subprocess_env(), timeout=60)
    assert done.returncode == 0, node_log.read_text()
    assert json.loads(result.read_text())["tee_ended"], result.read_text()
    assert "the last line" in node_log.read_text()
    assert "the last line" in (tmp_path / rank_log("7", 0)).read_text()
