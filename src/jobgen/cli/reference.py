"""The documentation's references, generated from the code that defines them, so they cannot drift:
every job key (the pydantic models of jobgen.job.models: key, meaning, type, default, an example)
and every `jobgen` command and option (the click group, walked as `--help` reads it).

`scripts/docs` builds the site with mkdocs, which loads this file as a hook (mkdocs.yml): the pages
reference/job-keys.md and reference/commands.md are made at build time and exist only in the built
site. tests/test_docs_reference.py walks the same models and commands and checks both pages.
"""

from __future__ import annotations

import enum
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Union

import annotated_types
import click
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from jobgen.job.models import Job

JOB_KEYS_PAGE = "reference/job-keys.md"
COMMANDS_PAGE = "reference/commands.md"


@dataclass(frozen=True)
class JobKey:
    """One key of a job file, as the reference shows it."""

    key: str  # dotted, e.g. training.lora.r
    section: bool  # a mapping of further keys (resources, training.lora)
    description: str  # the field's description, or for a section its model's docstring
    type: str  # in words: "integer, 1 to 1024", "one of full, lora, qlora"
    default: str  # as YAML, or "required"
    example: Optional[str]  # a job file's lines setting this key; None for a section
    other_names: tuple[str, ...]  # other tools' names for it, which jobgen answers with this key


def section_model(annotation: Any) -> Optional[type[BaseModel]]:
    """The model a field holds (Training for Optional[Training]), or None for a value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in typing.get_args(annotation):
        found = section_model(argument)
        if found is not None:
            return found
    return None


def job_keys(model: type[BaseModel] = Job, prefix: str = "", aliases: Optional[dict[str, list[str]]] = None) -> list[JobKey]:
    """Every key of `model`, depth first in the model's own order: a section, then its keys."""
    aliases = other_names(model, prefix) if aliases is None else aliases
    found = []
    for name, field in model.model_fields.items():
        key = prefix + name
        inner = section_model(field.annotation)
        if inner is not None:
            found.append(JobKey(key, True, field.description or inspect.getdoc(inner) or "", type_words(field.annotation),
                                default_text(field), None, tuple(aliases.get(key, ()))))
            found.extend(job_keys(inner, key + ".", aliases))
        else:
            value = example_value(field)
            found.append(JobKey(key, False, field.description or "", type_words(field.annotation) + bounds_words(field),
                                default_text(field), None if value is None else example_yaml(key, value),
                                tuple(aliases.get(key, ()))))
    return found


def other_names(model: type[BaseModel], prefix: str) -> dict[str, list[str]]:
    """Other tools' names of the keys in and under `model`, by dotted key. A model's `other_names`
    point at its own fields (`lr`: learning_rate), at keys of its sections (`lora_r`: lora.r) or,
    where the first word is not its field, at a key from the top (`nnodes`: resources.nodes)."""
    found: dict[str, list[str]] = {}
    for other, target in getattr(model, "other_names", {}).items():
        full = prefix + target if target.split(".")[0] in model.model_fields else target
        if other not in found.setdefault(full, []):
            found[full].append(other)
    for name, field in model.model_fields.items():
        inner = section_model(field.annotation)
        if inner is not None:
            for key, names in other_names(inner, prefix + name + ".").items():
                found.setdefault(key, []).extend(n for n in names if n not in found[key])
    return found


def type_words(annotation: Any) -> str:
    """A field's type as a reader of a YAML file thinks of it."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_words(arguments[0])
    if origin in (Union, types.UnionType):
        choices = [a for a in arguments if a is not type(None)]
        words = " or ".join(type_words(a) for a in choices)
        return f"{words} or null" if len(choices) < len(arguments) else words
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in arguments) if len(arguments) > 1 else str(arguments[0])
    if origin is list:
        return f"list of {type_words(arguments[0])}"
    if origin is dict:
        return f"mapping of name to {type_words(arguments[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {bool: "true or false", int: "integer", float: "number", str: "text"}.get(annotation, str(annotation))


def bounds_words(field: FieldInfo) -> str:
    """The field's numeric bounds, e.g. ", 1 to 64" or ", above 0"."""
    low = high = None
    for item in field.metadata:
        if isinstance(item, annotated_types.Ge):
            low = f"{item.ge}"
        elif isinstance(item, annotated_types.Gt):
            low = f"above {item.gt}"
        elif isinstance(item, annotated_types.Le):
            high = f"{item.le}"
        elif isinstance(item, annotated_types.Lt):
            high = f"below {item.lt}"
    if low and high:
        return f", {low} to {high}" if not low.startswith("above") and not high.startswith("below") else f", {low}, {high}"
    if low:
        return f", {low}" if low.startswith("above") else f", at least {low}"
    if high:
        return f", {high}" if high.startswith("below") else f", at most {high}"
    return ""


def default_of(field: FieldInfo) -> Any:
    return field.default_factory() if field.default_factory is not None else field.default


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = default_of(field)
    if isinstance(value, BaseModel):
        return "its keys' defaults"
    return "unset (null)" if value is None else inline_yaml(value)


def example_value(field: FieldInfo) -> Any:
    """The field's own example (`examples=` in its Field), else its default where it says something,
    else the first of its choices; None where none of these gives one (the test names the field)."""
    if field.examples:
        return field.examples[0]
    value = None if field.is_required() else default_of(field)
    if value not in (None, [], {}):
        return value
    # The field's own choices, or an Optional's: not those inside a list (report_to's).
    union = typing.get_origin(field.annotation) in (Union, types.UnionType)
    for argument in [field.annotation, *(typing.get_args(field.annotation) if union else ())]:
        if typing.get_origin(argument) is Literal:
            return typing.get_args(argument)[0]
    return None


def inline_yaml(value: Any) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True).strip().removesuffix("\n...").removesuffix("...").strip()


def example_yaml(key: str, value: Any) -> str:
    """`value` at dotted `key`, as the lines of a job file: the sections in block style, the value
    in flow style (`variables: {HF_HOME: /shared/hf}`), as the README's examples write them."""
    parts = key.split(".")
    lines = [f"{'  ' * depth}{part}:" for depth, part in enumerate(parts[:-1])]
    lines.append(f"{'  ' * (len(parts) - 1)}{parts[-1]}: {inline_yaml(value)}")
    return "\n".join(lines) + "\n"


def markdown_text(text: str) -> str:
    """Plain text safe in Markdown: outside `code` spans, `*` and `_` at a word's edge would start
    emphasis and `<` an HTML tag, eating the text; inside them everything is literal already."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):
        parts[index] = re.sub(r"([*\\])", r"\\\1", parts[index]).replace("<", "&lt;")
        parts[index] = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])", r"\\_", parts[index])
    return "`".join(parts)


def job_keys_markdown() -> str:
    lines = [
        "# Job keys",
        "",
        "Every key a job file may have, generated from the job's models (`src/jobgen/job/models.py`) when",
        "the site is built. A key is written nested in YAML or dotted with `--set` (`--set training.lora.r=8`);",
        "`jobgen schema` prints the same as a JSON Schema for editors. Unknown keys are refused, and a name",
        "other tools use for a key (listed below as *other names*) is answered with the key.",
        "",
        "Values are layered: bundled defaults < site profile < job file < `--set`.",
        "",
    ]
    top = [k for k in job_keys() if "." not in k.key and not k.section]
    lines += ["## Top-level keys", ""]
    for key in top:
        lines += key_markdown(key)
    for key in job_keys():
        if key.section:
            lines += [f"## `{key.key}` {{ #{key.key} }}", "", markdown_text(key.description), ""]
            if key.default == "required":
                lines += ["Required.", ""]
        elif "." in key.key:
            lines += key_markdown(key)
    return "\n".join(lines) + "\n"


def key_markdown(key: JobKey) -> list[str]:
    lines = [f"### `{key.key}` {{ #{key.key} }}", "", markdown_text(key.description), ""]
    facts = [f"**Type:** {markdown_text(key.type)}", f"**Default:** `{key.default}`" if key.default not in ("required", "unset (null)") else f"**Default:** {key.default}"]
    if key.other_names:
        facts.append("**Other names:** " + ", ".join(f"`{name}`" for name in key.other_names))
    lines += [" · ".join(facts), ""]
    if key.example:
        lines += ["```yaml", key.example.rstrip("\n"), "```", ""]
    return lines


@dataclass(frozen=True)
class CommandDoc:
    """One `jobgen` command (or group), as its --help reads."""

    path: str  # "jobgen sites check"
    usage: str  # "jobgen sites check [OPTIONS] NAME"
    help: str
    params: tuple[tuple[str, str], ...]  # (the option's or argument's words, its help)
    subcommands: tuple[str, ...]


def commands(group: Optional[click.Command] = None) -> list[CommandDoc]:
    """Every command of the `jobgen` group and of its groups, in --help's order."""
    if group is None:
        from jobgen.cli.main import main as group
    # make_context, not Context(): it applies the group's context_settings (-h beside --help).
    return list(_walk(group, group.make_context("jobgen", [], resilient_parsing=True)))


def _walk(command: click.Command, ctx: click.Context) -> Iterator[CommandDoc]:
    names = command.list_commands(ctx) if isinstance(command, click.Group) else []
    params = []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if isinstance(param, click.Argument):  # click lists none of them under Options
            params.append((param.make_metavar(ctx), "argument" + ("" if param.required else ", optional")))
        else:
            params.append(param.get_help_record(ctx))
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    yield CommandDoc(ctx.command_path, usage, inspect.cleandoc(command.help or ""), tuple(params), tuple(names))
    for name in names:
        sub = command.get_command(ctx, name)
        if sub is not None and not sub.hidden:
            yield from _walk(sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True))


def help_markdown(text: str) -> list[str]:
    """A click docstring as Markdown: a paragraph click keeps as written (marked \\b) stays a block
    of text, the others are paragraphs."""
    lines = []
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        if paragraph.lstrip().startswith("\b"):
            body = inspect.cleandoc(paragraph.lstrip()[1:].strip("\n"))
            lines += ["```text", body, "```", ""]
        else:
            lines += [markdown_text(" ".join(paragraph.split())), ""]
    return lines


def commands_markdown() -> str:
    lines = [
        "# Commands",
        "",
        "Every `jobgen` command and option, generated from the command line's own definitions",
        "(`src/jobgen/cli/`) when the site is built: the same text as `jobgen COMMAND --help`.",
        "A command that refuses (the job or a file it names is wrong) prints one line per problem,",
        "`jobgen: error: ...`, and exits with status 2.",
        "",
    ]
    for doc in commands():
        depth = doc.path.count(" ")
        heading = "#" * min(2 + max(depth - 1, 0), 4)
        anchor = doc.path.replace(" ", "-")
        lines += [f"{heading} `{doc.path}` {{ #{anchor} }}" if depth else f"## `{doc.path}` {{ #{anchor} }}", ""]
        lines += ["```text", doc.usage, "```", ""]
        lines += help_markdown(doc.help)
        if doc.subcommands:
            lines += ["Commands: " + ", ".join(f"[`{name}`](#{anchor}-{name})" for name in doc.subcommands), ""]
        if doc.params:
            # A list, not a table: option words hold `|` ([slurm|pbs|torque|local]).
            lines += [f"- `{words}`: {markdown_text(text)}" for words, text in doc.params]
            lines += [""]
    return "\n".join(lines) + "\n"


# ---- the mkdocs hook (mkdocs.yml `hooks:` names this file) ----------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """Adds the generated reference pages to the site, in memory: nothing is written into docs/."""
    from mkdocs.structure.files import File

    # Through the package's own module: mkdocs loads this file under another name.
    from jobgen.cli import reference

    for page, make in ((JOB_KEYS_PAGE, reference.job_keys_markdown), (COMMANDS_PAGE, reference.commands_markdown)):
        files.append(File.generated(config, page, content=make()))
    return files
