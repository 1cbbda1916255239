"""A rank that dies (SIGKILL, as the kernel's OOM killer does) on one node: the trainer on the other
node ends at once with the failure, instead of waiting in a collective for the process group's
timeout. Two torchrun agents on this machine stand for two nodes; gloo carries the collectives
(the NCCL case, where destroy_process_group can block after a crash, needs GPUs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from tests.helpers import free_port
from tests.train.conftest import subprocess_env, wait_for_step
from tests.processes import ranks_of


def _node(job, node_rank: int, port: int) -> subprocess.Popen:
    """One node's torchrun. Its output goes to node-N.log beside the job, not to a pipe that nobody
    reads while the test waits (a full pipe would stop the node at its next print)."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
        "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "jobgen.train", "--job", str(job),
    ]
    with open(_log(job, node_rank), "w") as log:
        return subprocess.Popen(
            command, cwd=job.parent, stdout=log, stderr=subprocess.STDOUT, text=True,
            env=subprocess_env(JOBGEN_DEBUG_STEP_DELAY="0.5"),
        )


def _until_listening(port: int, node: subprocess.Popen, log, timeout: float = 120) -> None:
    """Until node 0's torchrun serves its store on `port`. Node 1 starts only then: started at once,
    its retried connects to the free port could be given that very port as their own and connect
    to themselves (TCP self-connect), or another process's connection could take it first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise AssertionError(f"node 0 ended before serving its store:\n{log.read_text()}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"node 0 did not serve its store on port {port} in {timeout}s:\n{log.read_text()}")


def _log(job, node_rank: int):
    return job.parent / f"node-{node_rank}.log"


def test_a_rank_killed_on_one_node_ends_the_other_nodes_trainer_within_seconds(tools, tiny, tmp_path):
    job = tools.write_job(tmp_path / "two-nodes", tiny, procs=1, collective_timeout_minutes=10)
    port = free_port()
    nodes = [_node(job, 0, port)]
    try:
        _until_listening(port, nodes[0], _log(job, 0))
        nodes.append(_node(job, 1, port))
        wait_for_step(job.parent / "output" / "metrics.jsonl", 2, nodes[0], log=_log(job, 0))
        (victim,) = ranks_of(nodes[1].pid).values()
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        nodes[0].wait(timeout=180)
        ended_after = time.monotonic() - killed_at
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    output = _log(job, 0).read_text()
    assert nodes[0].returncode != 0, output
    assert ended_after < 60, f"node 0 ended {ended_after:.0f} s after rank 1 died (timeout: 10 min)"
    report = tools.exit_report(job.parent)
    assert report["reason"] == "failed", report
