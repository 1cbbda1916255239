"""A job whose batch host died: a surviving node carries it on (Slurm and Torque).

Slurm: a job with spare nodes or a node range is submitted with `--no-kill`
(jobgen.schedulers.slurm), so that the failure of one node does not end it: the batch script
restarts it on the others. When the node that fails is the batch host, the batch script dies with
it, and Slurm cuts that node out of the job and keeps the job running on the others: nothing
trains, nothing requeues, the nodes are held until the time limit (slurmctld's node-failure
handling under --no-kill). The node that acts requeues the job (`scontrol requeue`), which resumes
from the last complete checkpoint on nodes Slurm chooses afresh (a DOWN node is not among them).

Torque: a job whose mother superior (the batch host) died stays running, held until its walltime:
Torque has no rule that requeues it, and `qrerun` is an operator's. The node that acts submits the
job's continuation itself, as the batch script does after a node failure (pbs_requeue.sh.j2): the
copy of the batch script the job made at its start, with the next restart count and the job's
secrets by name, on nodes the server picks (the dead one is down there). It then asks the server
to delete the stuck job; Torque does so only once that MoM answers again, or an admin purges it
(`qdel -p`; or `owner_purge`, `job_force_cancel_time` on the server): until then it keeps its cores
on the surviving hosts. A compute node's qsub needs `allow_node_submit` (or `submit_hosts`), as every
continuation of a Torque job does.

So the nodes watch for it. When a node's ranks have failed (they do when the batch host, which is
also the rendezvous, goes silent: the hang supervisor or gloo ends them), jobgen-torchrun asks, before
it exits: is the batch host still there? Its daemon's port (slurmd, pbs_mom) answering is enough to
go on as usual (the batch script will decide). If it does not answer, the node waits for the
scheduler's own word (the node down, after SlurmdTimeout or Torque's node_check_rate), and the
first surviving node of the job then does what the batch script would have done: it records the
segment's end as a node failure naming the batch host, keeps that node out of later segments
(RUN_DIR/excluded-nodes), and carries the job on as above.

The batch script turns it on by exporting JOBGEN_BATCH_HOST_WATCH (templates/slurm.sh.j2,
torque.sh.j2).
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

from jobgen.rundir.files import CONTINUATION_SCRIPT, EXCLUDED_NODES, SEGMENTS, SUBMISSIONS, batch_log
from jobgen.schedulers.pbs import qstat_fields
from jobgen.schedulers.state import parse_key_values

PROBE_SECONDS = 5.0  # a live slurmd or pbs_mom accepts a connection well within this
POLL_SECONDS = 5.0
WORD_MARGIN_SECONDS = 60.0  # past the scheduler's own timeout: its ping interval and its own delays
TORQUE_MOM_PORT = 15002  # pbs_mom's service port, where pbsnodes does not show it
TORQUE_CHECK_RATE = 150  # node_check_rate's default: a node silent this long is marked down


def _command(*argv: str) -> Optional[str]:
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


def _say(run_dir: str, job_id: str, line: str) -> None:
    sys.stderr.write(line + "\n")
    try:  # the batch log too, where `jobgen logs` reads a job's story; its writer is gone
        with open(os.path.join(run_dir, batch_log(job_id)), "a") as log:
            log.write(line + "\n")
    except OSError:
        pass


def _append_line(path: str, entry: dict) -> None:
    with open(path, "a") as lines:
        lines.write(json.dumps(entry) + "\n")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
    now = _now()
    _append_line(path, {"event": "end", "job_id": job_id, "restart": int(restart) if restart.isdigit() else 0,
                        "started_at": started_at or now, "at": now, "first_step": None, "last_step": None,
                        "outcome": "node_failed", "train_seconds": None, "nodes": node})
    excluded = os.path.join(run_dir, EXCLUDED_NODES)
    try:
        with open(excluded) as listed:
            if node in listed.read().split():
                return
    except OSError:
        pass
    with open(excluded, "a") as listed:
        listed.write(node + "\n")


class SlurmWatch:
    def __init__(self) -> None:
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.me = os.environ.get("SLURMD_NODENAME") or os.environ.get("JOBGEN_NODE_NAME", "")
        self.job = parse_key_values(_command("scontrol", "-o", "show", "job", self.job_id) or "") if self.job_id else {}
        self.config = _command("scontrol", "show", "config") or ""

    def batch_host(self) -> str:
        return self.job.get("BatchHost", "") if self.job.get("JobState") == "RUNNING" else ""

    def daemon(self, host: str) -> tuple[str, int]:
        address = parse_key_values(_command("scontrol", "-o", "show", "node", host) or "").get("NodeAddr", host)
        port = next((int(line.split("=")[1]) for line in self.config.splitlines()
                     if line.replace(" ", "").startswith("SlurmdPort=") and line.split("=")[1].strip().isdigit()), 6818)
        return address, port

    def timeout(self) -> tuple[float, str]:
        seconds = next((int(line.split("=")[1].split()[0]) for line in self.config.splitlines()
                        if line.replace(" ", "").startswith("SlurmdTimeout=")), 300)
        return seconds, f"SlurmdTimeout {seconds} s"

    def down(self, host: str) -> bool:
        state = parse_key_values(_command("scontrol", "-o", "show", "node", host) or "").get("State", "")
        return "DOWN" in state.split("+")

    def still_counted(self, nodes: list[str]) -> list[str]:
        listed = (_command("squeue", "-h", "-j", self.job_id, "-o", "%N") or "").strip()
        in_job = set((_command("scontrol", "show", "hostnames", listed) or "").split()) if listed else set()
        return [node for node in nodes if node in in_job]

    def carry_on(self, run_dir: str, job_name: str, batch_host: str) -> None:
        # Said first: the requeue ends this job's steps, this process among them.
        _say(run_dir, job_name, f"jobgen: node failure: the batch host {batch_host} is down (Slurm says so) and its batch "
                                f"script with it: node {self.me} requeues job {self.job_id} without it; it resumes from the "
                                "last complete checkpoint")
        requeued = subprocess.run(["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=60)
        if requeued.returncode != 0:
            _say(run_dir, job_name, f"jobgen: 'scontrol requeue {self.job_id}' failed ({requeued.stderr.strip()}): cancel the "
                                    "job and submit it again to resume from its last checkpoint")


class TorqueWatch:
    def __init__(self) -> None:
        self.job_id = os.environ.get("JOBGEN_JOB_ID", "")  # the batch script's $PBS_JOBID
        self.me = os.environ.get("JOBGEN_NODE_NAME", "")
        self.bin = os.environ.get("JOBGEN_PBS_BIN", "")

    def _tool(self, name: str) -> str:
        return os.path.join(self.bin, name) if self.bin else name

    def _node(self, host: str) -> dict[str, str]:
        return qstat_fields(_command(self._tool("pbsnodes"), host) or "")

    def batch_host(self) -> str:
        return os.environ.get("JOBGEN_BATCH_HOST", "")

    def daemon(self, host: str) -> tuple[str, int]:
        # pbsnodes shows each node's MoM port; a site may have moved it from the default.
        port = self._node(host).get("mom_service_port", "")
        return host, int(port) if port.isdigit() else TORQUE_MOM_PORT

    def timeout(self) -> tuple[float, str]:
        rate = qstat_fields(_command(self._tool("qstat"), "-Bf") or "").get("node_check_rate", "")
        seconds = int(rate) if rate.isdigit() else TORQUE_CHECK_RATE
        # A node is marked down at the first check at least node_check_rate after its last report.
        return 2 * seconds, f"node_check_rate {seconds} s"

    def down(self, host: str) -> bool:
        return "down" in self._node(host).get("state", "").split(",")

    def still_counted(self, nodes: list[str]) -> list[str]:
        return [node for node in nodes if not self.down(node)]

    def carry_on(self, run_dir: str, job_name: str, batch_host: str) -> None:
        restart = int(os.environ.get("JOBGEN_RESTART_COUNT", "0") or 0) + 1
        names = [f"JOBGEN_RESTART_COUNT={restart}", *os.environ.get("JOBGEN_SECRET_NAMES", "").split()]
        # From the job's working folder, as the batch script submits it: the continuation's own is that.
        submitted = subprocess.run([self._tool("qsub"), "-v", ",".join(names), os.path.join(run_dir, CONTINUATION_SCRIPT)],
                                   capture_output=True, text=True, timeout=60, cwd=os.environ.get("JOBGEN_WORKDIR") or run_dir)
        if submitted.returncode != 0:
            why = (submitted.stderr.strip().splitlines() or ["no message"])[-1]
            if "ruserok" in why:
                why += (f" (this Torque server takes no jobs from the compute node {self.me}: its admin sets "
                        "'qmgr -c \"set server allow_node_submit = True\"' or adds the node to submit_hosts)")
            _say(run_dir, job_name, f"jobgen: node failure: the mother superior {batch_host} is down (Torque says so) and "
                                    f"the batch script with it; node {self.me} could not submit the continuation ({why}): "
                                    f"delete job {self.job_id} and submit the job again to resume from its last checkpoint")
            return
        next_id = submitted.stdout.strip().split()[-1] if submitted.stdout.strip() else "?"
        _append_line(os.path.join(run_dir, SUBMISSIONS), {"job_id": next_id, "scheduler": "torque", "submitted_at": _now(),
                                                          "continuation_of": job_name})
        _say(run_dir, job_name, f"jobgen: node failure: the mother superior {batch_host} is down (Torque says so) and the "
                                f"batch script with it: node {self.me} submitted continuation {next_id} (restart {restart}); "
                                "it resumes from the last complete checkpoint")
        # Torque keeps the job until that MoM answers or an admin purges it: asked all the same.
        _command(self._tool("qdel"), self.job_id)
        _say(run_dir, job_name, f"jobgen: asked the server to delete job {self.job_id}; Torque holds it, and its cores on the "
                                f"other nodes, until {batch_host}'s MoM answers again or an admin purges it (qdel -p)")


WATCHES = {"slurm": SlurmWatch, "torque": TorqueWatch}


def requeue_if_the_batch_host_is_gone(status: int) -> None:
    """After this node's ranks ended with `status`: if the job's batch host is gone, the first
    surviving node records it and carries the job on; otherwise nothing (the batch script decides)."""
    kind = os.environ.get("JOBGEN_BATCH_HOST_WATCH", "")
    run_dir = os.environ.get("JOBGEN_RUN_DIR", "")
    if kind not in WATCHES or status == 0 or not run_dir:
        return
    watch = WATCHES[kind]()
    batch_host = watch.batch_host()
    if not watch.job_id or not batch_host or batch_host == watch.me:
        return
    address, port = watch.daemon(batch_host)
    if _answers(address, port):
        return
    timeout, source = watch.timeout()
    sys.stderr.write(f"jobgen-torchrun: the batch host {batch_host} ({address}) does not answer: waiting up to "
                     f"{timeout + WORD_MARGIN_SECONDS:.0f} s for the scheduler to say whether it is down ({source})\n")
    deadline = time.monotonic() + timeout + WORD_MARGIN_SECONDS
    while not watch.down(batch_host):
        if time.monotonic() > deadline or _answers(address, port):
            sys.stderr.write(f"jobgen-torchrun: {batch_host} is not down: leaving the job to its batch script\n")
            return
        time.sleep(POLL_SECONDS)
    # One node acts: the first of the job's nodes, in node-rank order, that the scheduler still counts.
    nodes = [node for node in os.environ.get("JOBGEN_NODES", "").split() if node != batch_host]
    survivors = watch.still_counted(nodes)
    if not survivors or survivors[0] != watch.me:
        return
    job_name = os.environ.get("JOBGEN_JOB_ID", watch.job_id)
    _record_end(run_dir, job_name, os.environ.get("JOBGEN_RESTART_COUNT", "0"), batch_host)
    watch.carry_on(run_dir, job_name, batch_host)
