"""Grid Engine (Son of Grid Engine, Altair Grid Engine): `#$` options; the nodes are the hosts of
$PE_HOSTFILE. Written against Grid Engine's manual pages, not run on a Grid Engine cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import JobEnvironment, Scheduler, hms
from jobgen.schedulers.commands import require, run
from jobgen.schedulers.state import JobState


class GridEngine(Scheduler):
    name = "sge"
    template = "sge.sh.j2"
    launchers = ("ssh",)  # qrsh -inherit would need the PE's control_slaves; ssh needs nothing of it
    directive_prefix = "#$"
    job_environment = JobEnvironment(job_id="JOB_ID", submit_dir="SGE_O_WORKDIR", nodes="PE_HOSTFILE")
    reserved_prefixes = ("SGE_", "PE_", "NSLOTS", "NHOSTS", "NQUEUES")
    active_states = frozenset({"QW", "HQW", "R", "T", "RR", "RT", "S", "ST"})
    # A parallel environment with `allocation_rule 1` gives one slot per host: each site names its own.
    parallel_environment = "one-per-host"

    def options(self, job: Job) -> list[str]:
        res = job.resources
        options = [f"-N {self.job_name(job)}", f"-pe {self.parallel_environment} {res.nodes}", f"-l h_rt={hms(res.time_limit_seconds)}"]
        if res.gpus_per_node:
            options.append(f"-l gpu={res.gpus_per_node}")  # the usual consumable's name; sites differ
        if res.partition:
            options.append(f"-q {res.partition}")
        if res.account:
            options.append(f"-A {res.account}")
        # -r y: a job that exits 99 is queued again (the requeue block); -j y: one output file.
        options += ["-r y" if job.requeue.enabled else "-r n", "-j y", "-S /bin/bash"]
        return options

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        require("qsub", "Grid Engine")
        return run(["qsub", "-terse", str(script)], "qsub").strip().split(".")[0]  # "123" (an array: "123.1-4:1")

    def state(self, job_id: str) -> Optional[JobState]:
        for line in run(["qstat"], "qstat").splitlines()[2:]:  # two header lines, then one job per line
            words = line.split()
            if words and words[0] == job_id:
                return JobState(job_id=job_id, state=words[4].upper(), source="qstat")
        return None

    def cancel(self, job_id: str) -> None:
        if not job_id.isdigit():
            raise JobgenError(f"'{job_id}' is not a Grid Engine job id")
        run(["qdel", job_id], "qdel")
