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


REVIEW_MARKER = "# ---- jobgen machinery below: the same for every job"
FIRST_SCREEN = 60  # lines


@pytest.mark.parametrize("scheduler", FLAVOURS)
def test_a_reviewer_finds_the_whole_job_on_the_scripts_first_screen(scheduler: str) -> None:
    # What an admin asked to review the two-node LoRA example checks, above one marked line near
    # the top; below it, only what every job shares.
    config = REPO / "configs" / "examples" / "llama-lora-2node.yaml"
    script = jobgen("render", "--scheduler", scheduler, str(config.relative_to(REPO)), cwd=REPO).stdout
    lines = script.splitlines()
    markers = [i for i, line in enumerate(lines) if line.startswith(REVIEW_MARKER)]
    assert len(markers) == 1 and markers[0] < FIRST_SCREEN, f"the machinery's marked line is at {markers}"
    job_part, machinery = lines[: markers[0]], lines[markers[0] + 1 :]
    directive = "#SBATCH " if scheduler == "slurm" else "#PBS "
    assert [line for line in machinery if line.startswith(directive)] == []
    assert any(line.startswith(f"{directive}--job-name=llama3-8b-lora" if scheduler == "slurm" else f"{directive}-N llama3-8b-lora")
               for line in job_part)
    for wanted in (
        "#   lora, ZeRO-2, bf16, model meta-llama/Meta-Llama-3-8B",  # what the job is
        "jobgen_run_dir=runs/llama3-8b-lora",  # where it runs
        "export HF_TOKEN",  # environment.secrets, by name
        "export NCCL_IB_DISABLE=0",  # the network preset's
        "export HF_HOME=/scratch/hf-cache",  # environment.variables
        "jobgen_module_load cuda/12.4",  # environment.modules
        'source "$HOME/venvs/finetune/bin/activate"',  # environment.setup
        "exec jobgen-torchrun \\",  # the command each node runs
        '  jobgen-train --job "$JOBGEN_RUN_DIR/job.yaml"',
    ):
        assert wanted in job_part, f"{wanted!r} is not above the marked line"
        assert wanted not in machinery, f"{wanted!r} is below the marked line too"
    # A testing aid of the trainer is no part of a job an admin reviews.
    assert "JOBGEN_DEBUG" not in script
