"""Errors meant for people: one line that names the field, the value and what would be accepted."""

from __future__ import annotations

from typing import Any, Iterable

from pydantic import BaseModel, ValidationError


class JobgenError(Exception):
    """A user's mistake or a refusal from the scheduler: printed as one line, exit status 2."""


class UserError(JobgenError):
    """A problem the user can fix by changing the job, the data or the command line, found by
    code that both the trainer and the login node's checks run (reading the data, the model
    reference): one line naming the file, item, field or value at fault. `jobgen-train` prints it
    as `jobgen-train: error: MESSAGE` and exits 2, never with a traceback."""


class InvalidJob(JobgenError):
    """A job the models refuse: one line per problem, each naming the field, the value and what
    would be accepted. `fields` holds the dotted name of each field at fault (`training.lora.r`;
    an empty string for a check across fields), in the order of the lines."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = tuple(fields)


def describe_validation_error(error: ValidationError, model: type[BaseModel], source: str) -> str:
    """All problems in a job, one line each, with the closest known key for unknown keys."""
    return describe_errors(error.errors(), model, source)


def describe_errors(items: Iterable[dict[str, Any]], model: type[BaseModel], source: str) -> str:
    """The same for some of a ValidationError's items (a site profile's defaults: not the missing fields)."""
    return "\n".join(_describe_one(item, model, source) for item in items)


def _describe_one(item: dict[str, Any], model: type[BaseModel], source: str) -> str:
    path = ".".join(str(part) for part in item["loc"])
    where = f"{source}: " if source else ""
    kind = item["type"]
    if kind == "extra_forbidden":
        here = _model_at(model, item["loc"][:-1])
        known = list(getattr(here, "model_fields", {}))
        word = str(item["loc"][-1])
        # A model's `other_names`: what other tools call its fields (`lr`), before spelling closeness.
        other = getattr(here, "other_names", {}).get(word)
        hint = f" (did you mean '{other}'?)" if other else _closest(word, known)
        choices = f"; known keys here: {', '.join(sorted(known))}" if known else ""
        return f"{where}unknown key '{path}'{hint}{choices}"
    if kind == "missing":
        return f"{where}'{path}' is required"
    value = _short(item.get("input"))
    message = item["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if kind == "literal_error":
        hint = _closest(str(item.get("input")), _literal_choices(item))
        return f"{where}'{path}' is {value}: {message}{hint}"
    if not path:  # a check across fields
        return f"{where}{message}"
    return f"{where}'{path}' is {value}: {message}"


def _model_at(model: type[BaseModel], loc: Iterable[Any]) -> Any:
    """The model class at `loc` (a section's), None where `loc` is not a section."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return None
        current = _section_type(field.annotation)
    return current


def _section_type(annotation: Any) -> Any:
    """The model an annotation names, seeing through Optional (a section a job may leave out)."""
    import typing

    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def _literal_choices(item: dict[str, Any]) -> list[str]:
    expected = item.get("ctx", {}).get("expected", "")
    return [part.strip(" '\"") for part in expected.replace(" or ", ", ").split(",") if part.strip()]


def _closest(word: str, candidates: Iterable[str]) -> str:
    import difflib  # only when a value is wrong: not on every command's start-up path

    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
