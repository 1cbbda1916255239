"""PBS Pro (OpenPBS): chunks from `select`, one process per chunk."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

from jobgen.commands import require, run
from jobgen.errors import JobgenError
from jobgen.models import Job
from jobgen.schedulers.base import Scheduler, hms, memory_text
from jobgen.schedulers.state import JobState


class PbsPro(Scheduler):
    name = "pbs"
    template = "pbs.sh.j2"
    launchers = ("pbsdsh", "pbs_tmrsh", "ssh", "mpiexec")
    directive_prefix = "#PBS"

    def options(self, job: Job) -> list[str]:
        res = job.resources
        chunk = [f"select={res.nodes}", f"ncpus={res.cpus_per_node or job.procs_per_node}"]
        if res.gpus_per_node:
            chunk.append(f"ngpus={res.gpus_per_node}")
        if res.memory_mb:
            chunk.append(f"mem={memory_text(res.memory_mb, 'gb', 'mb')}")
        # mpiprocs=1: one nodefile line per chunk, so the nodefile lists the nodes in rank order.
        chunk.append("mpiprocs=1")
        # PBS honours the first -l select only, so everything per chunk goes in this one line.
        options = [f"-N {self.job_name(job)}", f"-l {':'.join(chunk)}"]
        options.append("-l place=scatter:excl" if res.exclusive else "-l place=scatter")
        options.append(f"-l walltime={hms(res.time_limit_seconds)}")
        if res.partition:
            options.append(f"-q {res.partition}")
        if res.account:
            options.append(f"-A {res.account}")
        options.append("-r y" if job.requeue.enabled else "-r n")
        options.append("-j oe")
        if job.environment.secrets:
            options.append(f"-v {','.join(job.environment.secrets)}")
        return options

    def warnings(self, job: Job) -> list[str]:
        unused = [f"resources.{key}" for key in ("qos", "constraint") if getattr(job.resources, key)]
        return [f"{key} has no {self.name} equivalent and is not used" for key in unused]

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        require("qsub", self.name)
        job_id = run(["qsub", str(script)], f"{self.name} refused the job").strip()
        if not job_id:
            raise JobgenError("qsub printed no job id")
        return job_id

    def state(self, job_id: str) -> Optional[JobState]:
        require("qstat", self.name)
        # -x also shows finished jobs where the server keeps history (PBS Pro).
        for argv in (["qstat", "-f", "-x", job_id], ["qstat", "-f", job_id]):
            result = subprocess.run(argv, capture_output=True, text=True)
            if result.returncode == 0 and result.stdout.strip():
                fields = _qstat_fields(result.stdout)
                restarts = fields.get("run_count", "")
                return JobState(
                    job_id=job_id,
                    state=fields.get("job_state", "?"),
                    reason=fields.get("comment", ""),
                    nodes=fields.get("exec_host", ""),
                    elapsed=fields.get("resources_used.walltime", ""),
                    restarts=int(restarts) - 1 if restarts.isdigit() and int(restarts) > 0 else None,
                    source=" ".join(argv[:-1]),
                )
        return None

    def cancel(self, job_id: str) -> None:
        require("qdel", self.name)
        run(["qdel", job_id], f"qdel {job_id}")


def _qstat_fields(text: str) -> dict[str, str]:
    """`qstat -f` prints `    key = value`, continuation lines indented further."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if " = " in line:
            key, value = (part.strip() for part in line.split(" = ", 1))
            fields[key] = value
        elif key and line.startswith("\t"):
            fields[key] += line.strip()
    return fields
