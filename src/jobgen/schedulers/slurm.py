"""Slurm: `#SBATCH` options, one srun task per node."""

from __future__ import annotations

from jobgen.models import Job
from jobgen.schedulers.base import Scheduler, memory_text


class Slurm(Scheduler):
    name = "slurm"
    template = "slurm.sh.j2"
    launchers = ("srun",)
    directive_prefix = "#SBATCH"

    def options(self, job: Job) -> list[str]:
        res = job.resources
        days, rest = divmod(res.time_limit_seconds, 86400)
        hours, rest = divmod(rest, 3600)
        options = [
            f"--job-name={self.job_name(job)}",
            f"--nodes={res.nodes}",
            # One task per node: srun starts torchrun once per node, torchrun starts the ranks.
            "--ntasks-per-node=1",
        ]
        if res.cpus_per_node:
            options.append(f"--cpus-per-task={res.cpus_per_node}")
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
        if job.requeue.enabled:
            # B: signals the batch shell only; it tells the ranks itself (see the script's trap).
            options += ["--requeue", f"--signal=B:{job.requeue.signal}@{job.requeue.warning_seconds}"]
        else:
            options.append("--no-requeue")
        # Append, so the log of a requeued job keeps every segment.
        options += ["--open-mode=append", "--output=%x-%j.out"]
        return options
