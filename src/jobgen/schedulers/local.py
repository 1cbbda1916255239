"""This machine as N simulated nodes: the same per-node script, each node a local process.

`submit` runs the script in the foreground, its output on the terminal and in
RUN_DIR/logs/JOB_ID.out; Ctrl-C asks every rank to checkpoint and stop, as a preemption would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.rundir import files as runfiles
from jobgen.schedulers.base import JobEnvironment, Scheduler
from jobgen.schedulers.state import JobState


def local_job_id(seconds: int, pid: int) -> str:
    """The process id last: the script's automatic MASTER_PORT is the id's digits modulo 20000, so
    two jobs started here in the same second get different ports (their pids')."""
    return f"local-{seconds}-{pid}"


class Local(Scheduler):
    name = "local"
    template = "local.sh.j2"
    launchers = ("local",)
    # `submit` sets the job id; a script run by hand makes one up (see the template).
    job_environment = JobEnvironment(job_id="JOBGEN_JOB_ID")
    runs_in_foreground = True

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        """Starts the script here and returns; `self.process` is it, its output a pipe that the
        caller shows (jobgen.rundir.submission, with the training's progress) until it ends."""
        job_id = local_job_id(int(time.time()), os.getpid())
        env = {**os.environ, "JOBGEN_JOB_ID": job_id}
        log = run_dir / runfiles.batch_log(job_id)
        sys.stderr.write(f"jobgen: local job {job_id} starting; log {log}\n")
        # The script writes its own log (as on every scheduler); its output also goes to the
        # caller. Ctrl-C: the terminal sends SIGINT to the whole group, and the script
        # checkpoints and stops while the caller goes on showing its output.
        self.process = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        (run_dir / runfiles.LOCAL_PID).write_text(f"{job_id} {self.process.pid}\n")
        return job_id

    def state(self, job_id: str) -> Optional[JobState]:
        return None  # the run directory's segments say everything about a local run

    def cancel(self, job_id: str) -> None:
        raise JobgenError("a local job runs in the foreground of its `jobgen submit`: press Ctrl-C there")
