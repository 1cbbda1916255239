"""jobgen from Python: a job resolved once, then validated, rendered and submitted; a run followed.

    import jobgen
    job = jobgen.Job.load("job.yaml", site="none", overrides=["resources.nodes=4"])
    warnings = job.validate(scheduler="slurm")   # raises jobgen.InvalidJob, naming the field
    script = job.render(scheduler="slurm")       # the text `jobgen render` prints
    run = job.submit(scheduler="slurm")          # run.job_id, run.run_dir
    run.status()["segments"], run.cancel()

A `Job` is resolved when it is made (bundled defaults < site profile < the job's values <
overrides, then the site's limits and policy), and `validate`, `render` and `submit` all work on
that one resolution; the `jobgen validate|render|submit` commands are this module with a command
line around it. Sits above every part but the command line: it imports the job, the schedulers,
the script, the run directory and the trainer's login-node checks (never torch), and only when
asked (`jobgen.Job` loads this module on first use, so `import jobgen` stays cheap).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence, Union

from jobgen.errors import InvalidJob, JobgenError

if TYPE_CHECKING:
    from jobgen.job.layers import ResolvedJob
    from jobgen.job.models import Job as JobSpec
    from jobgen.job.sites import SiteProfile
    from jobgen.rundir.submission import Plan

__all__ = ["Job", "Run", "InvalidJob", "JobgenError", "RunFailed"]


class RunFailed(JobgenError):
    """`Run.wait` of a run that ended other than `completed`: its `state` (failed, restarts_exhausted,
    restart_storm, or a stop that is not requeued, such as a local run's interrupted) and its `run`."""

    def __init__(self, message: str, state: str, run: "Run") -> None:
        super().__init__(message)
        self.state, self.run = state, run

Overrides = Union[Iterable[str], Mapping[str, Any]]


class Job:
    """One job, resolved: its layers applied and checked against its site profile.

    Make one with `Job.load(path)` (a job file, as `jobgen` reads it) or `Job.from_values(mapping)`
    (the same keys as a job file); either raises `InvalidJob` (a `JobgenError`) whose message has
    one line per problem naming the field and what would be accepted, and whose `fields` lists
    the fields at fault. Relative paths in the job (training.data, a local model) are read
    against `environment.workdir`, else the current directory, as the command line reads them.
    """

    def __init__(self, resolved: "ResolvedJob", source: str) -> None:
        self._resolved = resolved
        self.source = source
        """Where the job came from, as its error lines begin: the job file's path, or `<values>`."""

    # ---- making one

    @classmethod
    def load(cls, path: Union[str, os.PathLike], *, site: Optional[str] = None, overrides: Overrides = ()) -> "Job":
        """The job file at `path`, as `jobgen validate|render|submit` read it.

        `site`: a site profile's name or .yaml file; None takes `site:` of the user's
        ~/.config/jobgen/config.yaml, and "none" uses no profile. `overrides`: what `--set`
        takes, `["resources.nodes=4"]`, or a mapping of dotted keys to Python values,
        `{"training.lora.r": 8}`; they are applied last, in order.
        """
        from jobgen.job.layers import resolve_job
        from jobgen.job.sites import chosen_site

        config = Path(path)
        return cls._checked(resolve_job(config, chosen_site(site), _assignments(overrides)), str(config))

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, site: Optional[str] = None, overrides: Overrides = (),
                    source: str = "<values>") -> "Job":
        """A job from Python values, with the keys a job file has:
        `{"name": "demo", "training": {"model": "...", "data": "data.jsonl"}}`. `site` and
        `overrides` as for `load`; `source` begins each error line."""
        from jobgen.job.layers import layer_values, validated
        from jobgen.job.sites import chosen_site, load_site

        if not isinstance(values, Mapping):
            raise InvalidJob(f"{source}: a job is a mapping of sections (resources:, training:, ...), not "
                             f"{type(values).__name__}")
        assignments = _assignments(overrides)
        site_profile = load_site(chosen_site(site))
        layered, replaced = layer_values(_plain(values), site_profile, source, assignments)
        resolved = validated(layered, site_profile, source, assignments)
        return cls._checked(replace(resolved, warnings=replaced + resolved.warnings), source)

    @classmethod
    def _checked(cls, resolved: "ResolvedJob", source: str) -> "Job":
        """The site's limits and policy on the resolved job (what `jobgen` checks before anything else)."""
        from jobgen.job.sites import check_limits, check_policy
        from jobgen.schedulers import get_scheduler

        word = "partition"
        if resolved.site.scheduler:
            try:
                word = get_scheduler(resolved.site.scheduler).partition_word
            except JobgenError as error:
                raise JobgenError(f"{resolved.site.path}: 'scheduler': {error}") from None
        check_limits(resolved.job, resolved.site, source, word)
        check_policy(resolved.job, resolved.site, source)
        return cls(resolved, source)

    # ---- what it is

    @property
    def spec(self) -> "JobSpec":
        """The typed job (`jobgen.job.models.Job`, a pydantic model): every field, defaults filled."""
        return self._resolved.job

    @property
    def site(self) -> "SiteProfile":
        """The site profile it was resolved with (an empty one for none)."""
        return self._resolved.site

    @property
    def resolved(self) -> "ResolvedJob":
        """The job and its site as the rendering and submission code take them."""
        return self._resolved

    @property
    def warnings(self) -> list[str]:
        """What resolving it found that runs but is probably not wanted (a global batch outside the
        usual range, a renamed run directory); `validate` returns these and more."""
        return list(self._resolved.warnings)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def run_dir(self) -> Path:
        """The run directory `submit` makes: run_dir (runs/NAME by default) under the working directory."""
        from jobgen.rundir.submission import run_dir_for

        return run_dir_for(self._resolved).path

    def scheduler(self, scheduler: Optional[str] = None) -> str:
        """`scheduler`, else the site profile's; InvalidJob when neither names one."""
        chosen = scheduler or self.site.scheduler
        if chosen:
            return chosen
        from jobgen.schedulers import scheduler_names

        raise InvalidJob(f"no scheduler: pass scheduler= ({'|'.join(scheduler_names())}), or use a site profile "
                         "that sets 'scheduler:'")

    def describe(self) -> str:
        """One line of what it derives: `2 node(s) x 8 process(es) = world size 16 (nccl); global batch
        128; 3 epoch(s) x 40 steps = 120 steps, warmup 4; lora, ZeRO-2, bf16`."""
        job = self.spec
        if job.training is None:
            what = f"runs its own program ({job.launch.command[0]} ...; launch.command)"
        else:
            what = (f"global batch {job.global_batch}; {planned_steps(job)}; {job.training.method}, "
                    f"ZeRO-{job.training.zero_stage}, {job.training.precision}")
        sizes = "-".join(str(w) for w in sorted({min(job.world_sizes), max(job.world_sizes)}))
        return f"{job.resources.nodes} node(s) x {job.procs_per_node} process(es) = world size {sizes} ({job.backend}); {what}"

    def describe_requeue(self) -> str:
        """One line of what ends a segment and what follows, as the batch script decides it."""
        requeue = self.spec.requeue
        if not requeue.enabled:
            return "requeue: off (requeue.enabled: false): a stopped job is not requeued; submit it again to resume"
        return (f"requeue: at SIG{requeue.signal} {requeue.warning_seconds} s before the time limit and on preemption, "
                f"at most {requeue.max_restarts} restart(s) counted (after a failure, a preemption or a time limit that "
                "saved nothing new; a continuation at the time limit that saved a newer checkpoint is not counted); "
                f"{requeue.max_restarts_without_progress} segments in a row without a newer checkpoint stop it")

    # ---- checks

    def validate(self, scheduler: Optional[str] = None, *, files: bool = True,
                 template_dirs: Sequence[Union[str, os.PathLike]] = ()) -> list[str]:
        """Everything `jobgen validate` checks; the warnings, resolving's first. Raises a
        `JobgenError` (`InvalidJob` for the job's own fields) naming what is wrong and the fix.

        `files`: read the data and model the job names, where this machine sees them (as `submit`
        does). `scheduler` (else the site profile's, else none): also run the checks `render` runs
        before its templates. `template_dirs`: template overrides to parse."""
        found = self.warnings
        if files:
            found += self.check_files()
        chosen = scheduler or self.site.scheduler
        if chosen:
            found += self.check_scheduler(chosen)
        self.check_templates(template_dirs)
        return found

    def check_files(self) -> list[str]:
        """The data file read as the trainer reads it (every bad record named), the model's folder or
        cache entry, the DeepSpeed config and training.init_from; the warnings."""
        return files_warnings(self.spec)

    def check_scheduler(self, scheduler: str) -> list[str]:
        """What `render` refuses on `scheduler` (the launcher, the container, the extra directives),
        and its warnings there."""
        from jobgen.schedulers import get_scheduler
        from jobgen.script.checks import check_for_scheduler

        chosen = get_scheduler(scheduler)
        check_for_scheduler(self.spec, chosen)
        return chosen.warnings(self.spec)

    def check_templates(self, template_dirs: Sequence[Union[str, os.PathLike]] = ()) -> None:
        """Every template override (`template_dirs`, $JOBGEN_TEMPLATE_PATH, the site's) parses."""
        from jobgen.script.template_search import override_folders

        folders = override_folders(tuple(Path(d) for d in template_dirs), self.site.template_dir)
        if folders:  # Jinja is imported only with overrides to check
            from jobgen.script.render import check_templates

            check_templates(folders)

    def render_warnings(self, scheduler: Optional[str] = None) -> list[str]:
        """What `jobgen render` warns of before the script: the scheduler's warnings, and the
        DeepSpeed config's findings where that file is here."""
        from jobgen.schedulers import get_scheduler

        return get_scheduler(self.scheduler(scheduler)).warnings(self.spec) + deepspeed_findings(self.spec)

    # ---- the script and the submission

    def render(self, scheduler: Optional[str] = None, *, template_dirs: Sequence[Union[str, os.PathLike]] = ()) -> str:
        """The batch script, exactly as `jobgen render` prints it. Reads no file of the job's: a
        script may be rendered for another machine."""
        from jobgen.script.render import render as render_script

        return render_script(self._resolved, self.scheduler(scheduler), tuple(Path(d) for d in template_dirs))

    def plan(self, scheduler: Optional[str] = None, *, template_dirs: Sequence[Union[str, os.PathLike]] = ()) -> "Plan":
        """What `submit` would do, doing nothing (`jobgen submit --dry-run`): `.run.path`, the
        run directory; `.script_path`, where the script would be written; `.script`, its text."""
        from jobgen.rundir import submission

        return submission.plan(self._resolved, self.scheduler(scheduler), tuple(Path(d) for d in template_dirs))

    def submit(self, scheduler: Optional[str] = None, *, template_dirs: Sequence[Union[str, os.PathLike]] = (),
               check_files: bool = True) -> "Run":
        """Submit it as `jobgen submit` does (the files checked first, unless `check_files` is
        False) and return its `Run`. On the `local` scheduler the job runs here, in the
        foreground: this returns once it has ended (`Run.status()` says how)."""
        from jobgen.rundir import submission

        chosen = self.scheduler(scheduler)
        if check_files:
            self.check_files()
        job_id, planned = submission.submit(self._resolved, chosen, tuple(Path(d) for d in template_dirs))
        return Run(job_id=job_id, run_dir=planned.run.path, scheduler=chosen)

    def __repr__(self) -> str:
        return f"<jobgen.Job {self.name!r} from {self.source}>"


@dataclass(frozen=True)
class Run:
    """A submitted job: its id, its run directory and its scheduler. `Run.open` finds one again."""

    job_id: str
    run_dir: Path
    scheduler: str

    @classmethod
    def open(cls, target: Union[str, os.PathLike]) -> "Run":
        """The run a run directory holds (its latest submission), or the job a job id names, as
        `jobgen status TARGET` finds it."""
        from jobgen.rundir.run import find_target

        run, named = find_target(str(target))
        entry = run.latest()
        if named:
            entry = next(s for s in reversed(run.submissions()) if s.get("job_id") == named)
        return cls(job_id=entry["job_id"], run_dir=run.path, scheduler=entry["scheduler"])

    def status(self) -> dict[str, Any]:
        """What `jobgen status --json` prints: the scheduler's state now (`scheduler_state`, None for
        a job run in the foreground), every segment and how it ended, the last loss, the final model;
        and `state`, the run's as a whole, as `jobgen runs` says it (Run.run_state)."""
        from jobgen.rundir.status import collect

        return {**collect(str(self.run_dir)), "state": self.run_state()}

    @property
    def state(self) -> Optional[str]:
        """The scheduler's word for this job while it holds it (PENDING, RUNNING, R, Q, ...); once
        it does not (the job has ended, or ran in the foreground), the run's own word for how it
        ended (`completed`, `failed`, `preempted`, ...: Run.run_state); None where neither says."""
        from jobgen.schedulers import get_scheduler

        scheduler = get_scheduler(self.scheduler)
        found = None if scheduler.runs_in_foreground else scheduler.state(self.job_id)
        if found and found.state.upper() in scheduler.active_states:
            return found.state
        ended = self.run_state()
        return ended if ended not in ("gone", "not started", "submitted") else (found.state if found else None)

    def run_state(self) -> str:
        """The run's state as `jobgen runs` shows it: pending or running while its latest job is
        queued or running, then how its newest segment ended (completed, failed, restarts_exhausted,
        restart_storm for good; preempted, time_limit, ... where it waits to be requeued)."""
        from jobgen.rundir.index import describe

        return describe({"run_dir": str(self.run_dir), "job_id": self.job_id, "scheduler": self.scheduler})["state"]

    def wait(self, timeout: Optional[float] = None, poll_seconds: float = 10.0, check: bool = True) -> str:
        """Wait until the run has ended for good (no job of it queued or running, and none to come:
        a requeue or a continuation keeps it waiting) and return how (Run.run_state). Raises
        RunFailed when that is not `completed` (unless `check` is False), JobgenError after `timeout`
        seconds. The scheduler is asked once per `poll_seconds`."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.run_state()
            if state not in ("pending", "running", "submitted"):
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise JobgenError(f"job {self.job_id} ({self.run_dir}) is still {state} after {timeout:g} s")
            time.sleep(poll_seconds if deadline is None else max(0.0, min(poll_seconds, deadline - time.monotonic())))
        if check and state != "completed":
            raise RunFailed(f"job {self.job_id} ({self.run_dir}) ended {state}: `jobgen status {self.run_dir}` says why",
                            state, self)
        return state

    def cancel(self) -> bool:
        """Cancel the job (scancel, qdel; a local job checkpoints first); False, doing nothing, when
        it has already ended."""
        from jobgen.schedulers import get_scheduler

        scheduler = get_scheduler(self.scheduler)
        try:
            found = scheduler.state(self.job_id)
        except JobgenError:  # cannot be asked: the cancel command says what it finds
            scheduler.cancel(self.job_id)
            return True
        if found is None or found.state.upper() not in scheduler.active_states:
            return False
        scheduler.cancel(self.job_id)
        return True


def planned_steps(job: "JobSpec") -> str:
    """The run's optimizer steps (and warmup), as the trainer will count them: `3 epochs x 40 steps
    = 120 steps, warmup 4`. Packed rows are only known once tokenized."""
    import math

    from jobgen.job.conversations import check_conversations
    from jobgen.job.preflight import CHECK_WHOLE_BYTES, working_directory
    from jobgen.job.sources import data_paths

    t = job.training
    if t.max_steps is not None:
        total, how = t.max_steps, f"{t.max_steps} steps (max_steps)"
    else:
        paths = [os.path.join(working_directory(job), path) for path in data_paths(t.data)]
        path = paths[0]
        # Packed rows, and the pieces of long texts, are counted by tokenizing; a big file is not read here.
        if (t.packing or t.data_format == "text" or len(paths) > 1 or not os.path.isfile(path)
                or os.path.getsize(path) > CHECK_WHOLE_BYTES):
            return f"{t.epochs} epoch(s) (steps known once the data is tokenized)"
        per_epoch = math.ceil(check_conversations(path, t.data_format).good / job.global_batch)
        total, how = per_epoch * t.epochs, f"{t.epochs} epoch(s) x {per_epoch} steps = {per_epoch * t.epochs} steps"
    warmup = t.warmup_of(total)
    return how + (f", warmup {warmup}" if warmup else "")


def files_warnings(job: "JobSpec") -> list[str]:
    """`Job.check_files` of a typed job (a sweep's point is one)."""
    from jobgen.job.preflight import check_job_files, working_directory
    from jobgen.rundir.model_pin import at_its_pin
    from jobgen.train.dsconfig import check_job_deepspeed
    from jobgen.train.init_from import check_job as check_init_from

    job = at_its_pin(job)  # a resubmitted run loads the commit it started with
    warnings = check_job_files(job)
    if job.launch.entrypoint != "jobgen-probe" and job.training is not None:
        warnings += check_job_deepspeed(job, working_directory(job))
        warnings += check_init_from(job, working_directory(job))
    return warnings


def deepspeed_findings(job: "JobSpec") -> list[str]:
    """render's reading of training.deepspeed_config, where that file is here: what validate
    would refuse, and its notices, as warnings (render checks no other file: a script may be
    rendered for another machine, but a DeepSpeed JSON the trainer refuses is the same anywhere)."""
    from jobgen.errors import UserError
    from jobgen.job.preflight import working_directory
    from jobgen.rundir.model_pin import at_its_pin
    from jobgen.train.dsconfig import check_job_deepspeed

    path = job.training.deepspeed_config if job.training is not None else None
    if not path or job.launch.entrypoint == "jobgen-probe" or not os.path.isfile(os.path.join(working_directory(job), path)):
        return []
    try:
        return check_job_deepspeed(at_its_pin(job), working_directory(job))
    except UserError as error:
        return str(error).splitlines()


def _assignments(overrides: Overrides) -> tuple[str, ...]:
    """`--set` texts: given so, or made from a mapping of dotted keys to values. JSON is YAML, so a
    value reads back as the same value (a string stays a string: "12:00:00" is not a number)."""
    if isinstance(overrides, str):
        raise InvalidJob(f"overrides: give a list of KEY=VALUE texts or a mapping, not the one text {overrides!r}")
    if isinstance(overrides, Mapping):
        texts = []
        for key, value in overrides.items():
            try:
                texts.append(f"{key}={json.dumps(_plain(value))}")
            except (TypeError, ValueError):
                raise InvalidJob(f"overrides[{key!r}]: {type(value).__name__} is not a job file's value "
                                 "(give text, a number, true/false, a list or a mapping)", fields=(str(key),)) from None
        return tuple(texts)
    return tuple(overrides)


def _plain(value: Any) -> Any:
    """Python values as a YAML file would give them: paths as text, tuples as lists."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value
