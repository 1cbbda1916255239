"""PBS Pro (OpenPBS): chunks from `select`, one process per chunk."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any, Optional

from jobgen.schedulers.commands import require, run
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.base import JobEnvironment, Scheduler, directive_options, hms, memory_text
from jobgen.schedulers.state import JobState

# The option key of the line that asks for nodes: `-l select=...` (PBS Pro), `-l nodes=...` (Torque).
CHUNK_REQUEST = "-l select"


class PbsPro(Scheduler):
    name = "pbs"
    template = "pbs.sh.j2"
    launchers = ("pbsdsh", "pbs_tmrsh", "ssh", "mpiexec")
    directive_prefix = "#PBS"
    partition_word = "queue"
    # PBS keeps no restart count in the environment: JOBGEN_RESTART_COUNT is passed on (see the template).
    job_environment = JobEnvironment(job_id="PBS_JOBID", submit_dir="PBS_O_WORKDIR", nodes="PBS_NODEFILE")
    reserved_prefixes = ("PBS_",)
    # qstat's job_state letters of a job not yet finished: queued, running, held, exiting,
    # suspended, waiting, array begun (Torque's T, in transit, too).
    active_states = frozenset("QRHESWBT")
    # How pbsdsh picks the node to start a task on: PBS Pro's takes its index in the node list
    # (-n INDEX), Torque's its host name (-h HOST). The pbsdsh launcher reads this.
    pbsdsh_by_host = False
    spare_nodes = True
    # How qstat shows a job: -x adds finished ones where the server keeps history (PBS Pro);
    # the attribute that counts its starts (a rerun adds one).
    qstat_commands: tuple[tuple[str, ...], ...] = (("qstat", "-f", "-x"), ("qstat", "-f"))
    run_count_field = "run_count"
    option_fixes = {
        "-N": "set name in the job file instead",
        CHUNK_REQUEST: "put chunk resources in resources.chunk_resources",
        "-l ncpus": "set resources.cpus_per_node instead",
        "-l ngpus": "set resources.gpus_per_node instead",
        "-l mem": "set resources.memory_per_node instead",
        "-l place": "remove it: jobgen places one chunk per host (resources.exclusive asks for whole hosts)",
        "-l walltime": "set resources.time_limit instead",
        "-q": "set resources.partition instead",
        "-A": "set resources.account instead",
        "-r": "set requeue.enabled instead",
        "-W tolerate_node_failures": "remove it: jobgen sets it to all for a job with resources.spare_nodes",
        "-j": "remove it: jobgen joins stdout and stderr in one batch log",
        "-v": "name the variables in environment.secrets instead",
    }

    def template_variables(self, job: Job) -> dict[str, Any]:
        return {**super().template_variables(job), "pbsdsh_by_host": self.pbsdsh_by_host,
                "node_request_on_host": self.node_request_on_host(job)}

    def chunk(self, job: Job) -> str:
        """What each node of the job asks for, one chunk of the select."""
        res = job.resources
        chunk = [f"ncpus={job.cpus_per_node}"]
        if res.gpus_per_node:
            chunk.append(f"ngpus={res.gpus_per_node}")
        if res.memory_mb:
            chunk.append(f"mem={memory_text(res.memory_mb, 'gb', 'mb')}")
        # mpiprocs=1: one nodefile line per chunk, so the nodefile lists the nodes in rank order.
        chunk.append("mpiprocs=1")
        # PBS honours the first -l select only, so everything per chunk, the site's too, goes in this one line.
        chunk += [f"{name}={_chunk_value(value)}" for name, value in res.chunk_resources.items()]
        return ":".join(chunk)

    def node_request_on_host(self, job: Job) -> dict[str, str]:
        """A continuation that must avoid some nodes names the hosts it may run on instead, as
        PBS Pro's select has no "not this host" (a chunk may only say `host=NAME`): the `-l`
        resource's name, and a printf format of one node's part with its host for %s."""
        return {"resource": "select", "format": f"1:{self.chunk(job).replace('%', '%%')}:host=%s", "joiner": "+"}

    def options(self, job: Job) -> list[str]:
        res = job.resources
        options = [f"-N {self.job_name(job)}", f"-l select={res.allocated_nodes}:{self.chunk(job)}"]
        options.append("-l place=scatter:excl" if res.exclusive else "-l place=scatter")
        options.append(f"-l walltime={hms(res.time_limit_seconds)}")
        if res.partition:
            options.append(f"-q {res.partition}")
        if res.account:
            options.append(f"-A {res.account}")
        options.append("-r y" if job.requeue.enabled else "-r n")
        if res.spare_nodes:
            # A spare is there to take a failed node's place inside the job, but a mother superior
            # that loses a sister MoM (its host down) kills the whole job after max_poll_downtime
            # (OpenPBS, src/resmom/mom_comm.c) unless the job tolerates node failures (OpenPBS 19
            # and later): the batch script then restarts on the spare (docs/exit-codes.md).
            options.append("-W tolerate_node_failures=all")
        options.append("-j oe")
        if job.environment.secrets:
            options.append(f"-v {','.join(job.environment.secrets)}")
        return options

    def option_keys(self, line: str) -> list[str]:
        """`-X` per option; `-l NAME` per resource and `-W NAME` per attribute, as both list several."""
        keys = []
        for flag, value in directive_options(line):
            if flag in ("-l", "-W"):
                keys += [key for item in value.split(",") for key in _resource_keys(flag, item)]
            else:
                keys.append(flag)
        return keys

    def conflict_fix(self, key: str) -> str:
        # Any other `-l NAME` jobgen generates is a resource of the one chunk line.
        if key not in self.option_fixes and key.startswith("-l "):
            return self.option_fixes[CHUNK_REQUEST]
        return super().conflict_fix(key)

    def warnings(self, job: Job) -> list[str]:
        unused = [f"resources.{key}" for key in ("qos", "constraint") if getattr(job.resources, key)]
        return [f"{key} has no {self.name} equivalent and is not used" for key in unused]

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        require("qsub", self.name)
        self.check_passable(job)
        job_id = run(["qsub", str(script)], f"{self.name} refused the job").strip()
        if not job_id:
            raise JobgenError("qsub printed no job id")
        return job_id

    # What a value passed with `-v` does not survive on OpenPBS 23.06: its qsub refuses a double
    # quote ("cannot send environment with the job"), writes a single quote and a backslash as a
    # backslash and two, and reads a comma with an '=' after it as the start of another NAME=VALUE
    # (and crashed in malloc on it).
    unpassable = "'\"\\"

    def check_passable(self, job: Job) -> None:
        for name in job.environment.secrets:
            value = os.environ.get(name, "")
            bad = sorted({repr(c) for c in value if c in self.unpassable})
            if self.unpassable and "," in value and "=" in value.split(",", 1)[1]:
                bad.append("',' followed by '=' (read as a second NAME=VALUE; its qsub crashed on it)")
            if bad:
                raise JobgenError(
                    f"environment.secrets: the value of {name} has {' and '.join(bad)}, which {self.name}'s qsub -v "
                    "does not pass on intact: use a value without them, or a file the job reads"
                )

    def state(self, job_id: str) -> Optional[JobState]:
        require("qstat", self.name)
        for command in self.qstat_commands:
            argv = [*command, job_id]
            result = subprocess.run(argv, capture_output=True, text=True)
            if result.returncode == 0 and result.stdout.strip():
                fields = qstat_fields(result.stdout)
                restarts = fields.get(self.run_count_field, "")
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


def _chunk_value(value: bool | int | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _resource_keys(flag: str, item: str) -> list[str]:
    name, _, value = item.partition("=")
    if flag == "-l" and name in ("select", "nodes"):
        # One chunk request however it is spelled (PBS Pro turns `nodes=` into a select), and each
        # resource in it: a job-wide `-l mem` beside a select that has mem asks twice.
        return [CHUNK_REQUEST] + [f"-l {part.partition('=')[0]}" for part in value.split(":") if "=" in part]
    return [f"{flag} {name}"]


def qstat_fields(text: str) -> dict[str, str]:
    """`qstat -f` prints `    key = value`; a long value goes on in lines that start with a tab,
    which is not part of it (the text goes on exactly after it, a space included)."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("\t") and key:
            fields[key] += line[1:]
        elif " = " in line:
            key, value = (part.strip() for part in line.split(" = ", 1))
            fields[key] = value
    return {name: value.strip() for name, value in fields.items()}
