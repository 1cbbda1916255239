"""Torque: `nodes=N:ppn=C`; its nodefile lists each host ppn times, so ranks go per unique host."""

from __future__ import annotations

from jobgen.models import Job
from jobgen.schedulers.base import hms, memory_text
from jobgen.schedulers.pbs import PbsPro


class Torque(PbsPro):
    name = "torque"
    template = "torque.sh.j2"
    launchers = ("pbsdsh", "ssh", "mpiexec")

    def options(self, job: Job) -> list[str]:
        res = job.resources
        nodes = f"nodes={res.nodes}:ppn={res.cpus_per_node or job.procs_per_node}"
        if res.gpus_per_node:
            nodes += f":gpus={res.gpus_per_node}"
        options = [f"-N {self.job_name(job)}", f"-l {nodes}", f"-l walltime={hms(res.time_limit_seconds)}"]
        if res.memory_mb:
            options.append(f"-l mem={memory_text(res.memory_mb * res.nodes, 'gb', 'mb')}")
        if res.exclusive:
            options.append("-n")
        if res.partition:
            options.append(f"-q {res.partition}")
        if res.account:
            options.append(f"-A {res.account}")
        options.append("-r y" if job.requeue.enabled else "-r n")
        options.append("-j oe")
        if job.environment.secrets:
            options.append(f"-v {','.join(job.environment.secrets)}")
        return options
