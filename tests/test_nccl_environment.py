"""The environment a job exports on its nodes: values as the guides write them (numbers, booleans),
one setting per variable, each network preset's NCCL variables and why, and names NCCL never reads."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.helpers import jobgen


def job_file(tmp_path: Path, launch: dict | None = None, variables: dict | None = None) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "nccl",
        "resources": {"nodes": 2, "gpus_per_node": 4},
        "launch": launch or {},
        "environment": {"variables": variables or {}},
        "training": {"model": "m", "data": "d"},
    }))
    return path


def exports(script: str) -> list[str]:
    """The job's exported NAME=VALUE lines (with the comment line above each, if any)."""
    block = script.split("# The job, where jobgen-train reads it on every node.")[0]
    return [line for line in block.splitlines() if re.match(r"export [A-Z0-9_]+=|# ", line)]


def test_numbers_and_booleans_are_exported_as_the_shell_and_nccl_read_them(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(  # as the guides write them: unquoted
        "resources: {nodes: 2, gpus_per_node: 4}\n"
        "environment:\n  variables:\n    NCCL_IB_TIMEOUT: 22\n    NCCL_P2P_DISABLE: true\n"
        "    TOKENIZERS_PARALLELISM: false\n    LOSS_SCALE: 0.5\n    NAME_AS_WORD: 'true'\n"
        "training: {model: m, data: d}\n"
    )
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 0, result.stderr
    assert [line for line in exports(result.stdout) if not line.startswith("#")] == [
        "export NCCL_IB_TIMEOUT=22",
        "export NCCL_P2P_DISABLE=1",
        "export TOKENIZERS_PARALLELISM=0",
        "export LOSS_SCALE=0.5",
        "export NAME_AS_WORD=true",
    ]


def test_a_value_that_is_not_text_a_number_or_a_boolean_is_one_line(tmp_path: Path) -> None:
    config = job_file(tmp_path, variables={"NCCL_IB_HCA": ["mlx5_0", "mlx5_1"]})
    result = jobgen("validate", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "NCCL_IB_HCA: ['mlx5_0', 'mlx5_1'] is not a value for a variable; give text, a number or true/false" in result.stderr
