"""`jobgen init`: a first job file, commented, from a few answers (or flags) and a recipe."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Optional

import click

from jobgen.cli.options import SchedulerName
from jobgen.errors import JobgenError

METHODS = ("full", "lora", "qlora")
# What changes with the method (a recipe's value is kept only while its method is kept).
METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {"learning_rate": 1.0e-5, "zero_stage": 2},
    "lora": {"learning_rate": 2.0e-4, "zero_stage": 2, "lora": {"r": 16, "alpha": 32, "dropout": 0.05}},
    "qlora": {"learning_rate": 2.0e-4, "zero_stage": 2, "gradient_checkpointing": True,
              "lora": {"r": 64, "alpha": 16, "dropout": 0.1}},
}
METHOD_KEYS = ("learning_rate", "zero_stage", "lora", "gradient_checkpointing")
PER_DEVICE_BATCH = 4
GLOBAL_BATCH = 64  # the low end of the usual 64-256 for LoRA (validate warns outside it)

# Why each written line is there, where the field's own description does not say it.
WHY = {
    "name": "the scheduler's job name and the run directory, runs/NAME",
    "resources.nodes": "machines; torchrun starts once on each",
    "resources.gpus_per_node": "one training process per GPU; 0 trains on CPUs with gloo",
    "resources.time_limit": "the job checkpoints before it and requeues itself to go on",
    "launch.procs_per_node": "processes per node when there are no GPUs to count",
    "training.model": "a hub name (fetched once by `jobgen prepare`) or a local folder",
    "training.data": "ShareGPT, OpenAI messages or Alpaca records (JSON, JSONL, Parquet)",
    "training.method": "full | lora | qlora (4-bit base weights, LoRA on top)",
    "training.zero_stage": "2 shards optimizer state; 3 also shards weights (full fine-tunes too big for one GPU)",
    "training.precision": "bf16 on A100/H100-class GPUs; fp32 on CPUs",
    "training.per_device_batch_size": "lower it first if a GPU runs out of memory",
    "training.gradient_accumulation": "chosen so the global batch (per-device x processes x this) is about 64",
    "training.learning_rate": "LoRA trains at 1e-4 to 3e-4; a full fine-tune wants about 1e-5",
    "training.epochs": "passes over the data",
    "training.max_length": "tokens per sample; longer samples are cut",
    "training.lora": "adapter rank and scale (alpha / r) on every attention and MLP projection",
    "training.gradient_checkpointing": "recomputes activations in the backward pass: less memory, ~30% slower",
    "training.save_interval": "steps between checkpoints; a preempted job resumes from the last",
    "resources.partition": "the Slurm partition or PBS queue",
    "resources.account": "charged for the job's node-hours",
    "requeue.max_restarts": "restarts after a failure or preemption, at most (continuations at the time limit that progressed are free)",
}


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=Path("job.yaml"),
              show_default=True, help="The job file to write.")
@click.option("--recipe", metavar="NAME", help="Start from configs/recipes/NAME.yaml, e.g. qwen2.5-7b-lora (see --list-recipes).")
@click.option("--list-recipes", is_flag=True, help="List the recipes and exit.")
@click.option("--model", metavar="NAME_OR_PATH", help="Hub name or local folder, e.g. Qwen/Qwen2.5-7B-Instruct.")
@click.option("--data", metavar="PATH", help="The training data, e.g. data/conversations.jsonl.")
@click.option("--method", type=click.Choice(METHODS), help="full, lora or qlora (default lora).")
@click.option("--nodes", type=click.IntRange(min=1), help="Nodes (default 1).")
@click.option("--gpus-per-node", type=click.IntRange(min=0, max=64), help="GPUs per node, 0 for CPUs (default 8).")
@click.option("--partition", metavar="NAME", help="Slurm partition or PBS queue (default: the scheduler's own).")
@click.option("--account", metavar="NAME", help="The account the job is charged to (default: none given).")
@click.option("--time-limit", metavar="[D-]HH:MM:SS", help="Each segment's wall time (default 08:00:00); the job "
              "checkpoints before it and goes on in a continuation.")
@click.option("--name", metavar="NAME", help="The job's name (default: the model's, with the method).")
@click.option("--scheduler", "-s", type=SchedulerName(), help="The scheduler it is for; checked now and named in the file's first lines.")
@click.option("--site", metavar="NAME", help="A site profile (its defaults and limits apply), instead of --scheduler.")
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
def init(output: Path, recipe: Optional[str], list_recipes: bool, model: Optional[str], data: Optional[str],
         method: Optional[str], nodes: Optional[int], gpus_per_node: Optional[int], partition: Optional[str],
         account: Optional[str], time_limit: Optional[str], name: Optional[str], scheduler: Optional[str],
         site: Optional[str], force: bool) -> None:
    """Write a first job file, commented, that `jobgen validate` passes.

    \b
    Asks for what no option gives, in this order: model, data, method, nodes, GPUs per node,
    scheduler, partition, account, time limit. On a terminal it asks; from a pipe or a file it
    takes one answer a line (an empty line: the default); with nothing on stdin (CI) it asks
    nothing: --model and --data are then needed, unless a --recipe gives them, and the rest defaults.
      jobgen init                                   # asks
      printf 'Qwen/Qwen2.5-7B-Instruct\ndata/chat.jsonl\n' | jobgen init -s slurm
      jobgen init --recipe qwen2.5-7b-lora --data data/chat.jsonl -s slurm --partition gpu --time-limit 12:00:00
      jobgen init --model Qwen/Qwen2.5-7B-Instruct --data data/chat.jsonl --method lora --nodes 2 --gpus-per-node 8 -s slurm
    """
    if list_recipes:
        for path in _recipes():
            click.echo(f"{path.stem:24} {_first_comment(path)}")
        return
    if output.exists() and not force:
        raise JobgenError(f"{output} exists: give --force to replace it, or -o to write another file")
    if output.is_dir() or (output.parent != Path("") and not output.parent.is_dir()):
        raise JobgenError(f"-o {output}: {'is a folder' if output.is_dir() else f'there is no folder {output.parent}'}; "
                          "give a file path, e.g. -o job.yaml")
    start = _read_recipe(recipe) if recipe else {}
    ask = Answers()
    training = start.get("training", {})
    resources = start.get("resources", {})
    answers = {
        "model": ask(model, "--model", "Model (hub name or local folder)", training.get("model")),
        "data": ask(data, "--data", "Training data (JSON, JSONL or Parquet file)", training.get("data")),
        "method": ask(method, "--method", "Method", training.get("method", "lora"), click.Choice(METHODS)),
        "nodes": ask(nodes, "--nodes", "Nodes", resources.get("nodes", 1), click.IntRange(min=1)),
        "gpus_per_node": ask(gpus_per_node, "--gpus-per-node", "GPUs per node (0: CPUs)",
                             resources.get("gpus_per_node", 8), click.IntRange(0, 64)),
    }
    from jobgen.job.sites import chosen_site, load_site

    site_scheduler = load_site(chosen_site(site)).scheduler
    if scheduler is None and not site_scheduler and ask.can_ask:
        from jobgen.schedulers import BUNDLED

        scheduler = ask(None, "--scheduler", "Scheduler", "slurm", click.Choice(sorted(BUNDLED))) or None
    answers["partition"] = ask(partition, "--partition", "Partition or queue (empty: the scheduler's default)",
                               resources.get("partition") or "") or None
    answers["account"] = ask(account, "--account", "Account to charge (empty: none)", resources.get("account") or "") or None
    answers["time_limit"] = ask(time_limit, "--time-limit", "Time limit of each segment ([D-]HH:MM:SS)",
                                resources.get("time_limit", "08:00:00"))
    values = job_values(start, answers, name)

    from jobgen.api import Job

    job = Job.from_values(values, site=site, source=str(output))
    if scheduler or site_scheduler:
        job.check_scheduler(scheduler or site_scheduler)
    # What validate and submit need on their command line: the scheduler, unless a site profile names it.
    how = f" --scheduler {scheduler}" if scheduler else f" --site {_shell_word(site)}" if site else \
        "" if site_scheduler else " --scheduler slurm|pbs|torque|local"
    text = job_text(values, recipe, how, str(output))
    from jobgen.files import write_atomic

    write_atomic(output, text)
    for warning in job.warnings:
        click.echo(f"jobgen: warning: {warning}", err=True)
    click.echo(f"jobgen: wrote {output}; next: jobgen validate{how} {_shell_word(str(output))}", err=True)
    data_path = Path(job.spec.environment.workdir or ".") / values["training"]["data"]
    if not data_path.exists():
        click.echo(f"jobgen: note: training.data {values['training']['data']} does not exist yet; validate reads it", err=True)


def job_values(start: dict[str, Any], answers: dict[str, Any], name: Optional[str]) -> dict[str, Any]:
    """The job: a recipe's values (or none), the answers over them, and what follows from the
    answers (the method's defaults, a batch whose global size is about GLOBAL_BATCH)."""
    values = json.loads(json.dumps(start))  # a deep copy of plain data
    training = values.setdefault("training", {})
    resources = values.setdefault("resources", {})
    method = answers["method"]
    if training.get("method") != method:  # the recipe's learning rate and adapters are for its method
        for key in METHOD_KEYS:
            training.pop(key, None)
    for key, value in METHOD_DEFAULTS[method].items():
        training.setdefault(key, value)
    training.update(model=answers["model"], data=answers["data"], method=method)
    resources.update(nodes=answers["nodes"], gpus_per_node=answers["gpus_per_node"])
    for key in ("partition", "account"):
        if answers.get(key):
            resources[key] = answers[key]
    resources["time_limit"] = answers.get("time_limit") or resources.get("time_limit", "08:00:00")
    processes_per_node = answers["gpus_per_node"]
    if processes_per_node == 0:  # CPUs: gloo, one process per node, and no bf16 kernels to count on
        processes_per_node = values.setdefault("launch", {}).setdefault("procs_per_node", 1)
        training["precision"] = "fp32"
        training.pop("gradient_checkpointing", None)
    else:
        training.setdefault("precision", "bf16")
    processes = answers["nodes"] * processes_per_node
    per_device = training.setdefault("per_device_batch_size", PER_DEVICE_BATCH)
    if "global_batch_size" not in training and _global_batch(training, processes) not in range(GLOBAL_BATCH, 257):
        training["gradient_accumulation"] = max(1, math.ceil(GLOBAL_BATCH / (per_device * processes)))
    for key, value in (("epochs", 1), ("max_length", 2048), ("save_interval", 100)):
        training.setdefault(key, value)
    values.setdefault("requeue", {}).setdefault("max_restarts", 5)
    kept = start.get("training", {})
    same_job = bool(start) and (kept.get("model"), kept.get("method")) == (answers["model"], method)
    values["name"] = name or (start["name"] if same_job and start.get("name") else _default_name(answers["model"], method))
    values["training"] = _ordered(training, TRAINING_ORDER)
    return _ordered(values, ["name", "resources", "launch", "environment", "training", "requeue"])


# What a reader looks for first in training: what is trained on what, then how.
TRAINING_ORDER = ["model", "data", "method", "zero_stage", "precision", "per_device_batch_size", "gradient_accumulation",
                  "learning_rate", "lr_schedule", "warmup_steps", "warmup_ratio", "epochs", "max_length",
                  "gradient_checkpointing", "lora", "save_interval"]


def _ordered(mapping: dict[str, Any], first: list[str]) -> dict[str, Any]:
    """`mapping` with the keys of `first` first, in that order; the others after, as they were."""
    rank = {key: index for index, key in enumerate(first)}
    return {key: mapping[key] for key in sorted(mapping, key=lambda key: rank.get(key, len(first)))}


def job_text(values: dict[str, Any], recipe: Optional[str], how: str, output: str) -> str:
    """The job as YAML, each line with why it is there: the fields jobgen init chose, the rest
    defaulted (`jobgen schema` lists every field). `how`: the options validate and submit need."""
    word = _shell_word(output)
    lines = [
        f"# Written by `jobgen init`{f' from the recipe {recipe}' if recipe else ''}. Every field not here takes its default:",
        "# `jobgen schema` lists them all; docs/guides/job-files.md says what each section does.",
        f"#   jobgen validate{how} {word}     # checks the job, its data and model; shows the global batch",
        f"#   jobgen submit{how} {word}       # then: jobgen status runs/{values['name']}",
    ]
    for section, content in values.items():
        if isinstance(content, dict):
            lines.append(f"{section}:")
            for key, value in content.items():
                lines.append(_line(f"  {key}: {_flow(value)}", WHY.get(f"{section}.{key}") or _description(section, key)))
        else:
            lines.append(_line(f"{section}: {_flow(content)}", WHY.get(section)))
    return "\n".join(lines) + "\n"


def _line(text: str, why: Optional[str]) -> str:
    return f"{text:38} # {why}" if why else text


def _description(section: str, key: str) -> Optional[str]:
    """The model field's own description, the reference's words (jobgen.job.models)."""
    import typing

    from jobgen.job.models import Job

    field = Job.model_fields.get(section)
    kinds = (typing.get_args(field.annotation) or (field.annotation,)) if field else ()
    fields = next((kind.model_fields for kind in kinds if hasattr(kind, "model_fields")), {})  # through Optional
    description = fields[key].description if key in fields else None
    return description.split("; ")[0] if description else None


def _flow(value: Any) -> str:
    """One YAML value on one line; text always quoted, so that `12:00:00` stays a time and `no` a word."""
    if isinstance(value, str):
        import yaml

        plain = re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_./+-]*", value) and yaml.safe_load(value) == value
        return value if plain else json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and 0 < abs(value) < 1e-2 and float(f"{value:.1e}") == value:
        mantissa, _, exponent = f"{value:.1e}".partition("e")
        return f"{mantissa}e-{exponent.lstrip('-0')}"  # 2.0e-4: YAML 1.1 reads a float only with its point
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_flow(item)}" for key, item in value.items()) + "}"
    raise TypeError(f"not a job file's value: {value!r}")


class Answers:
    """Where the answers no option gives come from: a terminal asks; a pipe or a file gives one a
    line, in the questions' order (an empty line, or its end: the default); anything else (CI's
    /dev/null, no stdin) gives none."""

    def __init__(self) -> None:
        self.terminal = sys.stdin is not None and sys.stdin.isatty()
        self.lines = not self.terminal and _stdin_is_a_pipe_or_file()
        self.can_ask = self.terminal or self.lines

    def __call__(self, given: Any, option: str, question: str, default: Any, kind: Any = None) -> Any:
        """An option's value; else an answer; else the recipe's or the default; else an error."""
        if given is not None:
            return given
        if self.terminal:
            return click.prompt(question, default=default, type=kind)
        line = sys.stdin.readline().strip() if self.lines else ""
        if line:
            try:
                return kind.convert(line, None, None) if kind is not None else line
            except click.BadParameter as error:
                raise JobgenError(f"{option}: the answer {line!r} read from stdin: {error.message}") from None
        if default is None:
            where = "stdin gave no answer for it" if self.lines else "stdin is not a terminal, so jobgen init asks nothing"
            raise JobgenError(f"{option} is needed: {where} (give {option}, or --recipe NAME; --list-recipes shows them)")
        return default


def _stdin_is_a_pipe_or_file() -> bool:
    import os
    import stat

    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # no stdin, or a stand-in without a descriptor
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


def _recipes() -> list[Path]:
    from jobgen.resources import bundled_path

    return sorted((bundled_path("configs") / "recipes").glob("*.yaml"))


def _read_recipe(name: str) -> dict[str, Any]:
    from jobgen.job.yamlfile import read_yaml_mapping

    found = {path.stem: path for path in _recipes()}
    if name not in found:
        import difflib

        close = difflib.get_close_matches(name, list(found), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise JobgenError(f"--recipe {name!r} is not a recipe{hint}; known: {', '.join(found)}")
    return read_yaml_mapping(found[name])


def _first_comment(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    return first.lstrip("# ").removeprefix("Recipe: ") if first.startswith("#") else ""


def _global_batch(training: dict[str, Any], processes: int) -> int:
    return training.get("per_device_batch_size", PER_DEVICE_BATCH) * processes * training.get("gradient_accumulation", 1)


# Folder names that say what a folder holds, not which model: the folder above names it (tiny/model).
GENERIC_FOLDERS = re.compile(r"^(model|models|weights|base|hf|final|merged|snapshot|(checkpoint|step)[-_]?\d*)$", re.I)


def _default_name(model: str, method: str) -> str:
    parts = [part for part in Path(model.rstrip("/")).parts if part not in ("/", ".", "..")]
    while len(parts) > 1 and GENERIC_FOLDERS.match(parts[-1]):
        parts.pop()
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", parts[-1] if parts else "").strip("-.").lower() or "job"
    return f"{base}-{method}"


def _shell_word(text: str) -> str:
    import shlex

    return shlex.quote(text)
