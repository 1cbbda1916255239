"""The `shell` scheduler: a job runs on this machine, in the background, under bash.

What a scheduler plug-in for jobgen consists of: this class, which says everything jobgen needs
to know about the scheduler, and its template beside it (shell.sh.j2), which jobgen finds there.
Registered through the `jobgen.schedulers` entry-point group (see pyproject.toml).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import JobEnvironment, Scheduler, directive_options
from jobgen.schedulers.state import JobState


class Shell(Scheduler):
    name = "shell"
    template = "shell.sh.j2"
    launchers = ("local",)  # every node is a process of this machine
    directive_prefix = "#SHELL"
    option_fixes = {"--name": "set name in the job file instead", "--nodes": "set resources.nodes instead"}
    job_environment = JobEnvironment(job_id="SHELL_JOB_ID", submit_dir="SHELL_SUBMIT_DIR")
    reserved_prefixes = ("SHELL_",)
    active_states = frozenset({"RUNNING"})

    def options(self, job: Job) -> list[str]:
        # Nothing reads these lines; they show how a header is made.
        return [f"--name={self.job_name(job)}", f"--nodes={job.resources.nodes}"]

    def option_keys(self, line: str) -> list[str]:
        return [flag for flag, _ in directive_options(line)]

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        # The job id is the pid of the shell that runs the script, in a session of its own.
        process = subprocess.Popen(
            ["bash", "-c", 'export SHELL_JOB_ID=$$ SHELL_SUBMIT_DIR=$PWD; exec bash "$0"', str(script)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        return str(process.pid)

    def state(self, job_id: str) -> Optional[JobState]:
        try:
            stat = Path(f"/proc/{int(job_id)}/stat").read_text()
        except (OSError, ValueError):
            return None  # ended (or never ran here)
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return None  # ended; its parent has not reaped it yet
        return JobState(job_id=job_id, state="RUNNING", source="/proc")

    def cancel(self, job_id: str) -> None:
        try:
            os.killpg(int(job_id), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            raise JobgenError(f"shell job {job_id} is not running") from None
