"""Rendering is a pure function of the job: models in, script text out, nothing submitted.

Every `{{ value }}` in a template is shell-quoted unless the template marks it `|raw`, so a user's
value can only ever be one word of data. Only text jobgen builds itself (header lines from
validated fields, macro output) and the user's `environment.setup` lines (shell by intent) are raw.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Sequence

import jinja2
import jinja2.runtime

from jobgen import __version__
from jobgen.job.dump import as_set_yaml, complete_yaml
from jobgen.job.layers import ResolvedJob
from jobgen.errors import JobgenError
from jobgen.script.checks import check_array_points, check_for_scheduler
from jobgen.job.models import Job
from jobgen.job.nccl import nccl_exports
from jobgen.resources import bundled_path
from jobgen.rundir.files import TEMPLATE_FILES
from jobgen.schedulers import get_scheduler
from jobgen.script.template_search import BUNDLED, TemplateFolder, search_path
from jobgen.job.textfile import file_not_utf8_message

JOB_YAML_END = "JOBGEN_JOB_YAML"
NODE_SCRIPT_END = "JOBGEN_NODE_SCRIPT"
NODE_SETUP_END = "JOBGEN_NODE_SETUP"


class Raw(str):
    """Text a template may print as it is."""


# Bash's reserved words: safe bare after `NAME=`, but ShellCheck (SC1010) and a reader take them for syntax.
RESERVED_WORDS = frozenset("if then else elif fi case esac for select while until do done in function time coproc".split())


def shell_quote(value: Any) -> str:
    if isinstance(value, Raw):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    return f"'{text}'" if text in RESERVED_WORDS else shlex.quote(text)


class _ShippedBlock(jinja2.runtime.BlockReference):
    """What `{{ super() }}` prints in an override: the parent block, jobgen's own script text, as
    it is. Through shell_quote the whole block would become one quoted word."""

    def __call__(self) -> Raw:
        return Raw(super().__call__())

    @property
    def super(self) -> Any:  # super.super(): the grandparent block, printed the same way
        return _shipped(super().super)


def resume_words(argument: str) -> Raw:
    """launch.resume_argument as shell words, each quoted, with {checkpoint} as the batch script's
    "$JOBGEN_RESUME_CHECKPOINT": `--resume_from_checkpoint "$JOBGEN_RESUME_CHECKPOINT"`."""
    words = []
    for word in shlex.split(argument):
        parts = word.split("{checkpoint}")
        words.append('"$JOBGEN_RESUME_CHECKPOINT"'.join(shlex.quote(part) if part else "" for part in parts))
    return Raw(" ".join(words))


def _shipped(reference: Any) -> Any:
    if isinstance(reference, jinja2.runtime.BlockReference):
        return _ShippedBlock(reference.name, reference._context, reference._stack, reference._depth)
    return reference  # Undefined: there is no parent block


class _Context(jinja2.runtime.Context):
    def super(self, name: str, current: Any) -> Any:
        return _shipped(super().super(name, current))


def as_comment(value: Any) -> Raw:
    """One comment line: control characters cannot end the comment early."""
    return Raw("".join(ch if ch.isprintable() else "?" for ch in str(value)))


def template_environment(folders: Sequence[TemplateFolder] = ()) -> jinja2.Environment:
    """Templates from `folders` (template_search.search_path()), first match wins; the bundled
    ones last, and as `bundled/NAME` always."""
    bundled = jinja2.FileSystemLoader(str(bundled_path("templates")))
    loaders: list[jinja2.BaseLoader] = [_OverrideLoader(str(folder.path)) for folder in folders if not folder.bundled]
    loaders += [bundled, jinja2.PrefixLoader({BUNDLED: bundled})]
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        # Compiled templates are reused across runs (a fifth of a cold render). Jinja keeps them
        # in a per-user directory with mode 0700 that it checks it owns, safe on a shared node.
        bytecode_cache=_bytecode_cache(),
        finalize=shell_quote,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        # Shell uses `${#array[@]}`: Jinja comments are {## ... ##} so that stays plain shell.
        comment_start_string="{##",
        comment_end_string="##}",
    )
    env.context_class = _Context
    env.filters["raw"] = Raw
    env.filters["resume_words"] = resume_words
    env.filters["comment"] = as_comment
    return env


class _OverrideLoader(jinja2.FileSystemLoader):
    """A folder of overrides: a file that is not UTF-8 is named with its first bad byte."""

    def get_source(self, environment: jinja2.Environment, template: str):
        try:
            return super().get_source(environment, template)
        except UnicodeDecodeError:
            path = Path(self.searchpath[0], *template.split("/"))
            raise JobgenError(f"{path}: {file_not_utf8_message(path)}") from None


def _bytecode_cache() -> Optional[jinja2.BytecodeCache]:
    try:
        return jinja2.FileSystemBytecodeCache()
    except (OSError, RuntimeError):
        return None  # no usable temporary directory: compile every time


def check_templates(folders: Sequence[TemplateFolder]) -> None:
    """Every template in `folders` parses (`validate`, which has no scheduler to render for):
    a syntax error is `FILE:LINE: what is wrong`."""
    env = template_environment(folders)
    for folder in folders:
        for path in sorted(folder.path.rglob("*.j2")):
            try:
                source = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise JobgenError(f"{path}: {file_not_utf8_message(path)}") from None
            try:
                env.parse(source, path.relative_to(folder.path).as_posix(), str(path))
            except jinja2.TemplateSyntaxError as error:
                raise JobgenError(f"{path}:{error.lineno}: {error.message}") from None


def job_yaml(job: Job) -> str:
    """The resolved job, every layer applied and every default spelled out (RUN_DIR/job.yaml as
    `jobgen submit` writes it); the script embeds the job as set (jobgen.job.dump.as_set_yaml)."""
    return complete_yaml(job)


def render(resolved: ResolvedJob, scheduler_name: str, template_dirs: Sequence[Path] = ()) -> str:
    """The batch script; `template_dirs` (`--template-dir`) come first on the template search path."""
    return _render(resolved, get_scheduler(scheduler_name), template_dirs, resolved.warnings)


def render_array(
    points: Sequence[ResolvedJob], max_running: Optional[int], scheduler_name: str, template_dirs: Sequence[Path] = ()
) -> str:
    """One script for a sweep's job array: task K runs `points[K]` in its run directory, with
    its own job. The points may differ in `training` only (and their run directories): the
    header, the environment and the launch are one for all."""
    scheduler = get_scheduler(scheduler_name)
    check_array_points([resolved.job for resolved in points], scheduler)
    warnings: list[str] = []
    for index, resolved in enumerate(points):
        for warning in resolved.warnings:
            shared_by_all = all(warning in other.warnings for other in points)
            text = warning if shared_by_all else f"task {index}: {warning}"
            if text not in warnings:
                warnings.append(text)
    sweep = {
        "points": [
            {"index": index, "run_dir": resolved.job.effective_run_dir, "job_yaml": Raw(as_set_yaml(resolved.job))}
            for index, resolved in enumerate(points)
        ],
        "max_running": max_running,
    }
    for point in sweep["points"]:
        _check_heredoc(point["job_yaml"], JOB_YAML_END)
    return _render(points[0], scheduler, template_dirs, warnings, sweep, (len(points), max_running))


def _render(
    resolved: ResolvedJob,
    scheduler: Any,
    template_dirs: Sequence[Path],
    warnings: list[str],
    sweep: Optional[dict[str, Any]] = None,
    array: Optional[tuple[int, Optional[int]]] = None,
) -> str:
    job = resolved.job
    launcher, directives = check_for_scheduler(job, scheduler, array)
    folders = search_path(template_dirs, resolved.site.template_dir, site_packages=bool(resolved.site.name))
    # A plug-in scheduler's own template: after every override, before the bundled templates.
    folders[-1:-1] = [TemplateFolder(f"scheduler {scheduler.name}", path) for path in scheduler.template_dirs()]
    env = template_environment(folders)
    nccl = nccl_exports(job)
    context = {
        "job": job,
        "version": __version__,
        **scheduler.template_variables(job),  # scheduler, scheduler_env, and what a scheduler adds
        "files": TEMPLATE_FILES,  # the run directory's file names (jobgen.rundir.files)
        "site": resolved.site.name,
        "directives": [Raw(line) for line in directives],
        "launcher": launcher,
        "nccl": {name: value for name, (value, _) in nccl.items()},
        "nccl_reasons": {name: reason for name, (_, reason) in nccl.items()},
        "job_yaml": Raw(as_set_yaml(job)),  # what the job sets: jobgen-train adds the defaults back
        "job_yaml_end": Raw(JOB_YAML_END),
        "node_script_end": Raw(NODE_SCRIPT_END),
        "node_setup_end": Raw(NODE_SETUP_END),
        "warnings": warnings + scheduler.warnings(job),
        "sweep": sweep,  # a sweep's job array: its points (index, run_dir, job_yaml) and max_running
    }
    # node.sh is jobgen's node setup, the same for every job, then the job's own part: the batch
    # script shows the job's part at its top and the setup below, with the rest of the machinery.
    node_setup = _render_template(env, "node_setup.sh.j2", context)
    node_script = _render_template(env, "node.sh.j2", context)
    context["node_setup"], context["node_script"] = Raw(node_setup), Raw(node_script)
    _check_heredoc(context["job_yaml"], JOB_YAML_END)
    _check_heredoc(node_setup, NODE_SETUP_END)
    _check_heredoc(node_script, NODE_SCRIPT_END)
    return _render_template(env, scheduler.template, context)


def _render_template(env: jinja2.Environment, name: str, context: dict[str, Any]) -> str:
    """A template's mistake (an override's, usually) is one line: `FILE:LINE: what is wrong`."""
    try:
        return env.get_template(name).render(context)
    except JobgenError:
        raise
    except jinja2.TemplateSyntaxError as error:
        raise JobgenError(f"{error.filename or error.name or name}:{error.lineno}: {error.message}") from None
    except jinja2.TemplateNotFound as error:
        where = _template_line(error.__traceback__) or name
        raise JobgenError(f"{where}: no template {error.name!r} on the template search path (jobgen templates list shows it)") from None
    except RecursionError:
        raise JobgenError(
            f"{name}: extends or includes itself, directly or through another template; "
            f"an override extends the shipped one as '{BUNDLED}/{name}'"
        ) from None
    except Exception as error:
        where = _template_line(error.__traceback__)
        if not isinstance(error, jinja2.TemplateError) and (where is None or where.startswith(str(bundled_path("templates")))):
            raise  # not a template's mistake but jobgen's own: keep the traceback
        raise JobgenError(f"{where or name}: {error}") from None


def _template_line(traceback: Optional[TracebackType]) -> Optional[str]:
    """`FILE:LINE` of the innermost template frame (Jinja marks its rewritten frames)."""
    where = None
    while traceback is not None:
        frame = traceback.tb_frame
        if "__jinja_exception__" in frame.f_globals:
            where = f"{frame.f_code.co_filename}:{traceback.tb_lineno}"
        traceback = traceback.tb_next
    return where


def _check_heredoc(text: str, terminator: str) -> None:
    # A line equal to the terminator would end the embedded file early and run the rest as shell.
    if terminator in text.splitlines():
        raise JobgenError(f"a value in the job contains the line '{terminator}', which jobgen reserves")
