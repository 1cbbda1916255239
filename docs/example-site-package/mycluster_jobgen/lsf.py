"""IBM Spectrum LSF: `#BSUB` options; the nodes are the hosts of $LSB_DJOB_HOSTFILE."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

from jobgen.schedulers.commands import require, run
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import JobEnvironment, Scheduler
from jobgen.schedulers.state import JobState


class Lsf(Scheduler):
    name = "lsf"                      # what --scheduler and a profile's `scheduler:` say
    template = "lsf.sh.j2"            # found beside this module
    launchers = ("ssh",)              # the per-node launchers it can use; the first is the default
    directive_prefix = "#BSUB"
    job_environment = JobEnvironment(job_id="LSB_JOBID", submit_dir="LS_SUBCWD", nodes="LSB_DJOB_HOSTFILE")
    reserved_prefixes = ("LSB_", "LS_")
    active_states = frozenset({"PEND", "RUN", "PSUSP", "USUSP", "SSUSP"})

    def options(self, job: Job) -> list[str]:
        res = job.resources
        minutes = -(-res.time_limit_seconds // 60)
        options = [f"-J {self.job_name(job)}", f"-n {res.nodes}", '-R "span[ptile=1]"', f"-W {minutes}"]
        if res.gpus_per_node:
            options.append(f'-gpu "num={res.gpus_per_node}"')
        if res.partition:
            options.append(f"-q {res.partition}")
        if res.account:
            options.append(f"-P {res.account}")
        return options

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        require("bsub", "LSF")
        with script.open() as text:  # bsub reads the script, #BSUB lines included, on stdin
            result = subprocess.run(["bsub"], stdin=text, capture_output=True, text=True, cwd=run_dir)
        if result.returncode:
            raise JobgenError(f"LSF refused the job: {result.stderr.strip() or result.stdout.strip()}")
        return result.stdout.split("<", 1)[1].split(">", 1)[0]  # "Job <123> is submitted to queue <gpu>."

    def state(self, job_id: str) -> Optional[JobState]:
        words = run(["bjobs", "-noheader", "-o", "stat", job_id], "bjobs").split()
        return JobState(job_id=job_id, state=words[0], source="bjobs") if words else None

    def cancel(self, job_id: str) -> None:
        run(["bkill", job_id], "bkill")
