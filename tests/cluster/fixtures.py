"""Pytest plugin: the `slurm_cluster` fixture, a real Slurm cluster of ten nodes on this machine.

Register it with ``pytest_plugins = ["tests.cluster.fixtures"]`` (or ``-p tests.cluster.fixtures``).
The cluster is started once per session by ``tests/cluster/slurm-cluster.sh start`` and left
running afterwards; stopping it is a separate step (``slurm-cluster.sh stop``).

Without root or without the Slurm packages the tests that use it are skipped, except under
``CI=true``, where that is a failure: CI must run them.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import cannot_run

CLUSTER_SCRIPT = Path(__file__).with_name("slurm-cluster.sh")

# Jobs that tests submit are named with this prefix, so that teardown cancels them and nothing else.
TEST_JOB_PREFIX = "jobgen-test"

NEEDS_ROOT = "needs root to start the Slurm test cluster (tests/cluster/slurm-cluster.sh)"
NEEDS_PACKAGES = "Slurm packages not installed: apt-get install -y slurm-wlm slurm-wlm-torque munge"

# Exit codes of slurm-cluster.sh that mean "cannot run here" rather than "broken".
_EXIT_NOT_ROOT = 2
_EXIT_NO_PACKAGES = 3


@dataclass(frozen=True)
class SlurmTestCluster:
    """What slurm-cluster.sh sets up; see the header of that script."""

    nodes: tuple[str, ...] = ("node1", "node2", "node3", "node4")
    gpus_per_node: int = 8
    default_partition: str = "debug"
    # A job here preempts (and, after GraceTime=30 s, requeues) running jobs in the default one.
    preempting_partition: str = "high"
    # Declared exactly as this machine is, in a partition of their own: a task's CPU binding there
    # is what it would be on a real node (on `nodes`, 128 CPUs map onto this machine's few).
    binding_nodes: tuple[str, ...] = ("bind1", "bind2")
    binding_partition: str = "bind"
    # Four more nodes like `nodes`, in a partition of their own that nothing preempts: the tests
    # that preempt nothing run there (fixture `slurm_side_cluster`), beside those that preempt
    # `debug`, as a second unit of the test run.
    side_nodes: tuple[str, ...] = ("node5", "node6", "node7", "node8")
    side_partition: str = "side"
    state_dir: Path = Path(os.environ.get("JOBGEN_SLURM_DIR", "/var/tmp/jobgen-slurm"))


def _cancel_test_jobs(basetemp: Path) -> None:
    """This session's test jobs only: the cluster may be shared by several pytest sessions at
    once, and a job's script (squeue's %o) lies under the session's own temporary folder."""
    listing = subprocess.run(
        ["squeue", "--noheader", "--format=%A|%j|%o"],
        capture_output=True, text=True, timeout=30, check=False,
    )
    job_ids = [
        job_id
        for job_id, name, command in (line.split("|", 2) for line in listing.stdout.splitlines() if line.count("|") >= 2)
        if name.startswith(TEST_JOB_PREFIX) and command.startswith(f"{basetemp}/")
    ]
    if job_ids:
        subprocess.run(["scancel", *job_ids], timeout=30, check=False)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Starts the test cluster (if it is not already up) and yields a `SlurmTestCluster`.

    Tests name their jobs ``jobgen-test...``; this session's still queued at the end are cancelled.
    """
    started = subprocess.run(
        [str(CLUSTER_SCRIPT), "start"],
        capture_output=True, text=True, timeout=180, check=False,
    )
    if started.returncode == _EXIT_NOT_ROOT:
        cannot_run(NEEDS_ROOT)
    if started.returncode == _EXIT_NO_PACKAGES:
        cannot_run(NEEDS_PACKAGES)
    if started.returncode != 0:
        pytest.fail(
            f"{CLUSTER_SCRIPT} start exited {started.returncode}:\n"
            f"{started.stdout}{started.stderr}",
            pytrace=False,
        )
    yield SlurmTestCluster()
    _cancel_test_jobs(tmp_path_factory.getbasetemp().resolve())


@pytest.fixture(scope="session")
def slurm_side_cluster(slurm_cluster):
    """The same cluster, for tests whose jobs run in `side_partition` (and `binding_partition`)
    only: tests/conftest.py runs them as a unit of their own, beside those of `debug`."""
    return slurm_cluster
