"""Conversation data as a user gives it: read, and every item checked, without torch.

Input is a JSON array or JSONL of items `{"id": ..., "conversations": [{"from": ROLE, "value":
TEXT}, ...]}` with ROLE one of user, assistant, system (system only as the first turn). Every item
is checked before anything distributed starts (the trainer) or before the queue (`jobgen
validate`), and a problem is one line naming the file, the item index (and id) and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from jobgen.errors import UserError
from jobgen.job.textfile import file_not_utf8_message

ROLES = ("user", "assistant", "system")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


@dataclass(frozen=True)
class Conversation:
    id: str
    system: str
    turns: tuple[tuple[str, str], ...]  # (role, text), user/assistant only


def load_conversations(path: str) -> list[Conversation]:
    """Read and check every item; raises UserError naming the first problem found."""
    items = _parse(path, _read_text(path))
    if not items:
        raise UserError(f"{path}: no conversations in the file")
    return [_check_item(path, index, item) for index, item in enumerate(items)]


def check_conversations_head(path: str, max_chars: int) -> int:
    """load_conversations' checks on the items that begin and end in the first `max_chars`
    characters, for a file too big to read whole where it is checked; returns how many there were."""
    items = _parse_head(path, _read_text(path, max_chars))
    for index, item in enumerate(items):
        _check_item(path, index, item)
    return len(items)


def _read_text(path: str, max_chars: int = -1) -> str:
    if not os.path.exists(path):
        raise UserError(f"training.data: file {path!r} does not exist")
    if os.path.isdir(path):
        raise UserError(f"training.data: {path!r} is a directory; give a .json or .jsonl file")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read(max_chars)
    except UnicodeDecodeError:
        raise UserError(f"{path}: {file_not_utf8_message(path)}") from None
    except OSError as exc:
        raise UserError(f"training.data: cannot read {path!r}: {exc.strerror}") from None


def _parse(path: str, text: str) -> list[Any]:
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise _not_json(path, exc) from None
        return items
    items = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except (ValueError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else _reason(exc)
            raise UserError(f"{path}: line {lineno} is not valid JSON ({reason}); expected one object per line") from None
    return items


def _parse_head(path: str, text: str) -> list[Any]:
    """_parse on the start of a file, leaving out the item that the cut splits."""
    if not text.lstrip().startswith("["):
        return _parse(path, text[: text.rfind("\n") + 1])
    decoder = json.JSONDecoder()
    items: list[Any] = []
    position = text.index("[") + 1
    while True:
        position = _skip_json_space(text, position)
        if position == len(text) or text[position] == "]":
            return items
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            # An error within a few characters of the cut, or a string running into it, is the
            # cut itself; a real one there is left to the trainer, which reads the whole file.
            if len(text) - exc.pos <= 8 or exc.msg.startswith("Unterminated string"):
                return items
            raise _not_json(path, exc) from None
        except (ValueError, RecursionError) as exc:
            raise _not_json(path, exc) from None
        items.append(item)
        position = _skip_json_space(text, position)
        if position == len(text) or text[position] == "]":
            return items
        if text[position] != ",":
            raise _not_json(path, json.JSONDecodeError("Expecting ',' delimiter", text, position))
        position += 1


def _skip_json_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\n\r":
        position += 1
    return position


def _not_json(path: str, exc: Exception) -> UserError:
    if isinstance(exc, json.JSONDecodeError):
        return UserError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}")
    return UserError(f"{path}: not valid JSON: {_reason(exc)}")


def _reason(exc: Exception) -> str:
    # json raises RecursionError past ~1000 levels and ValueError for a number of over 4300 digits.
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]


def _check_item(path: str, index: int, item: Any) -> Conversation:
    where = f"{path}: item {index}"
    if not isinstance(item, dict):
        raise UserError(f"{where}: expected an object with 'conversations', got {type(item).__name__}")
    raw_id = item.get("id", str(index))
    if not isinstance(raw_id, (str, int)):
        raise UserError(f"{where}: 'id' must be a string or an integer, got {type(raw_id).__name__}")
    where = f"{path}: item {index} (id {str(raw_id)!r})"
    turns = item.get("conversations")
    if turns is None:
        raise UserError(f"{where}: missing field 'conversations'")
    if not isinstance(turns, list):
        raise UserError(f"{where}: 'conversations' must be a list, got {type(turns).__name__}")
    if not turns:
        raise UserError(f"{where}: 'conversations' is empty")
    system = DEFAULT_SYSTEM_PROMPT
    checked: list[tuple[str, str]] = []
    for position, turn in enumerate(turns):
        field = f"conversations[{position}]"
        if not isinstance(turn, dict):
            raise UserError(f"{where}: {field} must be an object with 'from' and 'value', got {type(turn).__name__}")
        role, value = turn.get("from"), turn.get("value")
        if role not in ROLES:
            raise UserError(f"{where}: {field}.from is {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(value, str):
            raise UserError(f"{where}: {field}.value must be a string, got {type(value).__name__}")
        if role == "system":
            if position != 0:
                raise UserError(f"{where}: {field} is a system turn; a system turn may only come first")
            system = value
            continue
        checked.append((role, value))
    if not any(role == "assistant" for role, _ in checked):
        raise UserError(f"{where}: no assistant turn, so nothing to learn from it")
    return Conversation(id=str(raw_id), system=system, turns=tuple(checked))
