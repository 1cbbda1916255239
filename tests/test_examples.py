"""The rendered examples in examples/ are golden files: they must equal what `jobgen render` prints.

After an intended change, regenerate them with `JOBGEN_UPDATE_GOLDEN=1 pytest tests/test_examples.py`
and review the diff like code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import EXAMPLES, REPO, jobgen, node_script_of, shell_findings

FLAVOURS = {"slurm": ("sbatch", ".sbatch"), "pbs": ("pbs", ".pbs"), "torque": ("pbs", ".torque.pbs")}
CASES = [(config, scheduler) for config in EXAMPLES for scheduler in FLAVOURS]


def golden_path(config: Path, scheduler: str) -> Path:
    folder, suffix = FLAVOURS[scheduler]
    return REPO / "examples" / folder / f"{config.stem}{suffix}"


@pytest.mark.parametrize("config,scheduler", CASES, ids=[f"{c.stem}-{s}" for c, s in CASES])
def test_rendered_example_matches_golden_file(config: Path, scheduler: str) -> None:
    result = jobgen("render", "--scheduler", scheduler, str(config.relative_to(REPO)), cwd=REPO)
    assert result.returncode == 0, result.stderr
    golden = golden_path(config, scheduler)
    if os.environ.get("JOBGEN_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(result.stdout)
    assert golden.exists(), f"missing {golden}: run JOBGEN_UPDATE_GOLDEN=1 pytest {__file__}"
    assert result.stdout == golden.read_text(), f"{golden} differs from `jobgen render`; regenerate and review"


@pytest.mark.parametrize("config,scheduler", CASES, ids=[f"{c.stem}-{s}" for c, s in CASES])
def test_rendered_example_passes_bash_and_shellcheck(config: Path, scheduler: str, tmp_path: Path, shellcheck: str) -> None:
    script = golden_path(config, scheduler).read_text()
    batch, node = tmp_path / "job.sh", tmp_path / "node.sh"
    batch.write_text(script)
    node.write_text(node_script_of(script))
    assert shell_findings(batch, node) == ""


def test_every_example_config_has_golden_files_and_no_stale_ones() -> None:
    expected = {golden_path(config, scheduler) for config, scheduler in CASES}
    present = {p for folder in ("sbatch", "pbs") for p in (REPO / "examples" / folder).iterdir()}
    assert present == expected
