"""The batch script's reading of the nodes' end records through a network file system that keeps
a miss for long (tests/cluster/shared_fs.py: sshfs with negative_timeout=60 s, as NFS's
lookupcache=all keeps one until the folder's cached attributes expire). The batch host looks
through one mount (node A's) while a slow node writes through another (node B's) after the batch
host's first look: the batch script's own functions, cut from a rendered script, and the node's own
writer (jobgen-torchrun's record_node_end)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.helpers import jobgen

JOB_ID = "4242"


def reader_functions(tmp_path: Path) -> str:
    """The node-end reading functions of a rendered 2-node Slurm script."""
    job = {"name": "reader", "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 1}, "training": {"model": "m", "data": "d.json", "method": "lora"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    script = jobgen("render", "-s", "slurm", str(tmp_path / "job.yaml"), cwd=tmp_path).stdout
    functions = [match.group(0) for match in re.finditer(
        r"^(declare -A jobgen_node_end_seen.*\n)?jobgen_(node_end|lost_nodes)\(\) \{\n.*?^\}\n", script, re.M | re.S)]
    assert any("jobgen_lost_nodes()" in f for f in functions), script
    return "".join(functions)


def write_node_end(run_dir: Path, rank: int, status: int, restart: int = 0) -> None:
    """What jobgen-torchrun writes as node `rank`'s part of segment `restart` ends, through the mount it is given."""
    env = {**os.environ, "JOBGEN_RUN_DIR": str(run_dir), "NODE_RANK": str(rank), "JOBGEN_JOB_ID": JOB_ID,
           "JOBGEN_RESTART_COUNT": str(restart), "JOBGEN_NODE_NAME": f"cn00{rank + 1}"}
    code = f"from jobgen.train.torchrun import record_node_end; record_node_end({status})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


def read_lost_nodes(tmp_path: Path, run_dir: Path, restart: int) -> subprocess.Popen:
    """The batch script's jobgen_lost_nodes at the end of segment `restart`, started now."""
    return subprocess.Popen(
        ["bash", "-c", reader_functions(tmp_path) + 'echo "lost: [$(jobgen_lost_nodes)]"'],
        env={**os.environ, "JOBGEN_RUN_DIR": str(run_dir), "JOBGEN_JOB_ID": JOB_ID, "JOBGEN_RESTART_COUNT": str(restart),
             "NNODES": "2", "JOBGEN_NODES": "cn001 cn002"}, stdout=subprocess.PIPE, text=True)


def test_a_node_whose_record_comes_after_the_first_look_is_not_named_lost_on_a_mount_keeping_misses(
        shared_fs_keeping_misses, tmp_path: Path) -> None:
    batch_host, slow_node = shared_fs_keeping_misses.mounts
    (shared_fs_keeping_misses.served / "run").mkdir()
    write_node_end(slow_node / "run", 0, 1)  # node 0's ranks failed for want of node 1
    reader = read_lost_nodes(tmp_path, batch_host / "run", restart=0)
    time.sleep(1.5)  # the batch host has looked for node 1's record, and its mount keeps the miss
    write_node_end(slow_node / "run", 1, 143)  # node 1 was slow: ended by the signal jobgen sent it
    output, _ = reader.communicate(timeout=120)
    assert output.strip() == "lost: []", output  # every node ended by itself: none lost


def test_a_late_record_of_the_previous_segment_does_not_hide_a_node_lost_in_this_one(
        shared_fs_keeping_misses, tmp_path: Path) -> None:
    batch_host, other = shared_fs_keeping_misses.mounts
    (shared_fs_keeping_misses.served / "run").mkdir()
    write_node_end(other / "run", 0, 1, restart=1)
    write_node_end(other / "run", 1, 143, restart=0)  # node 1's straggler of segment 0, written just now
    output, _ = read_lost_nodes(tmp_path, batch_host / "run", restart=1).communicate(timeout=120)
    assert output.strip() == "lost: [cn002]", output  # in segment 1, node 1 left no record: lost
