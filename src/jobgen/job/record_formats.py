"""One record of each format read field by field: ShareGPT, OpenAI and Alpaca records as a system
prompt and (role, text) turns with their tool fields, a `text` record's text, a `pretokenized`
record's ids and labels. Every problem is a BadRecord whose message is the whole line, beginning
with `where` (the file and record). Which format a record is in, and what it becomes, is
jobgen.job.conversations'.
"""

from __future__ import annotations

import json
from typing import Any, Optional

IGNORE_INDEX = -100  # a label not learned, as transformers' loss reads it
# ShareGPT's `from` as its writers spell it (the original ShareGPT dumps, FastChat, LLaMA-Factory).
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# LLaMA-Factory's tool turns in ShareGPT: a call the assistant makes, and the tool's result.
SHAREGPT_TOOL_ROLES = {"function_call": "assistant", "observation": "tool"}
OPENAI_ROLES = ("system", "user", "assistant", "tool")
# Roles of tool results and calls in the formats' writers (OpenAI, LLaMA-Factory, Llama 3).
TOOL_ROLES = ("tool", "function", "function_call", "observation", "ipython")
LEGACY_FUNCTIONS = "the legacy OpenAI function-calling spelling; give 'tool_calls', 'tool' messages and 'tools' instead"


class BadRecord(Exception):
    """A check failed; the message is the whole line."""


Turns = list[tuple[str, str]]


def _list_field(where: str, record: dict, name: str) -> list:
    value = record[name]
    if not isinstance(value, list):
        raise BadRecord(f"{where}: '{name}' must be a list, got {type(value).__name__}")
    if not value:
        raise BadRecord(f"{where}: '{name}' is empty")
    return value


def _optional_text(where: str, record: dict, name: str) -> Optional[str]:
    value = record.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRecord(f"{where}: '{name}' must be a string, got {type(value).__name__}")
    return value


Fields = dict[int, dict]  # turn index -> the turn's tool fields


def tool_definitions(where: str, record: dict) -> str:
    """The record's `tools` as JSON text ("" for none). OpenAI's are a list of objects; LLaMA-Factory
    writes the JSON text of a list of bare functions, wrapped here as transformers documents them
    ({"type": "function", "function": ...})."""
    if record.get("functions"):
        raise BadRecord(f"{where}: 'functions' is {LEGACY_FUNCTIONS}")
    tools = record.get("tools")
    if tools is None or tools == "" or tools == []:
        return ""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except (ValueError, RecursionError):
            raise BadRecord(f"{where}: 'tools' is text that is not JSON; give a list of function definitions") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRecord(f"{where}: 'tools' must be a list of function definitions (objects), got {_short(tools)}")
    wrapped = [tool if "type" in tool else {"type": "function", "function": tool} for tool in tools]
    return json.dumps(wrapped) if wrapped else ""


def _tool_calls(where: str, name: str, calls: Any) -> list[dict]:
    """Checked tool calls, each {"type": "function", "function": {"name", "arguments": an object}}
    (and its `id` where given); arguments given as JSON text are parsed."""
    if not isinstance(calls, list) or not calls:
        raise BadRecord(f"{where}: {name} must be a non-empty list of tool calls, got {_short(calls)}")
    checked = []
    for position, call in enumerate(calls):
        here = f"{name}[{position}]"
        function = call.get("function", call) if isinstance(call, dict) else None  # LLaMA-Factory: bare
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRecord(f'{where}: {here} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}')
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise BadRecord(f"{where}: {here}: 'arguments' is text that is not JSON; give a JSON object") from None
        if not isinstance(arguments, dict):
            raise BadRecord(f"{where}: {here}: 'arguments' must be a JSON object, got {_short(arguments)}")
        out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            out["id"] = call["id"]
        checked.append(out)
    return checked


def sharegpt(where: str, record: dict) -> tuple[Optional[str], Turns, Fields]:
    turns = _list_field(where, record, "conversations")
    system = _optional_text(where, record, "system")
    checked: Turns = []
    fields: Fields = {}
    for position, turn in enumerate(turns):
        name = f"conversations[{position}]"
        if not isinstance(turn, dict):
            raise BadRecord(f"{where}: {name} must be an object with 'from' and 'value', got {type(turn).__name__}")
        if "from" not in turn and "role" in turn:
            raise BadRecord(
                f"{where}: {name} has 'role', as an OpenAI message; a ShareGPT turn has 'from' and 'value' "
                "(a list of OpenAI messages is named 'messages')"
            )
        role, value = turn.get("from"), turn.get("value")
        known = (*SHAREGPT_ROLES, *SHAREGPT_TOOL_ROLES)
        if not isinstance(role, str) or role not in known:
            raise BadRecord(f"{where}: {name}.from is {_short(role)}; expected one of {', '.join(known)}")
        if not isinstance(value, str):
            raise BadRecord(f"{where}: {name}.value must be a string, got {type(value).__name__}")
        if role == "function_call":  # the JSON of one call {"name", "arguments"}, or of a list of them
            try:
                calls = json.loads(value)
            except (ValueError, RecursionError):
                raise BadRecord(f'{where}: {name}.value is not JSON; a function_call turn is {{"name": ..., "arguments": ...}}') from None
            fields[len(checked)] = {"tool_calls": _tool_calls(where, f"{name}.value", calls if isinstance(calls, list) else [calls])}
            checked.append(("assistant", ""))
            continue
        role = SHAREGPT_TOOL_ROLES.get(role) or SHAREGPT_ROLES[role]
        if role == "system":
            if position != 0:
                raise BadRecord(f"{where}: {name} is a system turn; a system turn may only come first")
            if system is not None:
                raise BadRecord(f"{where}: {name} is a system turn, and the record has a 'system' field too; give one")
            system = value
            continue
        checked.append((role, value))
    return system, checked, fields


def openai(where: str, record: dict) -> tuple[Optional[str], Turns, tuple[int, ...], Fields]:
    messages = _list_field(where, record, "messages")
    system: Optional[str] = None
    checked: Turns = []
    unlearned: list[int] = []
    fields: Fields = {}
    for position, message in enumerate(messages):
        name = f"messages[{position}]"
        if not isinstance(message, dict):
            raise BadRecord(f"{where}: {name} must be an object with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message and "from" in message:
            raise BadRecord(
                f"{where}: {name} has 'from', as a ShareGPT turn; an OpenAI message has 'role' and 'content' "
                "(a list of ShareGPT turns is named 'conversations')"
            )
        if message.get("function_call"):
            raise BadRecord(f"{where}: {name} has 'function_call', {LEGACY_FUNCTIONS}")
        role, content = message.get("role"), message.get("content")
        if role == "function":
            raise BadRecord(f"{where}: {name}.role is 'function', {LEGACY_FUNCTIONS}")
        if not isinstance(role, str) or role not in OPENAI_ROLES:
            raise BadRecord(f"{where}: {name}.role is {_short(role)}; expected one of {', '.join(OPENAI_ROLES)}")
        if "weight" in message:
            weight = message["weight"]
            if weight not in (0, 1) or isinstance(weight, bool):
                raise BadRecord(f"{where}: {name}.weight is {_short(weight)}; expected 0 or 1")
            if role != "assistant":
                raise BadRecord(f"{where}: {name}.weight is given on a {role} message; only assistant messages are learned")
            if weight == 0:
                unlearned.append(len(checked))  # the index this message will have among the turns
        if message.get("tool_calls") not in (None, []):  # null or [] (as some exports write): no calls
            if role != "assistant":
                raise BadRecord(f"{where}: {name} has 'tool_calls' on a {role} message; only the assistant calls tools")
            fields[len(checked)] = {"tool_calls": _tool_calls(where, f"{name}.tool_calls", message["tool_calls"])}
            content = "" if content is None else content  # a message of calls alone has no content
        if role == "tool":
            fields[len(checked)] = _tool_result_fields(where, name, message)
        if isinstance(content, list):
            raise BadRecord(f"{where}: {name}.content is a list of content parts; give the text as one string")
        if not isinstance(content, str):
            raise BadRecord(f"{where}: {name}.content must be a string, got {type(content).__name__}")
        if role == "system":
            if position != 0:
                raise BadRecord(f"{where}: {name} is a system message; a system message may only come first")
            system = content
            continue
        checked.append((role, content))
    return system, checked, tuple(unlearned), {index: value for index, value in fields.items() if value}


def _tool_result_fields(where: str, name: str, message: dict) -> dict:
    """A tool message's `tool_call_id` and `name`, where it gives them (templates may write either)."""
    out = {}
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise BadRecord(f"{where}: {name}.{key} must be a string, got {type(message[key]).__name__}")
            out[key] = message[key]
    return out


def alpaca(where: str, record: dict) -> tuple[Optional[str], Turns]:
    instruction = record["instruction"]
    if not isinstance(instruction, str):
        raise BadRecord(f"{where}: 'instruction' must be a string, got {type(instruction).__name__}")
    if "output" not in record:
        raise BadRecord(f"{where}: missing field 'output' (an alpaca record has 'instruction', 'output' and optionally 'input')")
    output = record["output"]
    if not isinstance(output, str):
        raise BadRecord(f"{where}: 'output' must be a string, got {type(output).__name__}")
    extra = _optional_text(where, record, "input")
    system = _optional_text(where, record, "system")
    checked: Turns = []
    history = record.get("history")
    if history is not None:
        if not isinstance(history, list):
            raise BadRecord(f"{where}: 'history' must be a list of [instruction, output] pairs, got {type(history).__name__}")
        for position, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair)):
                raise BadRecord(f"{where}: history[{position}] must be a pair of strings [instruction, output]")
            checked += [("user", pair[0]), ("assistant", pair[1])]
    prompt = "\n\n".join(text for text in (instruction, extra) if text)
    checked += [("user", prompt), ("assistant", output)]
    return system, checked


def text(where: str, record: dict) -> str:
    text = record["text"]
    if not isinstance(text, str):
        raise BadRecord(f"{where}: 'text' must be a string, got {type(text).__name__}")
    if not text:
        raise BadRecord(f"{where}: 'text' is empty, so nothing to learn from it")
    return text


def _token_ids(where: str, record: dict, name: str, allowed: str) -> tuple[int, ...]:
    value = _list_field(where, record, name)
    for position, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or (token < 0 and not (name == "labels" and token == IGNORE_INDEX)):
            raise BadRecord(f"{where}: {name}[{position}] is {_short(token)}; expected {allowed}")
    return tuple(value)


def pretokenized(where: str, record: dict) -> tuple[tuple[int, ...], Optional[tuple[int, ...]]]:
    """input_ids, and labels if given: -100 (not learned) or the input id at that position (the
    model shifts them itself, as transformers' causal LMs do)."""
    ids = _token_ids(where, record, "input_ids", "a token id (an integer of at least 0)")
    if record.get("labels") is None:
        return ids, None
    labels = _token_ids(where, record, "labels", "-100 or the input id at that position")
    if len(labels) != len(ids):
        raise BadRecord(f"{where}: 'labels' has {len(labels)} entries and 'input_ids' {len(ids)}; give one label per input id")
    for position, (token, label) in enumerate(zip(ids, labels)):
        if label != IGNORE_INDEX and label != token:
            raise BadRecord(f"{where}: labels[{position}] is {label}, but input_ids[{position}] is {token}; a label is -100 "
                       "(not learned) or the input id itself (the model shifts labels; do not shift them)")
    if all(label == IGNORE_INDEX for label in labels):
        raise BadRecord(f"{where}: every label is -100, so nothing to learn from it")
    return ids, labels


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
