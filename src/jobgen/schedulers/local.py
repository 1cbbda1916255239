"""This machine as N simulated nodes: the same per-node script, each node a local process.

`submit` runs the script in the foreground, its output on the terminal and in
RUN_DIR/logs/JOB_ID.out; Ctrl-C (or `jobgen cancel JOB_ID`, or any signal that ends that
`jobgen submit`) asks every rank to checkpoint and stop, as a preemption would. There is no
queue to ask whether a job lives: its processes are, found by the job id in their environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from jobgen.errors import JobgenError
from jobgen.parent_death import signal_when_the_parent_dies
from jobgen.job.models import Job
from jobgen.rundir import files as runfiles
from jobgen.schedulers.base import JobEnvironment, Scheduler
from jobgen.schedulers.state import JobState


def local_job_id(seconds: int, pid: int) -> str:
    """Seconds and process id: two jobs started here at once have different ids. The script's
    automatic MASTER_PORT is a hash of the whole id into 20000-32767 (below the ephemeral ports),
    so they get different ports but for a hash collision, about one pair in 12,768."""
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
        env = {**os.environ, "JOBGEN_JOB_ID": job_id, "PATH": path_with_jobgens_commands(os.environ.get("PATH", ""))}
        log = run_dir / runfiles.batch_log(job_id)
        sys.stderr.write(f"jobgen: local job {job_id} starting; log {log}\n")
        # The script writes its own log (as on every scheduler); its output also goes to the
        # caller. It runs in a session of its own: a stop reaches it from the caller alone
        # (jobgen.rundir.progress.StopRequests), however the caller is asked to end, Ctrl-C
        # included, and the caller goes on showing its output until it has checkpointed.
        # A `jobgen submit` that is killed (SIGKILL: nothing of it can pass a stop on) still stops
        # its job: the script gets SIGTERM when its parent dies, and checkpoints and stops.
        self.process = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=terminate_when_the_parent_dies)
        (run_dir / runfiles.LOCAL_PID).write_text(f"{job_id} {self.process.pid}\n")
        return job_id

    active_states = frozenset({"RUNNING"})

    def state(self, job_id: str) -> Optional[JobState]:
        """RUNNING while a process of the job lives here (its script, a node or a rank, even one
        whose `jobgen submit` was killed); None once none does, so a dead job's record blocks nothing."""
        found = job_processes(job_id)
        if not found:
            return None
        return JobState(job_id, "RUNNING", reason=f"its script is pid {script_pid(found)}", source="/proc")

    def cancel(self, job_id: str) -> None:
        """What Ctrl-C does: SIGINT to the job's script, which asks every rank to checkpoint and
        stop; its `jobgen submit` shows that and ends with the job."""
        found = job_processes(job_id)
        if not found:
            raise JobgenError(f"local job {job_id} has ended: nothing to cancel")
        try:
            os.kill(script_pid(found), signal.SIGINT)
        except ProcessLookupError:
            raise JobgenError(f"local job {job_id} has ended: nothing to cancel") from None


def path_with_jobgens_commands(path: str) -> str:
    """PATH with the folder of the interpreter jobgen runs in last, where jobgen's own commands
    are (jobgen-torchrun, jobgen-train): `.venv/bin/jobgen submit` run without activating .venv
    finds them. Last, so that every command found before (the `python` of a job's own program
    among them) is still the one the user's PATH gives. Unchanged where they are not there."""
    folder = os.path.dirname(sys.executable)
    if not os.access(os.path.join(folder, "jobgen-torchrun"), os.X_OK) or folder in path.split(os.pathsep):
        return path
    return os.pathsep.join([path, folder]) if path else folder


def terminate_when_the_parent_dies() -> None:
    """In the job's script, before it runs: SIGTERM when `jobgen submit` dies (where Linux can say
    so; elsewhere a killed `jobgen submit` leaves its job running, as before)."""
    signal_when_the_parent_dies(signal.SIGTERM)


def job_processes(job_id: str) -> dict[int, int]:
    """pid -> parent pid of this machine's processes of local job `job_id`: those with
    JOBGEN_JOB_ID=job_id in their environment (submit sets it; the script's nodes and ranks
    inherit it; the id, seconds and jobgen's pid, names one job). A process whose environment
    cannot be read (another user's) is passed over."""
    wanted = f"JOBGEN_JOB_ID={job_id}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile, or not ours
    return found


def script_pid(processes: dict[int, int]) -> int:
    """The job's script: the process of the job whose parent is not of the job."""
    return min(pid for pid, parent in processes.items() if parent not in processes)
