"""`resources.nodes: "2-4"`: Slurm takes what the partition can give in the range; the others refuse it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from jobgen.errors import JobgenError
from jobgen.job.layers import resolve_job
from jobgen.script.render import render
from tests.helpers import jobgen


def _job(tmp_path: Path, nodes, **training) -> Path:
    job = {
        "name": "range",
        "resources": {"nodes": nodes, "gpus_per_node": 0},
        "launch": {"procs_per_node": 2},
        "training": {"model": "m", "data": "d", "per_device_batch_size": 2, **training},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_a_slurm_node_range_asks_for_the_range_and_takes_any_count_in_it(tmp_path):
    script = render(resolve_job(_job(tmp_path, "2-4", global_batch_size=48)), "slurm")
    assert "#SBATCH --nodes=2-4\n" in script
    # Not --ntasks-per-node=1: with it Slurm counts 2 tasks and never gives more than 2 nodes.
    assert "--ntasks-per-node" not in script.split("\n#\n")[0]
    assert "world size 4, 6, 8" in script
    # The allocation decides the node count: any one in the range runs, one outside it does not.
    assert 'if (( NNODES < 2 || NNODES > 4 )); then' in script
    check = script[script.index("if (( NNODES < "):]
    check = check[: check.index("fi\n") + 3]
    for count, status in ((2, 0), (3, 0), (4, 0), (1, 2), (5, 2)):
        ran = subprocess.run(["bash", "-c", f"NNODES={count}; JOBGEN_HOSTS=(); {check}"], capture_output=True, text=True)
        assert ran.returncode == status, (count, ran.stderr)


def test_a_node_range_whose_counts_cannot_all_split_the_global_batch_is_refused_in_one_line(tmp_path):
    result = jobgen("render", "-s", "slurm", str(_job(tmp_path, "2-4")))  # 2 per device x 4 processes: 8
    assert result.returncode != 0
    assert ("resources.nodes 2-4: the global batch of 8 does not split evenly over world size 6 (3 nodes x 2); "
            "set training.global_batch_size to a multiple of 24, which every count in the range splits") in result.stderr
    assert jobgen("render", "-s", "slurm", str(_job(tmp_path, "2-4", global_batch_size=48))).returncode == 0


@pytest.mark.parametrize("scheduler", ["pbs", "torque"])
def test_pbs_and_torque_refuse_a_node_range(tmp_path, scheduler):
    with pytest.raises(JobgenError) as refused:
        render(resolve_job(_job(tmp_path, "2-4", global_batch_size=48)), scheduler)
    assert str(refused.value) == (
        f"resources.nodes: {scheduler} cannot take a range (2-4); give one count, such as 2 (ranges are Slurm's "
        "--nodes=MIN-MAX)"
    )


@pytest.mark.parametrize("nodes,expected", [(3, 3), ("3", 3), ("3-3", 3), (" 2 - 4 ", "2-4")])
def test_node_counts_and_ranges_are_read_as_written(tmp_path, nodes, expected):
    assert resolve_job(_job(tmp_path, nodes, global_batch_size=48)).job.resources.nodes == expected


@pytest.mark.parametrize("nodes", ["4-2", "0", "two", "2-", True])
def test_a_node_count_that_is_neither_a_count_nor_a_range_is_refused(tmp_path, nodes):
    result = jobgen("render", "-s", "slurm", str(_job(tmp_path, nodes, global_batch_size=48)))
    assert result.returncode != 0 and "resources.nodes" in result.stderr, result.stderr


@pytest.mark.parametrize("scheduler", ["pbs", "torque"])
def test_a_node_range_is_refused_for_pbs_and_torque_before_its_batch_split(tmp_path, scheduler):
    # Fixing the batch for the range first would be for nothing: the scheduler cannot run a range.
    result = jobgen("validate", "-s", scheduler, str(_job(tmp_path, "2-4")))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"jobgen: error: resources.nodes: {scheduler} cannot take a range (2-4); give one "
                                     "count, such as 2 (ranges are Slurm's --nodes=MIN-MAX)")
    assert jobgen("render", "-s", scheduler, str(_job(tmp_path, "3-3", global_batch_size=48))).returncode == 0
