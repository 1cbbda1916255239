"""Which containers a job's launcher can start: the checks that need the scheduler and launcher.

The fields are in jobgen.job.models.Container; the wrappers are written by the templates (the srun
line in launchers.sh.j2 for pyxis, node.sh.j2's `container` block for Apptainer/Singularity).
"""

from __future__ import annotations

from jobgen.errors import JobgenError
from jobgen.job.models import Job


def check_container(job: Job, scheduler: str, launcher: str) -> None:
    """pyxis is a plug-in of Slurm's srun: only a job whose nodes srun starts can use it."""
    container = job.container
    if container.image and container.runtime == "pyxis" and launcher != "srun":
        raise JobgenError(
            f"'container.runtime' is pyxis, a plug-in of Slurm's srun, and this job's nodes start with "
            f"{launcher} on {scheduler}: use container.runtime apptainer there, or submit to Slurm"
        )
