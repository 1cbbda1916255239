"""What every scheduler shares; each subclass says only what differs.

A scheduler is this class's subclass in one module plus one template: everything jobgen knows
about it is there (directive prefix and header options, the environment variables its jobs read,
the states that mean "still queued or running", the launchers it can use, submit, state, cancel).
Bundled and plug-in schedulers are the same kind of thing (see jobgen.schedulers).
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.schedulers.state import JobState


@dataclass(frozen=True)
class JobEnvironment:
    """The names of the environment variables a running job learns its facts from; the
    scheduler's template reads them (`scheduler_env.job_id`, ...) instead of spelling them."""

    job_id: str
    # The scheduler's count of this job's restarts, or jobgen's own where it keeps none.
    restart_count: str = "JOBGEN_RESTART_COUNT"
    submit_dir: Optional[str] = None  # where the job was submitted from: its default working directory
    nodes: Optional[str] = None  # the node list, or the file that lists the nodes
    # A job array's: the task's index (a sweep's point) and the array's own job id.
    array_task_id: Optional[str] = None
    array_job_id: Optional[str] = None


class Scheduler:
    name: ClassVar[str]
    template: ClassVar[str]
    # Per-node launchers this scheduler can use; the first is the default.
    launchers: ClassVar[tuple[str, ...]]
    directive_prefix: ClassVar[str] = ""
    # What resources.partition is called in messages about it (PBS: a queue).
    partition_word: ClassVar[str] = "partition"
    # What to write instead of an extra directive that repeats a generated option, by option key.
    option_fixes: ClassVar[dict[str, str]] = {}
    job_environment: ClassVar[JobEnvironment]
    # Variables the scheduler sets in every job: a job's environment.variables may not set them.
    reserved_prefixes: ClassVar[tuple[str, ...]] = ()
    # `state().state` words (upper case) of a job still queued or running: a second submission
    # into its run directory is refused meanwhile.
    active_states: ClassVar[frozenset[str]] = frozenset()
    # True where the job runs here, in the foreground: `submit` starts it in a session of its own
    # and leaves it in `self.process` (a Popen whose stdout is a pipe), which the caller shows
    # until it ends, passing on any stop it is sent as SIGINT. The run directory is then the
    # record of its segments, `state` says only whether it still lives, and the command's exit
    # status is the job's.
    runs_in_foreground: ClassVar[bool] = False

    def template_dirs(self) -> list[Path]:
        """Folders searched for `template` before the bundled ones: none for a bundled
        scheduler, the folder of its module for a plug-in. A plug-in may return another."""
        if type(self).__module__.startswith("jobgen.schedulers."):
            return []
        return [Path(sys.modules[type(self).__module__].__file__).resolve().parent]

    node_ranges = False  # whether resources.nodes may be MIN-MAX, the allocation deciding the count
    spare_nodes = False  # whether resources.spare_nodes may be set: its launch may run on a subset of the allocation

    def template_variables(self, job: Job) -> dict[str, Any]:
        """What the templates may read about the scheduler, beyond the job itself."""
        return {"scheduler": self.name, "scheduler_env": self.job_environment}

    def refuse_a_range(self, nodes: str) -> None:
        """resources.nodes MIN-MAX on a scheduler that takes one count: JobgenError. Also asked before
        the job is validated (jobgen.cli.options.load_job), so that the batch split over the range is
        not the first thing a user fixes for a scheduler that cannot run it."""
        if not self.node_ranges:
            raise JobgenError(
                f"resources.nodes: {self.name} cannot take a range ({nodes}); give one count, "
                f"such as {nodes.split('-')[0].strip()} (ranges are Slurm's --nodes=MIN-MAX)"
            )

    def directives(self, job: Job, array: Optional[tuple[int, Optional[int]]] = None) -> list[str]:
        """Header lines, in order; the job's own extra directives of this flavour come last (the
        other schedulers' are left out: jobgen.schedulers.refuse_unknown_directives checks them).
        `array`: (tasks, most running at once) for a sweep's job array (`array_options`).

        An extra directive that sets an option jobgen generates is refused (JobgenError): the
        scheduler would honour one of the two, PBS Pro the first `-l select`, sbatch the last.
        """
        self.refuse_reserved_variables(job)
        if job.resources.min_nodes != job.resources.max_nodes:
            self.refuse_a_range(str(job.resources.nodes))
        if job.resources.spare_nodes and not self.spare_nodes:
            raise JobgenError(
                f"resources.spare_nodes: {self.name} jobs cannot keep spare nodes (Slurm, PBS Pro and Torque jobs "
                f"can); drop spare_nodes to run it here"
            )
        options = self.options(job) if array is None else self.array_options(self.options(job), *array)
        own = [f"{self.directive_prefix} {option}" for option in options]
        extra = [line for line in job.extra_directives if self.is_own_directive(line)]
        self._refuse_conflicts(own, extra)
        return own + extra

    def is_own_directive(self, line: str) -> bool:
        return bool(self.directive_prefix) and line.split(maxsplit=1)[0] == self.directive_prefix

    def refuse_reserved_variables(self, job: Job) -> None:
        for name in [*job.environment.variables, *job.environment.secrets]:
            if name.startswith(self.reserved_prefixes):
                field = "variables" if name in job.environment.variables else "secrets"
                raise JobgenError(
                    f"environment.{field}: '{name}' is set by {self.name} in every job and cannot be overridden; "
                    f"rename it (names starting {' or '.join(self.reserved_prefixes)} are {self.name}'s)"
                )

    def options(self, job: Job) -> list[str]:
        return []

    # Whether a sweep's points run as one job array (`array_options`); else as one job per point.
    job_arrays: ClassVar[bool] = False

    def array_options(self, options: list[str], tasks: int, max_running: Optional[int]) -> list[str]:
        """`options` for a job array of `tasks` tasks, at most `max_running` at once."""
        raise JobgenError(f"{self.name} runs a sweep as one job per point, not as a job array")

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

    def submit(self, job: Job, script: Path, run_dir: Path) -> str:
        """Submits the rendered script, unchanged, and returns the job id."""
        raise NotImplementedError

    def state(self, job_id: str) -> Optional[JobState]:
        """What the scheduler says now; None when it no longer knows the job."""
        raise NotImplementedError

    def cancel(self, job_id: str) -> None:
        raise NotImplementedError

    @staticmethod
    def job_name(job: Job) -> str:
        # Schedulers restrict names (PBS: no spaces, 236 chars); the full name stays in the header.
        return job.written_name[:64]


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
