"""Torque: `nodes=N:ppn=C`; its nodefile lists each host ppn times, so ranks go per unique host.

Torque's `nodes=` takes `ppn=`, `gpus=` and bare node properties, no other NAME=VALUE: a chunk
resource set to true becomes a property (`nodes=2:ppn=8:bigmem`), any other is warned about.
"""

from __future__ import annotations

from jobgen.job.models import Job
from jobgen.schedulers.base import hms, memory_text
from jobgen.schedulers.pbs import PbsPro


class Torque(PbsPro):
    name = "torque"
    template = "torque.sh.j2"
    launchers = ("pbsdsh", "ssh", "mpiexec")
    option_fixes = {**PbsPro.option_fixes, "-n": "set resources.exclusive instead"}
    pbsdsh_by_host = True
    # Torque's `qstat -x` prints XML; it keeps finished jobs for keep_completed seconds, and
    # counts a job's starts in start_count.
    qstat_commands = (("qstat", "-f"),)
    unpassable = ""  # not seen on Torque
    run_count_field = "start_count"

    def chunk(self, job: Job) -> str:
        """What each node of the job asks for, after its count or its name in `nodes=`."""
        res = job.resources
        chunk = f"ppn={job.cpus_per_node}"
        if res.gpus_per_node:
            chunk += f":gpus={res.gpus_per_node}"
        return chunk + "".join(f":{name}" for name, value in res.chunk_resources.items() if value is True)

    def node_request_on_host(self, job: Job) -> dict[str, str]:
        """Torque's `nodes=` takes host names in place of the count: `nodes=tq0:ppn=2+tq1:ppn=2`."""
        return {"resource": "nodes", "format": f"%s:{self.chunk(job).replace('%', '%%')}", "joiner": "+"}

    def options(self, job: Job) -> list[str]:
        res = job.resources
        options = [f"-N {self.job_name(job)}", f"-l nodes={res.allocated_nodes}:{self.chunk(job)}",
                   f"-l walltime={hms(res.time_limit_seconds)}"]
        if res.allocated_nodes > 1:
            # Moab, without exact node matching, may pack nodes=2:ppn=4 onto one host with 8
            # cores; this extension asks it for N distinct hosts. pbs_sched accepts and ignores it.
            options.append("-W x=nmatchpolicy:exactnode")
        if res.memory_mb:
            options.append(f"-l mem={memory_text(res.memory_mb * res.allocated_nodes, 'gb', 'mb')}")
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

    def warnings(self, job: Job) -> list[str]:
        unused = [name for name, value in job.resources.chunk_resources.items() if value is not True]
        return super().warnings(job) + [
            f"resources.chunk_resources.{name} has no torque nodes= equivalent and is not used: "
            "Torque takes node properties only, given as NAME: true"
            for name in unused
        ]
