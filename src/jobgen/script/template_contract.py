"""The template contract with site overrides: the blocks an override may fill, and the variables
each shipped block uses. An admin's override that extends `bundled/NAME` and fills these blocks
keeps working across jobgen releases; a change here is a change for every site.

tests/test_templates.py parses the bundled templates and fails when their blocks or the variables
a block uses differ from this table, and when docs/template-contract.md differs from `markdown()`.
"""

from __future__ import annotations

# What the variables are (every template sees all of them; values print shell-quoted unless |raw).
VARIABLES: dict[str, str] = {
    "job": "the resolved job (jobgen.job.models.Job): job.resources, job.launch, job.environment, job.container, ...",
    "directives": "the scheduler's header lines (#SBATCH, #PBS), built and checked by jobgen: they print as they are",
    "version": "jobgen's version",
    "scheduler": "the scheduler's name: slurm, pbs, torque, local, or a plug-in's",
    "site": "the site profile's name, or empty",
    "launcher": "the per-node launcher: srun, pbsdsh, pbs_tmrsh, ssh, mpiexec or local",
    "launchers": "the launcher macros (launchers.sh.j2): `launchers[launcher](job)` starts node.sh on every node",
    "warnings": "one line each: what the job asks that runs but is probably not meant",
    "nccl": "NCCL variables of the job's network preset and launch fields, NAME -> value (empty on CPUs)",
    "nccl_reasons": "NAME -> one line: the field that sets each of nccl's variables and why (jobgen.job.nccl)",
    "files": "the run directory's file names (jobgen.rundir.files), e.g. files.stop_requested",
    "scheduler_env": "the scheduler's own environment variables the job reads (jobgen.schedulers)",
    "node_request_on_host": "PBS Pro and Torque: one node's request naming its host (resource, printf format, "
                            "joiner), for a continuation that must avoid excluded nodes",
    "sweep": "a sweep's job array, else None: sweep.points (index, run_dir, job_yaml of each task) and sweep.max_running",
}

# Template -> block -> (what it is for, the variables the shipped block uses).
BLOCKS: dict[str, dict[str, tuple[str, frozenset[str]]]] = {
    "job.sh.j2": {
        "header": ("the directive lines and the comment describing the job", frozenset(
            {"directives", "job", "launcher", "scheduler", "site", "sweep", "version", "warnings"})),
        "prologue": ("empty: site checks or banners, before anything else runs", frozenset()),
        "environment": ("the job's secrets and exported variables (NCCL's, environment.variables), at the top: "
                        "they run before the hosts are known", frozenset({"job", "nccl", "nccl_reasons"})),
        "hosts": ("filled by the scheduler's template: job id, restart count, workdir, JOBGEN_HOSTS, and "
                  "jobgen_master_addr where the first host's name is not what the other nodes reach (with a function "
                  "jobgen_address_of HOST for a master that spare nodes change)", frozenset()),
        "restarts": ("filled by the scheduler's template: restarts its variables do not count", frozenset()),
        "too_few_hosts": ("filled by the scheduler's template: why it gave fewer hosts than the job's nodes, "
                          "after the line that says so", frozenset()),
        "stop_by_term": ("filled by the scheduler's template: what SIGTERM to the batch shell means", frozenset()),
        "timers": ("filled by the scheduler's template: warnings before the time limit", frozenset()),
        "launch": ("the per-node launch: starts node.sh on every node (binding flags, pyxis options)", frozenset(
            {"job", "launcher", "launchers"})),
        "requeue": ("filled by the scheduler's template: what a stop with a checkpoint leads to", frozenset()),
    },
    "node.sh.j2": {
        "environment": ("environment.modules, with jobgen_module_load (before an Apptainer container; pyxis starts all of node.sh in its)",
                        frozenset({"job"})),
        "container": ("runs node.sh again inside the job's Apptainer/Singularity container", frozenset({"job", "files"})),
        "setup": ("environment.setup, the user's shell lines (inside the container, if any)", frozenset({"job"})),
        "torchrun": ("checks the commands are on PATH and starts torchrun (jobgen-torchrun) with jobgen-train, jobgen-probe "
                     "or the job's own program (`launch.command`, with `launch.resume_argument` when the batch script "
                     "found a checkpoint)", frozenset({"job", "files"})),
    },
}


def markdown() -> str:
    """The contract as docs/template-contract.md shows it (between its two marker lines)."""
    lines = ["| template | block | what it is for | variables it uses |", "|---|---|---|---|"]
    for template, blocks in BLOCKS.items():
        for block, (purpose, variables) in blocks.items():
            used = ", ".join(f"`{name}`" for name in sorted(variables)) or "none"
            lines.append(f"| {template} | `{block}` | {purpose} | {used} |")
    lines += ["", "| variable | what it is |", "|---|---|"]
    lines += [f"| `{name}` | {meaning} |" for name, meaning in VARIABLES.items()]
    return "\n".join(lines) + "\n"
