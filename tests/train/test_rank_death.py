"""A rank that dies (SIGKILL, as the kernel's OOM killer does) on one node: the trainer on the other
node ends at once with the failure, instead of waiting in a collective for the process group's
timeout. Two torchrun agents on this machine stand for two nodes; gloo carries the collectives
(the NCCL case, where destroy_process_group can block after a crash, needs GPUs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.train.conftest import free_port, subprocess_env, wait_for_step
from tests.processes import ranks_of


def _node(job, node_rank: int, port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
        "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "jobgen.train", "--job", str(job),
    ]
    return subprocess.Popen(
        command, cwd=job.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=subprocess_env(JOBGEN_DEBUG_STEP_DELAY="0.5"),
    )


def test_a_rank_killed_on_one_node_ends_the_other_nodes_trainer_within_seconds(tools, tiny, tmp_path):
    job = tools.write_job(tmp_path / "two-nodes", tiny, procs=1, collective_timeout_minutes=10)
    port = free_port()
    nodes = [_node(job, 0, port), _node(job, 1, port)]
    try:
        wait_for_step(job.parent / "output" / "metrics.jsonl", 2, nodes[0])
        (victim,) = ranks_of(nodes[1].pid).values()
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        output = nodes[0].communicate(timeout=180)[0]
        ended_after = time.monotonic() - killed_at
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    assert nodes[0].returncode != 0, output
    assert ended_after < 60, f"node 0 ended {ended_after:.0f} s after rank 1 died (timeout: 10 min)"
    report = tools.exit_report(job.parent)
    assert report["reason"] == "failed", report
