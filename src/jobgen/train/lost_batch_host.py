"""A Slurm job whose batch host died: a surviving node requeues it.

A job with spare nodes or a node range is submitted with `--no-kill` (jobgen.schedulers.slurm), so
that the failure of one node does not end it: the batch script restarts it on the others. When the
node that fails is the batch host, the batch script dies with it, and Slurm cuts that node out of
the job and keeps the job running on the others: nothing trains, nothing requeues, the nodes are
held until the time limit (slurmctld's node-failure handling under --no-kill).

So the nodes watch for it. When a node's ranks have failed (they do when the batch host, which is
also the rendezvous, goes silent: the hang supervisor or gloo ends them), jobgen-torchrun asks, before
it exits: is the batch host still there? Its slurmd's port answering is enough to go on as usual
(the batch script will decide). If it does not answer, the node waits for Slurm's own word (the
node DOWN, after SlurmdTimeout), and the first surviving node of the job then does what the batch
script would have done: it records the segment's end as a node failure naming the batch host, keeps
that node out of later segments (RUN_DIR/excluded-nodes), and requeues the job
(`scontrol requeue`), which resumes from the last complete checkpoint on nodes Slurm chooses
afresh (a DOWN node is not among them).

The batch script turns it on by exporting JOBGEN_BATCH_HOST_WATCH=slurm (templates/slurm.sh.j2).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from typing import Optional

from jobgen.rundir.files import EXCLUDED_NODES, SEGMENTS, batch_log
from jobgen.schedulers.state import parse_key_values

PROBE_SECONDS = 5.0  # a live slurmd accepts a connection well within this
POLL_SECONDS = 5.0
WORD_MARGIN_SECONDS = 60.0  # past SlurmdTimeout: Slurm's ping interval and the controller's own delays


def _slurm(*argv: str) -> Optional[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _answers(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=PROBE_SECONDS):
            return True
    except OSError:
        return False


def _node_down(name: str) -> bool:
    state = parse_key_values(_slurm("scontrol", "-o", "show", "node", name) or "").get("State", "")
    return "DOWN" in state.split("+")


def _say(run_dir: str, job_id: str, line: str) -> None:
    sys.stderr.write(line + "\n")
    try:  # the batch log too, where `jobgen logs` reads a job's story; its writer is gone
        with open(os.path.join(run_dir, batch_log(job_id)), "a") as log:
            log.write(line + "\n")
    except OSError:
        pass


def _record_end(run_dir: str, job_id: str, restart: str, node: str) -> None:
    """The segment's end line, as the batch script writes it (job.sh.j2's jobgen_record), and the
    node kept out of later segments."""
    path = os.path.join(run_dir, SEGMENTS)
    started_at = None
    try:
        with open(path) as segments:
            for line in segments:
                event = json.loads(line)
                if event.get("event") == "start" and event.get("job_id") == job_id and str(event.get("restart")) == restart:
                    started_at = event.get("started_at")
    except (OSError, ValueError):
        pass
    now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = {"event": "end", "job_id": job_id, "restart": int(restart) if restart.isdigit() else 0,
           "started_at": started_at or now, "at": now, "first_step": None, "last_step": None,
           "outcome": "node_failed", "train_seconds": None, "nodes": node}
    with open(path, "a") as segments:
        segments.write(json.dumps(end) + "\n")
    excluded = os.path.join(run_dir, EXCLUDED_NODES)
    try:
        with open(excluded) as listed:
            if node in listed.read().split():
                return
    except OSError:
        pass
    with open(excluded, "a") as listed:
        listed.write(node + "\n")


def requeue_if_the_batch_host_is_gone(status: int) -> None:
    """After this node's ranks ended with `status`: if the job's batch host is gone, the first
    surviving node records it and requeues the job; otherwise nothing (the batch script decides)."""
    if os.environ.get("JOBGEN_BATCH_HOST_WATCH") != "slurm" or status == 0:
        return
    job_id, run_dir = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("JOBGEN_RUN_DIR", "")
    me = os.environ.get("SLURMD_NODENAME") or os.environ.get("JOBGEN_NODE_NAME", "")
    if not job_id or not run_dir:
        return
    job = parse_key_values(_slurm("scontrol", "-o", "show", "job", job_id) or "")
    batch_host = job.get("BatchHost", "")
    if not batch_host or batch_host == me or job.get("JobState") != "RUNNING":
        return
    address = parse_key_values(_slurm("scontrol", "-o", "show", "node", batch_host) or "").get("NodeAddr", batch_host)
    config = _slurm("scontrol", "show", "config") or ""
    port = next((int(line.split("=")[1]) for line in config.splitlines()
                 if line.replace(" ", "").startswith("SlurmdPort=") and line.split("=")[1].strip().isdigit()), 6818)
    if _answers(address, port):
        return
    timeout = next((int(line.split("=")[1].split()[0]) for line in config.splitlines()
                    if line.replace(" ", "").startswith("SlurmdTimeout=")), 300)
    job_name = os.environ.get("JOBGEN_JOB_ID", job_id)
    sys.stderr.write(f"jobgen-torchrun: the batch host {batch_host} ({address}) does not answer: waiting up to "
                     f"{timeout + WORD_MARGIN_SECONDS:.0f} s for Slurm to say whether it is down (SlurmdTimeout {timeout} s)\n")
    deadline = time.monotonic() + timeout + WORD_MARGIN_SECONDS
    while not _node_down(batch_host):
        if time.monotonic() > deadline or _answers(address, port):
            sys.stderr.write(f"jobgen-torchrun: {batch_host} is not down: leaving the job to its batch script\n")
            return
        time.sleep(POLL_SECONDS)
    # One node acts: the first of the job's nodes, in node-rank order, that Slurm still counts.
    listed = _slurm("squeue", "-h", "-j", job_id, "-o", "%N") or ""
    in_job = set((_slurm("scontrol", "show", "hostnames", listed.strip()) or "").split()) if listed.strip() else set()
    survivors = [node for node in os.environ.get("JOBGEN_NODES", "").split() if node != batch_host and node in in_job]
    if not survivors or survivors[0] != me:
        return
    restart = os.environ.get("JOBGEN_RESTART_COUNT", "0")
    _record_end(run_dir, job_name, restart, batch_host)
    # Said first: the requeue ends this job's steps, this process among them.
    _say(run_dir, job_name, f"jobgen: node failure: the batch host {batch_host} is down (Slurm says so) and its batch "
                            f"script with it: node {me} requeues job {job_id} without it; it resumes from the last "
                            "complete checkpoint")
    requeued = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if requeued.returncode != 0:
        _say(run_dir, job_name, f"jobgen: 'scontrol requeue {job_id}' failed ({requeued.stderr.strip()}): cancel the job "
                                "and submit it again to resume from its last checkpoint")
