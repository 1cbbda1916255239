"""The srun step asks for the CPUs and GPUs the job holds on each node (issue 10), so a site that
binds tasks to cores does not keep all the ranks of a node on one core.

The CPU jobs run in the test cluster's `bind` partition, on nodes declared exactly as this machine
is, so that Slurm's binding of a task is what it would be on a real node
(tests/cluster/slurm-cluster.sh). SLURM_CPU_BIND=cores in the environment the job is submitted
from binds every task to cores, as a site's default binding does.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen
from tests.test_slurm_submit import ENV, probe_job, probe_records, submit_with_jobgen, wait_until_finished

CPUS_OF_TASK = "python3 -c 'import os; print(len(os.sched_getaffinity(0)))'"


@pytest.mark.parametrize(
    "resources,procs,cpus,gpus",
    [
        ({"gpus_per_node": 4}, None, "4", "4"),  # one CPU per rank when cpus_per_node is unset
        ({"gpus_per_node": 8, "cpus_per_node": 64}, None, "64", "8"),
        ({"gpus_per_node": 0}, 3, "3", None),
    ],
)
def test_the_srun_step_asks_for_the_cpus_and_gpus_the_header_asks_for(
    tmp_path: Path, resources: dict, procs: int | None, cpus: str, gpus: str | None
) -> None:
    script = jobgen("render", "-s", "slurm", str(probe_job(tmp_path, "render", 2, procs, **resources))).stdout
    assert f"#SBATCH --cpus-per-task={cpus}" in script.splitlines()
    assert (f"#SBATCH --gpus-per-node={gpus}" in script.splitlines()) == (gpus is not None)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    expected = f"--ntasks-per-node=1 --cpus-per-task={cpus}" + (f" --gpus-per-node={gpus}" if gpus else "") + " --kill-on-bad-exit=1"
    assert expected in srun


def test_an_exclusive_job_without_cpus_per_node_gives_its_task_the_smallest_node(tmp_path: Path) -> None:
    script = jobgen("render", "-s", "slurm", str(probe_job(tmp_path, "render", 2, None, gpus_per_node=4, exclusive=True))).stdout
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert '--cpus-per-task="$jobgen_cpus"' in srun
    line = next(line for line in script.splitlines() if line.startswith("jobgen_cpus="))
    # SLURM_JOB_CPUS_PER_NODE as Slurm writes it for two nodes of 72 CPUs and one of 36.
    shown = subprocess.run(["bash", "-c", f'{line}; echo "$jobgen_cpus"'], env={"SLURM_JOB_CPUS_PER_NODE": "72(x2),36"},
                           capture_output=True, text=True, check=True)
    assert shown.stdout == "36\n"


@pytest.fixture
def bind_to_cores(monkeypatch) -> None:
    """sbatch hands the submitting environment to the job, and srun reads SLURM_CPU_BIND."""
    monkeypatch.setenv("SLURM_CPU_BIND", "cores")


@pytest.fixture
def node_cpus(slurm_side_cluster) -> int:
    """The CPUs of one `bind` node: all of this machine's."""
    shown = subprocess.run(["scontrol", "show", "node", slurm_side_cluster.binding_nodes[0]], capture_output=True, text=True)
    cpus = int(re.search(r"CPUTot=(\d+)", shown.stdout).group(1))
    if cpus < 2:
        pytest.skip("this machine has one CPU: a task bound to one CPU has all of them")
    return cpus


@pytest.mark.usefixtures("bind_to_cores")
def test_here_a_step_that_asks_for_no_cpus_is_bound_to_one_core(slurm_side_cluster, node_cpus: int, tmp_path: Path) -> None:
    # What the srun options below guard against, shown on this cluster: the job holds every CPU
    # of the node, yet a step that does not ask for them again gets its task bound to one core.
    output = tmp_path / "cpus.out"
    subprocess.run(
        ["sbatch", "--wait", f"--partition={slurm_side_cluster.binding_partition}", "--nodes=2", "--ntasks-per-node=1",
         f"--cpus-per-task={node_cpus}", "--job-name=jobgen-test-binding", f"--output={output}",
         # srun's own lines apart (under load: "Job step creation temporarily disabled, retrying").
         f"--error={tmp_path / 'cpus.err'}", "--wrap", f"srun {CPUS_OF_TASK}; srun --cpus-per-task={node_cpus} {CPUS_OF_TASK}"],
        env={**os.environ, **ENV}, check=True, capture_output=True, timeout=120,
    )
    assert output.read_text().split() == ["1", "1", str(node_cpus), str(node_cpus)]


@pytest.mark.parametrize(
    "resources,procs",
    [
        ({"cpus_per_node": "ALL"}, 2),
        # No cpus_per_node: the job asks one per rank, gets whole nodes, and its task all of them.
        ({"exclusive": True}, 1),
    ],
    ids=["cpus_per_node", "exclusive"],
)
@pytest.mark.usefixtures("bind_to_cores")
def test_every_rank_may_run_on_every_cpu_its_node_holds(
    slurm_side_cluster, node_cpus: int, tmp_path: Path, resources: dict, procs: int
) -> None:
    resources = {key: node_cpus if value == "ALL" else value for key, value in resources.items()}
    config = probe_job(tmp_path, "binding", 2, procs, partition=slurm_side_cluster.binding_partition, **resources)
    job_id = submit_with_jobgen(config)
    assert wait_until_finished(job_id) == "COMPLETED"

    records = probe_records(tmp_path / "runs" / "jobgen-test-binding")
    assert len(records) == 2 * procs
    assert {record["SLURMD_NODENAME"] for record in records} == set(slurm_side_cluster.binding_nodes)
    assert [len(record["cpus"]) for record in records] == [node_cpus] * len(records), records


def test_the_task_on_each_node_sees_every_gpu_the_job_asked_for(slurm_side_cluster, tmp_path: Path) -> None:
    # One task per node runs torchrun, which gives each local rank its GPU out of those the task
    # sees: the task must see them all. (The probe needs CUDA for a GPU job; the node's setup
    # records what torchrun would pass on and stops there.)
    config = probe_job(tmp_path, "gpus", 2, None, gpus_per_node=2, partition=slurm_side_cluster.side_partition)
    job = yaml.safe_load(config.read_text())
    job["environment"] = {"setup": ['echo "$CUDA_VISIBLE_DEVICES" > "$JOBGEN_RUN_DIR/gpus-node$NODE_RANK"', "exit 0"]}
    config.write_text(yaml.safe_dump(job))
    job_id = submit_with_jobgen(config)
    wait_until_finished(job_id)

    run_dir = tmp_path / "runs" / "jobgen-test-gpus"
    assert [(run_dir / f"gpus-node{rank}").read_text().strip() for rank in (0, 1)] == ["0,1", "0,1"]
