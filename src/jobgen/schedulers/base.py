"""What every scheduler shares; each subclass says only how its header and node list differ."""

from __future__ import annotations

import shlex
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
    # What to write instead of an extra directive that repeats a generated option, by option key.
    option_fixes: ClassVar[dict[str, str]] = {}

    def directives(self, job: Job) -> list[str]:
        """Header lines, in order; the job's own extra directives of this flavour come last.

        An extra directive that sets an option jobgen generates is refused (JobgenError): the
        scheduler would honour one of the two, PBS Pro the first `-l select`, sbatch the last.
        """
        own = [f"{self.directive_prefix} {option}" for option in self.options(job)]
        extra = [line for line in job.extra_directives if self.directive_prefix and line.startswith(self.directive_prefix)]
        self._refuse_conflicts(own, extra)
        return own + extra

    def options(self, job: Job) -> list[str]:
        return []

    def option_keys(self, line: str) -> list[str]:
        """One key per option on a directive line, the same for every spelling of one option."""
        return []

    def conflict_fix(self, key: str) -> str:
        return self.option_fixes.get(key, "remove it: jobgen generates this option")

    def _refuse_conflicts(self, own: list[str], extra: list[str]) -> None:
        # Reversed, so a key set by two generated lines names the first, the one a reader sees first.
        generated = {key: line for line in reversed(own) for key in self.option_keys(line)}
        for line in extra:
            for key in self.option_keys(line):
                if key in generated:
                    raise JobgenError(
                        f"extra_directives: '{line}' conflicts with the generated '{generated[key]}'; "
                        f"{self.conflict_fix(key)}"
                    )

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


def directive_options(line: str) -> list[tuple[str, str]]:
    """(flag, value) for each option of one directive line, in the spellings a scheduler's command
    line takes: `--opt=value`, `--opt value`, `-Xvalue`, `-X value`; the value is "" for a flag."""
    try:
        words = shlex.split(line)[1:]
    except ValueError:  # an unbalanced quote: the scheduler will say so; split on spaces here
        words = line.split()[1:]
    options = []
    for index, word in enumerate(words):
        if not word.startswith("-") or word in ("-", "--"):
            continue  # a value, read with its option
        following = words[index + 1] if index + 1 < len(words) and not words[index + 1].startswith("-") else ""
        if word.startswith("--"):
            flag, has_value, value = word.partition("=")
            options.append((flag, value if has_value else following))
        else:
            options.append((word[:2], word[2:] or following))
    return options


def memory_text(megabytes: int, giga: str, mega: str) -> str:
    """`480G` rather than `491520M` where it divides, so an admin reads the header at a glance."""
    return f"{megabytes // 1024}{giga}" if megabytes % 1024 == 0 else f"{megabytes}{mega}"


def hms(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    return f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
