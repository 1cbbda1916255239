"""Before submitting: what the login node can check of the job's files, so a typo in a path is
refused now rather than after hours in the queue (`jobgen validate` and `jobgen submit`).

- Paths are resolved as the nodes resolve them: relative to `environment.workdir`, else to the
  directory jobgen runs in (the submit directory).
- Each file of `training.data` and `training.eval_data` must read as the trainer reads it, in
  `training.data_format`, with the trainer's own code (jobgen.job.conversations); every bad
  record of every file is listed, one line each, up to MAX_PROBLEMS in all (the rest are
  counted), where the trainer stops at the first. A JSON or JSONL file of up to
  CHECK_WHOLE_BYTES is checked whole (under a second here); of a bigger one, only the records in
  its first CHECK_WHOLE_BYTES characters, and a warning says so: a multi-GB file must not hold
  the login node for minutes. Parquet files and saved `datasets` folders are checked whole, a
  record batch at a time.
- `training.model`, when the trainer takes it for a local folder (jobgen.train.modeling's rule),
  must be a folder with config.json, and that config (or a hub name's, in this machine's Hugging
  Face cache) must be one the job can load (jobgen.job.model_config: its model type, its own code
  and training.trust_remote_code, a pre-quantized checkpoint and the packages it needs). A hub
  name that is not complete in the cache the nodes use (jobgen.job.hub_cache) is a warning:
  nodes with internet download it, others cannot. One not staged there is asked of the hub where
  this machine reaches it (jobgen.job.hub_api, one short request): a name or revision it does not
  have is refused, and its config is checked as a cached one; where the hub cannot be asked, the
  warning says what was not checked.
- `training.chat_template`, when it names a Jinja file, must exist.
- A record with tools (calls, results, definitions) is refused where the job trains in ChatML,
  which cannot write them: `training.chat_template: chatml`, or the default with a model whose
  tokenizer has no chat template (jobgen.job.model_config.has_chat_template), as the trainer
  would refuse it at its start.
- A path whose top-level folder this machine lacks (/scratch mounted on the nodes only), or in a
  folder it may not look into, is not checked: a warning, never a refusal.
- `launch.entrypoint: jobgen-probe` uses neither path, so nothing is checked.

Nothing here imports torch or transformers: jobgen.train.data and .modeling import them lazily.
"""

from __future__ import annotations

import os
from typing import Optional

from jobgen.errors import JobgenError
from jobgen.job.models import Job

CHECK_WHOLE_BYTES = 32 << 20
CLOSEST_AMONG = 1000  # names in a folder compared for "did you mean"; a huge folder is not listed


def check_job_files(job: Job) -> list[str]:
    """Warnings for what could not be checked from here; JobgenError, one line per path, for a
    path that is wrong."""
    if job.launch.entrypoint == "jobgen-probe" or job.training is None:
        return []  # no model, no data of jobgen's to check
    base = working_directory(job)
    warnings: list[str] = []
    checks = (_check_data(job, base, warnings), _check_model(job, base, warnings), _check_chat_template(job, base, warnings),
              _check_eval_data(job, base, warnings))
    errors = [error for error in checks if error]
    if errors:
        raise JobgenError("\n".join(errors))
    return warnings


def working_directory(job: Job) -> str:
    """Where the nodes run the job, as seen from here (submit.run_dir_for uses the same base)."""
    return os.path.abspath(job.environment.workdir or os.getcwd())


def _check_data(job: Job, base: str, warnings: list[str], field: str = "training.data") -> Optional[str]:
    """Every file of training.data (or eval_data) read as the trainer reads it; the bad records of
    all of them listed together, up to MAX_PROBLEMS."""
    from jobgen.job.conversations import MAX_PROBLEMS, more_problems_line
    from jobgen.job.sources import data_paths

    lines: list[str] = []
    listed = more = 0
    tool_record = ""
    records, counted = 0, True  # good records of every file, while each was read whole
    given_paths = data_paths(getattr(job.training, field.split(".")[1]))
    paths = [os.path.abspath(os.path.join(base, given)) for given in given_paths]
    for given, path in zip(given_paths, paths):
        error, warning = _where_missing(field, path, "file")
        if warning:
            warnings.append(warning)
        if error:
            lines.append(error + _hub_dataset_hint(given, field))
        if error or warning:
            counted = False
            continue
        check = _check_records(job, field, path, max(MAX_PROBLEMS - listed, 0), warnings)
        if isinstance(check, str):
            lines.append(check)
        elif check is not None:
            lines += check.problems
            listed += len(check.problems)
            more += check.more_problems
            tool_record = tool_record or check.tool_record
            records += check.good
            counted = counted and not _read_in_part(path)
        else:
            counted = False
    if more:
        lines.append(more_problems_line(paths[0] if len(paths) == 1 else field, listed, more))
    if field == "training.data" and counted and not lines:
        warnings += _fewer_records_than_a_batch(job, records)
    if tool_record and not lines:  # every record reads: can the job's layout write their tools?
        return _tools_in_chatml(job, base, tool_record)
    return "\n".join(lines) or None


def _read_in_part(path: str) -> bool:
    """Whether _check_records read only the first CHECK_WHOLE_BYTES of the file (its count is a floor)."""
    return os.path.isfile(path) and os.path.getsize(path) > CHECK_WHOLE_BYTES and not path.endswith(".parquet")


def _fewer_records_than_a_batch(job: Job, records: int) -> list[str]:
    """A global batch bigger than the data: every epoch is one optimizer step (a 12-epoch run of
    40 records at a batch of 64 trains 12 steps), which validate's numbers alone do not show.
    Texts (data_format: text) are cut into pieces of max_length when tokenized: not counted here."""
    t = job.training
    batch = job.global_batch
    if t.data_format == "text" or not records or records >= batch:
        return []
    if t.global_batch_size:
        made_of, lower = "training.global_batch_size", "training.global_batch_size"
    else:
        made_of = (f"training.per_device_batch_size {t.per_device_batch_size} x world size {job.world_size} x "
                   f"training.gradient_accumulation {t.gradient_accumulation}")
        lower = "training.per_device_batch_size or training.gradient_accumulation"
    held_out = f", fewer still after training.eval_fraction {t.eval_fraction:g}" if t.eval_fraction else ""
    steps = (f"training.max_steps {t.max_steps}: as many passes over the data" if t.max_steps
             else f"{t.epochs} step(s) in all for training.epochs {t.epochs}")
    return [f"training.data has {records} records{held_out}, fewer than one global batch of {batch} ({made_of}): "
            f"every optimizer step is a whole epoch ({steps}); lower {lower}, or add data"]


def _hub_dataset_hint(given: str, field: str) -> str:
    """For a missing path written like a hub dataset name (org/name): how to turn it into files."""
    from jobgen.job.model_reference import HUB_NAME

    if not HUB_NAME.match(given) or os.path.splitext(given)[1] in (".json", ".jsonl", ".parquet"):
        return ""
    local = given.split("/")[1]
    return (f"; if {given!r} is a Hugging Face Hub dataset, jobgen reads files, not hub names: download it "
            f"(hf download {given} --repo-type dataset --local-dir {local}) and list the .parquet or .jsonl "
            f"files of the split to use in {field}")


def _tools_in_chatml(job: Job, base: str, record: str) -> Optional[str]:
    """The trainer's refusal of a record with tools in ChatML, said before the queue where the
    files tell that the job trains in ChatML: set so, or the default with a model (a local folder,
    or a hub name in this machine's cache) whose tokenizer has no chat template. A template that
    drops tools shows only when rendered, at `jobgen data` or the trainer's start."""
    from jobgen.job.conversations import no_tools_in
    from jobgen.job.hub_cache import job_cache
    from jobgen.job.model_config import has_chat_template

    setting = job.training.chat_template
    if setting == "chatml":
        return no_tools_in("ChatML (training.chat_template is chatml)", record)
    model = os.path.join(base, job.training.model)
    cache = job_cache(job.environment.variables)
    if setting is None and has_chat_template(model if os.path.isdir(model) else job.training.model,
                                             job.training.model_revision, cache) is False:
        return no_tools_in(f"ChatML (the tokenizer of {job.training.model} has no chat template)", record)
    return None


def _check_records(job: Job, field: str, path: str, max_problems: int, warnings: list[str]):
    """check_conversations of one file (a DataCheck), its one-line error, or None when not checked."""
    from jobgen.errors import UserError
    from jobgen.job.conversations import check_conversations

    if not os.path.isfile(path) and not os.path.isdir(path):
        # A pipe or a device (/dev/stdin) could block or never end here.
        warnings.append(f"{field}: {path!r} is not a regular file; not checked")
        return None
    try:
        if os.path.isfile(path) and os.path.getsize(path) > CHECK_WHOLE_BYTES and not path.endswith(".parquet"):
            check = check_conversations(path, job.training.data_format, CHECK_WHOLE_BYTES, max_problems)
            warnings.append(
                f"{field}: {path!r} is {_size(os.path.getsize(path))}; only its first {check.records} records "
                f"(its first {_size(CHECK_WHOLE_BYTES)}) were checked here; the trainer checks them all"
            )
        else:  # Parquet and Arrow are read a record batch at a time: checked whole
            check = check_conversations(path, job.training.data_format, max_problems=max_problems)
    except UserError as error:
        return str(error)
    return check


def _check_model(job: Job, base: str, warnings: list[str]) -> Optional[str]:
    from jobgen.errors import UserError
    from jobgen.job.model_reference import HUB_NAME, check_model_reference

    model = job.training.model
    path = os.path.abspath(os.path.join(base, model))
    # The trainer's rule (check_model_reference, run in the working directory): org/name is a hub
    # name unless it exists there or a folder there is named like its first part.
    if HUB_NAME.match(model) and not _exists(path) and not os.path.isdir(os.path.join(base, model.split("/")[0])):
        return _check_hub_model(job, warnings)
    also = "" if HUB_NAME.match(model) else " (and it is not a hub name like org/name)"
    error, warning = _where_missing("training.model", path, "folder", also)
    if warning:
        warnings.append(warning)
    if error or warning:
        return error
    try:
        check_model_reference(path)
    except UserError as error:
        return str(error)
    return _check_model_config(job, path)


def _check_model_config(job: Job, model: str) -> Optional[str]:
    """What its config.json says would stop it loading (jobgen.job.model_config)."""
    from jobgen.errors import UserError
    from jobgen.job.hub_cache import job_cache
    from jobgen.job.model_config import model_config_problems

    try:
        problems = model_config_problems(model, job.training.method, job.training.trust_remote_code,
                                         job.training.model_revision, job_cache(job.environment.variables),
                                         job.training.max_length)
    except UserError as error:
        return str(error)
    return "\n".join(problems) or None


def _check_eval_data(job: Job, base: str, warnings: list[str]) -> Optional[str]:
    if not job.training.eval_data:
        return None
    return _check_data(job, base, warnings, "training.eval_data")


def _check_chat_template(job: Job, base: str, warnings: list[str]) -> Optional[str]:
    template = job.training.chat_template
    if template in (None, "tokenizer", "chatml"):  # the names jobgen.train.chat_template reads
        return None
    path = os.path.abspath(os.path.join(base, template))
    error, warning = _where_missing("training.chat_template", path, "file", " (and it is not tokenizer or chatml)")
    if warning:
        warnings.append(warning)
    return error


def _check_hub_model(job: Job, warnings: list[str]) -> Optional[str]:
    """A hub model's config in the nodes' cache, where it is staged there. One the cache lacks is a
    warning (nodes with internet download it), and its name, revision and config are asked of the
    hub where this machine reaches it (jobgen.job.hub_api): a name or revision the hub does not
    have is refused, as a config that would not load; where the hub cannot be asked, the warning
    says what was not checked."""
    from jobgen.job.hub_api import ask_hub, hub_refusal, unreachable_words
    from jobgen.job.hub_cache import job_cache, look_up
    from jobgen.job.model_config import ModelConfig, check_model_config, native_model_types

    training = job.training
    cached = look_up(training.model, training.model_revision, job_cache(job.environment.variables))
    problem = cached.problem()
    if cached.staged:
        warnings += [problem] if problem else []
        return _check_model_config(job, training.model)  # its config in the nodes' cache
    answer = ask_hub(training.model, training.model_revision)
    if answer.unreachable:  # one line: what is missing, and what could not be checked for it
        warnings.append(f"{problem}; {unreachable_words(answer)}, so its name, revision and config (model type, "
                        "its own code and trust_remote_code) were not checked")
        return None
    warnings.append(problem)
    refusal = hub_refusal(answer)
    if refusal or answer.config is None:
        return refusal
    where = f"{answer.endpoint}/{training.model}/resolve/{answer.commit}/config.json"
    problems = check_model_config(ModelConfig(where, answer.config), training.model, training.method,
                                  training.trust_remote_code, native_model_types())
    return "\n".join(problems) or None


def _where_missing(field: str, path: str, kind: str, also: str = "") -> tuple[Optional[str], Optional[str]]:
    """(None, None) when absolute `path` exists here; (error, None) when it does not; (None,
    warning) when this machine cannot tell."""
    if "\0" in path:
        return f"{field}: {path!r} contains a NUL character", None
    if _exists(path):
        return None, None
    top = os.path.join(os.sep, path.split(os.sep)[1])
    if not _exists(top):
        return None, f"{field}: {path!r} is not visible from this machine; not checked"
    folder = os.path.dirname(path)
    while not _exists(folder):
        folder = os.path.dirname(folder)
    if not os.access(folder, os.R_OK | os.X_OK):
        return None, f"{field}: {path!r} cannot be checked from this machine (no permission to look in {folder}); not checked"
    missing = path[len(folder):].lstrip(os.sep).split(os.sep)[0]
    hint = _closest(folder, missing)
    if folder == os.path.dirname(path):
        return f"{field}: {kind} {path!r} does not exist{also}{hint}", None
    return f"{field}: {kind} {path!r} does not exist{also}: there is no {os.path.join(folder, missing)!r}{hint}", None


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except (OSError, ValueError):
        return False
    return True


def _closest(folder: str, name: str) -> str:
    import difflib  # only for a path that is wrong: off the start-up path
    from itertools import islice

    try:
        with os.scandir(folder) as entries:
            names = [entry.name for entry in islice(entries, CLOSEST_AMONG)]
    except OSError:
        return ""
    match = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return f" (did you mean {os.path.join(folder, match[0])!r}?)" if match else ""


def _size(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.0f} MiB"
