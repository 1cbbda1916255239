"""PBS Pro (OpenPBS): chunks from `select`, one process per chunk."""

from __future__ import annotations

from jobgen.models import Job
from jobgen.schedulers.base import Scheduler, hms, memory_text


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
