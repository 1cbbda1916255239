"""Slurm: `#SBATCH` options, one srun task per node."""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from jobgen.schedulers.commands import require, run, scheduler_message
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import JobEnvironment, Scheduler, directive_options, memory_text
from jobgen.schedulers.state import JobState, parse_key_values

if TYPE_CHECKING:  # imported when submitting only: render's start-up stays without it
    import submitit


class Slurm(Scheduler):
    name = "slurm"
    template = "slurm.sh.j2"
    launchers = ("srun",)
    directive_prefix = "#SBATCH"
    node_ranges = True
    spare_nodes = True
    job_environment = JobEnvironment(
        job_id="SLURM_JOB_ID", restart_count="SLURM_RESTART_COUNT", submit_dir="SLURM_SUBMIT_DIR", nodes="SLURM_JOB_NODELIST",
        array_task_id="SLURM_ARRAY_TASK_ID", array_job_id="SLURM_ARRAY_JOB_ID",
    )
    # Each task of an array is a job of its own to Slurm (its own SLURM_JOB_ID, restart count and
    # `scontrol requeue`), so a sweep's points requeue and resume one by one.
    job_arrays = True
    reserved_prefixes = ("SLURM_",)
    # squeue's and scontrol's words for a job that is queued, running or coming back.
    active_states = frozenset({
        "PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED",
        "RESIZING",
    })
    option_fixes = {
        "job-name": "set name in the job file instead",
        "nodes": "set resources.nodes instead",
        "ntasks-per-node": "remove it: jobgen starts one task per node, and torchrun launch.procs_per_node ranks in it",
        "cpus-per-task": "set resources.cpus_per_node instead",
        "gpus": "set resources.gpus_per_node instead",
        "mem": "set resources.memory_per_node instead",
        "time": "set resources.time_limit instead",
        "partition": "set resources.partition instead",
        "account": "set resources.account instead",
        "qos": "set resources.qos instead",
        "constraint": "set resources.constraint instead",
        "exclusive": "set resources.exclusive instead",
        "requeue": "set requeue.enabled instead",
        "signal": "set requeue.signal and requeue.warning_seconds instead",
        "open-mode": "remove it: jobgen appends every requeued segment to one batch log",
        "output": "remove it: jobgen appends every requeued segment to one batch log",
        "array": "remove it: a sweep (--sweep) makes the job array, with --max-running as its limit",
    }

    def options(self, job: Job) -> list[str]:
        res = job.resources
        days, rest = divmod(res.time_limit_seconds, 86400)
        hours, rest = divmod(rest, 3600)
        options = [
            f"--job-name={self.job_name(job)}",
            # MIN-MAX where a range: the job script counts the nodes it got (job.sh.j2). With spare
            # nodes, those too: the script trains on resources.nodes of them.
            f"--nodes={res.allocated_nodes if res.spare_nodes else res.nodes}",
        ]
        # One task per node: srun starts torchrun once per node, torchrun starts the ranks. Not for a
        # range: Slurm counts MIN x 1 tasks then, and never gives it more than MIN nodes (a job
        # without it gets one task per node it is given; the srun step asks for one a node itself).
        if res.min_nodes == res.max_nodes:
            options.append("--ntasks-per-node=1")
        # Always given, as PBS gets ncpus and Torque ppn: without it a job holds one CPU per node.
        # The srun step asks for the same again (launchers.sh.j2).
        options.append(f"--cpus-per-task={job.cpus_per_node}")
        if res.gpus_per_node:
            options.append(f"--gpus-per-node={res.gpus_per_node}")
        if res.memory_mb:
            options.append(f"--mem={memory_text(res.memory_mb, 'G', 'M')}")
        options.append(f"--time={days}-{hours:02d}:{rest // 60:02d}:{rest % 60:02d}")
        for flag, value in (("partition", res.partition), ("account", res.account), ("qos", res.qos), ("constraint", res.constraint)):
            if value:
                options.append(f"--{flag}={value}")
        if res.exclusive:
            options.append("--exclusive")
        options.append("--requeue" if job.requeue.enabled else "--no-requeue")
        if job.restarts_in_allocation:
            # A node that goes down would otherwise end the whole job (Slurm's default): the batch
            # script goes on without it, on a spare or on fewer nodes of a range (job.sh.j2).
            options.append("--no-kill")
        # B: signals the batch shell only; it tells the ranks itself (see the script's trap), so
        # a checkpoint is written before the time limit even when requeue is off.
        options.append(f"--signal=B:{job.requeue.signal}@{job.requeue.warning_seconds}")
        # Append, so the log of a requeued job keeps every segment.
        options += ["--open-mode=append", "--output=%x-%j.out"]
        return options

    def array_options(self, options: list[str], tasks: int, max_running: Optional[int]) -> list[str]:
        # Slurm's own log named by array and task (1234_2), as jobgen names the task everywhere.
        options = ["--output=%x-%A_%a.out" if option == "--output=%x-%j.out" else option for option in options]
        return [*options, f"--array=0-{tasks - 1}" + (f"%{max_running}" if max_running else "")]

    def option_keys(self, line: str) -> list[str]:
        """The generated option each option sets (`-p`, `--part` and `--partition` all set
        `partition`); a GPU request by any name is `gpus`; other options keep their own name."""
        keys = []
        for flag, value in directive_options(line):
            key = _long_option(flag[2:]) if flag.startswith("--") else _SHORT_OPTIONS.get(flag[1:], flag)
            if key == "gres" and any(item.split(":")[0].removeprefix("gres/") == "gpu" for item in value.split(",")):
                key = "gpus"
            keys.append(key)
        return keys

    def warnings(self, job: Job) -> list[str]:
        if job.resources.chunk_resources:
            return [
                "resources.chunk_resources has no slurm equivalent and is not used: Slurm has no chunks "
                "(node features go in resources.constraint)"
            ]
        return []

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        require("sbatch", "Slurm")
        from submitit.core.utils import FailedJobError

        executor = _rendered_script_executor(script.read_text(), run_dir / "submitit")
        try:
            # submitit prints sbatch's refusal itself; the user gets it once, in one line, below.
            with contextlib.redirect_stderr(io.StringIO()):
                submitted = executor._submit_command("")  # no command: the file is the script
        except FailedJobError as error:  # sbatch's refusal, with Slurm's words in it
            raise JobgenError(f"Slurm refused the job: {_sbatch_reason(str(error))}") from None
        return str(submitted.job_id)

    def state(self, job_id: str) -> Optional[JobState]:
        require("scontrol", "Slurm")
        result = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
        if result.returncode == 0 and result.stdout.strip():
            fields = parse_key_values(result.stdout.splitlines()[0])
            return JobState(
                job_id=job_id,
                state=fields.get("JobState", "?"),
                reason=fields.get("Reason", "").replace("None", ""),
                nodes=fields.get("NodeList", "").replace("(null)", ""),
                elapsed=fields.get("RunTime", ""),
                restarts=int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else None,
                source="scontrol show job",
            )
        # Gone from the controller's memory: only accounting still knows, where it exists.
        result = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,NodeList,Elapsed"], capture_output=True, text=True
        )
        if result.returncode == 0 and result.stdout.strip():
            state, nodes, elapsed = (result.stdout.splitlines()[-1].split("|") + ["", "", ""])[:3]
            return JobState(job_id=job_id, state=state, nodes=nodes, elapsed=elapsed, source="sacct")
        return None

    def cancel(self, job_id: str) -> None:
        require("scancel", "Slurm")
        run(["scancel", job_id], f"scancel {job_id}")


def _rendered_script_executor(script_text: str, folder: Path) -> submitit.SlurmExecutor:
    """A submitit executor whose sbatch file is `script_text`, unchanged: submitit's own header
    (its --output, --wckey=submitit, no site directives) would differ from what was reviewed.

    sbatch runs in this process's directory, as a hand `sbatch` does, so `--output=%x-%j.out`
    lands in the same place on both paths. Relies on submitit's `_submit_command` writing
    `_make_submission_file_text` to the file it runs sbatch on (pyproject pins the range checked;
    tests/test_submitted_script.py fails if it stops).
    """
    import submitit

    class RenderedScriptExecutor(submitit.SlurmExecutor):
        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script_text

    executor = RenderedScriptExecutor(folder=folder)
    executor.folder.mkdir(parents=True, exist_ok=True)
    return executor


# sbatch's spellings of what the generated options set, by the generated option's key.
_LONG_OPTIONS = {
    **{name: name for name in (
        "job-name nodes ntasks-per-node cpus-per-task mem time partition account qos constraint exclusive requeue "
        "signal open-mode output array"
    ).split()},
    "ntasks": "ntasks-per-node",
    "tasks-per-node": "ntasks-per-node",
    "gpus": "gpus",
    "gpus-per-node": "gpus",
    "gpus-per-task": "gpus",
    "gpus-per-socket": "gpus",
    "mem-per-cpu": "mem",
    "mem-per-gpu": "mem",
    "no-requeue": "requeue",
}
_SHORT_OPTIONS = {
    "J": "job-name", "N": "nodes", "n": "ntasks-per-node", "c": "cpus-per-task", "G": "gpus", "t": "time",
    "p": "partition", "A": "account", "q": "qos", "C": "constraint", "o": "output",
    "a": "array",
}


def _long_option(name: str) -> str:
    if name in _LONG_OPTIONS:
        return _LONG_OPTIONS[name]
    # sbatch takes any unambiguous prefix of a long option (`--part=gpu`). Every name above is
    # sbatch's own: a prefix it shares with an option not listed is ambiguous, and sbatch refuses it.
    keys = {key for option, key in _LONG_OPTIONS.items() if option.startswith(name)}
    return keys.pop() if len(keys) == 1 and name else name


def _sbatch_reason(text: str) -> str:
    errors = [line.split("error:", 1)[1].strip() for line in text.splitlines() if "sbatch: error:" in line]
    return "; ".join(errors) if errors else scheduler_message(text)
