"""What every scheduler shares; each subclass says only how its header and node list differ."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Optional

from jobgen.errors import JobgenError
from jobgen.models import Job, _slug
from jobgen.schedulers.state import JobState


class Scheduler:
    name: ClassVar[str]
    template: ClassVar[str]
    # Per-node launchers this scheduler can use; the first is the default.
    launchers: ClassVar[tuple[str, ...]]
    directive_prefix: ClassVar[str] = ""

    def directives(self, job: Job) -> list[str]:
        """Header lines, in order; the job's own extra directives of this flavour come last."""
        own = [f"{self.directive_prefix} {option}" for option in self.options(job)]
        extra = [line for line in job.extra_directives if self.directive_prefix and line.startswith(self.directive_prefix)]
        return own + extra

    def options(self, job: Job) -> list[str]:
        return []

    def warnings(self, job: Job) -> list[str]:
        """Fields this scheduler cannot express, said once instead of dropped silently."""
        return []

    def launcher(self, job: Job) -> str:
        chosen = job.launch.launcher or self.launchers[0]
        if chosen not in self.launchers:
            raise JobgenError(
                f"'launch.launcher' is '{chosen}', which {self.name} cannot use; accepted: {', '.join(self.launchers)}"
            )
        return chosen

    def submission(self, job: Job, script_text: str, script: Path, run_dir: Path) -> str:
        """The exact text `submit` hands to the scheduler (the script itself, unless a scheduler
        wraps it), for --dry-run and the record; nothing is written or submitted."""
        return script_text

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        """Submits and returns the job id."""
        raise NotImplementedError

    def state(self, job_id: str) -> Optional[JobState]:
        """What the scheduler says now; None when it no longer knows the job."""
        raise NotImplementedError

    def cancel(self, job_id: str) -> None:
        raise NotImplementedError

    @staticmethod
    def job_name(job: Job) -> str:
        # Schedulers restrict names (PBS: no spaces, 236 chars); the full name stays in the header.
        return _slug(job.name)[:64]


def memory_text(megabytes: int, giga: str, mega: str) -> str:
    """`480G` rather than `491520M` where it divides, so an admin reads the header at a glance."""
    return f"{megabytes // 1024}{giga}" if megabytes % 1024 == 0 else f"{megabytes}{mega}"


def hms(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
