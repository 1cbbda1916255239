"""Training data as a user gives it: every record read and checked, without torch.

The files (`training.data`: one path or a list, read in order; JSON, JSONL, Parquet or a saved
`datasets` folder) are jobgen.job.sources'; here each record becomes a sample. A record is in one
of these formats (`training.data_format`, `auto` by default, detects it from the records' fields;
a name forces it):

    sharegpt      {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
                   "system": "optional"}   `from`: human or user, gpt or assistant, system
    openai        {"messages": [{"role": "system"|"user"|"assistant", "content": "...", "weight": 0|1}]}
    alpaca        {"instruction": "...", "input": "optional", "output": "...", "system": "optional"}
    text          {"text": "..."}   continued pre-training: every token learned
    pretokenized  {"input_ids": [...], "labels": [...] optional}   labels: -100 (not learned) or
                  the input id at that position (the model shifts them); without labels, all learned

The chat formats become a Conversation: the record's system prompt (None when it gives none: the
chat layout decides, and jobgen's ChatML writes DEFAULT_SYSTEM_PROMPT) and the user and assistant
turns in order. Alpaca's user turn is the instruction, a blank line and the
input (the instruction alone when the input is empty), as the Alpaca template joins them; its
assistant turn is the output (LLaMA-Factory's `history`, earlier [instruction, output] pairs,
comes first). `text` becomes a TextSample and `pretokenized` a TokenSample; how they become
tokens (a long text split, ids checked against the vocabulary) is jobgen.train.samples'. Each
format's fields are read in jobgen.job.record_formats.

Tools, as OpenAI's fine-tuning files and transformers' apply_chat_template(messages, tools=...)
take them: an OpenAI assistant message's `tool_calls` ([{"type": "function", "function": {"name",
"arguments"}}], the arguments a JSON object or its text), `tool` messages (a tool's result, with
optional `tool_call_id` and `name`) and the record's `tools` (the function definitions). ShareGPT
records take LLaMA-Factory's spelling: a `function_call` turn (its value the JSON of {"name",
"arguments"}, or a list of them) is an assistant turn of tool calls, an `observation` turn a tool
result, and `tools` the JSON text (or list) of the functions. Arguments given as JSON text are
parsed, as the published templates (Llama 3.1, Qwen 2.5) write them with `tojson`. Whether a chat
layout can write tools is jobgen.train.data's to say; OpenAI's legacy `function_call`/`functions`
spelling is refused, naming the current one.

Auto-detection: a record is in the format whose field it has (`conversations`, `messages`,
`instruction`, `text`, `input_ids`); a file is in the format of its first record that has exactly
one, each file on its own. A record with the fields of two formats, a record of another format
than its file's (one format per file) and a record with none are refused. Every problem is one
line naming the file, the record index in it (and id) and the field, and where the file's format
matters, which record it was detected from.

The trainer reads the files a chunk at a time and stops at the first problem (read_samples); the
login node's checks (`jobgen validate`, jobgen.job.preflight) list every bad record, up to a count
(check_conversations, file by file), of the whole file or, for a big JSON one, of the records in
its first part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from jobgen.errors import UserError
from jobgen.job import record_formats as read
from jobgen.job.record_formats import BadRecord
from jobgen.job.sources import CHUNK_RECORDS, TEXT_ENCODING, Chunk, Unreadable, data_paths, jsonl_chunks, not_json, read_chunks, source_kind
from jobgen.job.textfile import file_not_utf8_message

ROLES = ("user", "assistant", "tool", "system")  # what a Conversation holds: user, assistant and tool turns, a system prompt
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
FORMATS = ("sharegpt", "openai", "alpaca", "text", "pretokenized")  # training.data_format: these, or auto
CHAT_FORMATS = FORMATS[:3]  # those read as a Conversation, laid out by the chat template
# The field a record of each format has, by which it is detected.
FORMAT_FIELDS = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction", "text": "text",
                 "pretokenized": "input_ids"}
MAX_PROBLEMS = 20  # bad records `jobgen validate` lists one by one; the rest are counted


@dataclass(frozen=True)
class Conversation:
    id: str
    system: Optional[str]  # None: the record gives none
    turns: tuple[tuple[str, str], ...]  # (role, text): user, assistant, and tool (a tool's result)
    unlearned: tuple[int, ...] = ()  # indices into turns of assistant turns not learned (OpenAI weight 0)
    # Tools, kept as JSON text so that a Conversation stays hashable: the function definitions
    # ("" for none) and, by turn index, a turn's tool fields (an assistant turn's `tool_calls`, a
    # tool turn's `tool_call_id` and `name`).
    tools: str = ""
    tool_fields: tuple[tuple[int, str], ...] = ()

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools or self.tool_fields or any(role == "tool" for role, _ in self.turns))

    def tool_definitions(self) -> Optional[list]:
        """The `tools` argument of apply_chat_template: None where the record gives none."""
        return json.loads(self.tools) if self.tools else None

    def messages(self) -> list[dict]:
        """The conversation as the messages apply_chat_template takes (a system message only where
        the record gives one; `tool_calls` only on the turns that make calls, as Llama 3.1's
        template tests for the key)."""
        fields = {index: json.loads(text) for index, text in self.tool_fields}
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + [{"role": role, "content": text, **fields.get(index, {})}
                         for index, (role, text) in enumerate(self.turns)]


@dataclass(frozen=True)
class TextSample:
    """A `text` record: continued pre-training on the text (its tokens and EOS, all learned)."""

    id: str
    text: str


@dataclass(frozen=True)
class TokenSample:
    """A `pretokenized` record: the ids as given; labels None: every token is learned."""

    id: str
    input_ids: tuple[int, ...]
    labels: Optional[tuple[int, ...]] = None
    source: str = field(default="", compare=False)  # "FILE: record 3 (id 'x')", for an error found at tokenizing


Sample = Union[Conversation, TextSample, TokenSample]


@dataclass
class DataCheck:
    """What check_conversations found: the records read, the file's format and where it came from
    (`training.data_format` or the record it was detected from), and the problems, one line each."""

    records: int = 0
    good: int = 0  # records that read as conversations
    format: Optional[str] = None
    format_source: str = ""
    problems: list[str] = field(default_factory=list)  # the first `max_problems`
    more_problems: int = 0  # problems past those
    tool_record: str = ""  # the first record with tool calls, results or definitions, as "PATH: record N (id X)"

    @property
    def problem_count(self) -> int:
        return len(self.problems) + self.more_problems

    def problem_lines(self, path: str) -> list[str]:
        """The problems, and a last line counting those not listed."""
        if not self.more_problems:
            return list(self.problems)
        return self.problems + [more_problems_line(path, len(self.problems), self.more_problems)]


def more_problems_line(where: str, listed: int, more: int) -> str:
    """The last line of a list of bad records cut at MAX_PROBLEMS: how many were not listed."""
    return f"{where}: {more} more bad records ({listed + more} in all; the first {listed} are above)"


def read_samples(data: Union[str, Sequence[str]], data_format: str = "auto") -> Iterator[list[Sample]]:
    """The samples of every file of `data` in order, a chunk at a time (jobgen.job.sources: a
    JSONL, Parquet or Arrow file is never held whole); raises UserError naming the first problem
    found (the trainer). Each file's format is detected on its own."""
    paths = data_paths(data)
    for path in paths:
        any_record = False
        for fmt, chunk in _formatted_chunks(path, data_format):
            samples = []
            for index, record in chunk:
                any_record = True
                result = _read_record(path, index, record, fmt)
                if isinstance(result, Unreadable):
                    raise UserError(result.message)
                samples.append(result)
            yield samples
        if not any_record:
            raise UserError(f"{path}: no records in the file")


def load_conversations(data: Union[str, Sequence[str]], data_format: str = "auto") -> list[Sample]:
    """read_samples' samples in one list: for small data (an eval set, a test)."""
    return [sample for chunk in read_samples(data, data_format) for sample in chunk]


def check_conversations(
    path: str, data_format: str = "auto", max_chars: int = -1, max_problems: int = MAX_PROBLEMS
) -> DataCheck:
    """load_conversations' checks on one file, going on past a bad record to list every one (up to
    `max_problems`, the rest counted). With `max_chars`, only the records of a JSON or JSONL file
    that begin and end in its first `max_chars` characters are read, for a file too big to read
    whole where it is checked. A problem with the file itself (missing, not UTF-8, not a JSON
    array) is a UserError."""
    if max_chars >= 0 and source_kind(path) == "json":
        records = _parse_head(path, _read_text(path, max_chars))
        formatted = [(_file_format(records, data_format), list(enumerate(records)))]
    else:
        formatted = _formatted_chunks(path, data_format)
    check = DataCheck()
    for fmt, chunk in formatted:
        check.format, check.format_source = fmt.name, fmt.source
        for index, record in chunk:
            check.records += 1
            result = _read_record(path, index, record, fmt)
            if not isinstance(result, Unreadable):
                check.good += 1
                if not check.tool_record and isinstance(result, Conversation) and result.uses_tools:
                    check.tool_record = f"{path}: {_label(index, record)}"
            elif len(check.problems) < max_problems:
                check.problems.append(result.message)
            else:
                check.more_problems += 1
    if check.format is None and data_format != "auto":
        check.format, check.format_source = data_format, f"training.data_format is {data_format}"
    if not check.records and max_chars < 0:
        check.problems.append(f"{path}: no records in the file")
    return check


def check_conversations_head(path: str, max_chars: int, data_format: str = "auto") -> int:
    """load_conversations' checks on the records that begin and end in the first `max_chars`
    characters, for a file too big to read whole where it is checked; returns how many there were."""
    check = check_conversations(path, data_format, max_chars, max_problems=1)
    if check.problems:
        raise UserError(check.problems[0])
    return check.records


# --- reading the file -----------------------------------------------------------------------------


def _formatted_chunks(path: str, data_format: str) -> Iterator[tuple["_FileFormat", Chunk]]:
    """The chunks of `path` with the file's format. Chunks are held only until a record tells the
    format (the first, in a good file)."""
    if data_format != "auto":
        fmt = _file_format([], data_format)
        for chunk in read_chunks(path):
            yield fmt, chunk
        return
    held: list[Chunk] = []
    fmt: Optional[_FileFormat] = None
    seen = 0
    for chunk in read_chunks(path):
        if fmt is None:
            found = _file_format([record for _, record in chunk], "auto", seen)
            seen += len(chunk)
            held.append(chunk)
            if found.name is None:
                continue
            fmt = found
            for old in held:
                yield fmt, old
            held = []
        else:
            yield fmt, chunk
    for old in held:  # no record fits exactly one format
        yield _FileFormat(None, False, ""), old


def _read_text(path: str, max_chars: int = -1) -> str:
    source_kind(path)  # missing, or a folder: one line
    try:
        with open(path, encoding=TEXT_ENCODING) as handle:
            return handle.read(max_chars)
    except UnicodeDecodeError:
        raise UserError(f"{path}: {file_not_utf8_message(path)}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path!r}: {exc.strerror}") from None  # training.data or eval_data: the path says which


def _parse_head(path: str, text: str) -> list[Any]:
    """The records of the start of a file, leaving out the record that the cut splits."""
    if not text.lstrip().startswith("["):
        lines = text[: text.rfind("\n") + 1].splitlines(keepends=True)
        return [record for chunk in jsonl_chunks(path, lines, CHUNK_RECORDS) for _, record in chunk]
    decoder = json.JSONDecoder()
    records: list[Any] = []
    position = text.index("[") + 1
    while True:
        position = _skip_json_space(text, position)
        if position == len(text) or text[position] == "]":
            return records
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            # An error within a few characters of the cut, or a string running into it, is the
            # cut itself; a real one there is left to the trainer, which reads the whole file.
            if len(text) - exc.pos <= 8 or exc.msg.startswith("Unterminated string"):
                return records
            raise not_json(path, exc) from None
        except (ValueError, RecursionError) as exc:
            raise not_json(path, exc) from None
        records.append(record)
        position = _skip_json_space(text, position)
        if position == len(text) or text[position] == "]":
            return records
        if text[position] != ",":
            raise not_json(path, json.JSONDecodeError("Expecting ',' delimiter", text, position))
        position += 1


def _skip_json_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\n\r":
        position += 1
    return position


# --- the format: forced, or detected from the records ---------------------------------------------


@dataclass(frozen=True)
class _FileFormat:
    name: Optional[str]  # None: auto, and no record has the fields of exactly one format
    forced: bool
    source: str  # "training.data_format is openai", or "detected from record 3 (id 'x')"

    def said(self) -> str:
        """`the file is openai, detected from record 0 (id 'a')`, for the end of a message."""
        if self.forced:
            return self.source
        return f"the file is {self.name}, {self.source}"


def _file_format(records: list[Any], data_format: str, first: int = 0) -> _FileFormat:
    """The format of a file whose records `records` are, the first being record `first`."""
    if data_format != "auto":
        if data_format not in FORMATS:  # the job model allows only these; a direct caller may not
            raise UserError(f"training.data_format is {data_format!r}; expected auto or one of {', '.join(FORMATS)}")
        return _FileFormat(data_format, True, f"training.data_format is {data_format}")
    for index, record in enumerate(records, start=first):
        fits = _formats_of(record)
        if len(fits) == 1:
            return _FileFormat(fits[0], False, f"detected from {_label(index, record)}")
    return _FileFormat(None, False, "")


def _formats_of(record: Any) -> list[str]:
    if not isinstance(record, dict):
        return []
    return [name for name in FORMATS if FORMAT_FIELDS[name] in record]


def no_tools_in(template_name: str, where: str) -> str:
    """The one line refusing a conversation with tools in a layout that cannot write them (ChatML),
    said by validate (jobgen.job.preflight) and by the trainer (jobgen.train.data)."""
    return (
        f"training.chat_template: {where} has tool calls, results or definitions, and {template_name} has no way to "
        "write them; set training.chat_template: tokenizer for a model whose template renders tools (Llama 3.1, "
        "Qwen 2.5), or the path of a Jinja file that does"
    )


def _label(index: int, record: Any) -> str:
    """`record 3 (id 'x')`, or `record 3` for a record without a usable id."""
    raw_id = record.get("id") if isinstance(record, dict) else None
    if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool):
        return f"record {index} (id {str(raw_id)!r})"
    return f"record {index}"


def _fields_of(fits: list[str]) -> str:
    return " and ".join(f"'{FORMAT_FIELDS[name]}' ({name})" for name in fits)


def _keys_of(record: dict) -> str:
    if not record:
        return "; it has no fields"
    keys = [repr(key[:30]) for key in list(record)[:6]]
    return f"; it has {', '.join(keys)}{', ...' if len(record) > 6 else ''}"


EXPECTED_FIELDS = ("'conversations' (sharegpt), 'messages' (openai), 'instruction' and 'output' (alpaca), "
                   "'text' (text) or 'input_ids' (pretokenized)")


# --- one record -----------------------------------------------------------------------------------


def _read_record(path: str, index: int, record: Any, fmt: _FileFormat) -> Union[Sample, Unreadable]:
    if isinstance(record, Unreadable):
        return record
    try:
        return _check_record(path, index, record, fmt)
    except BadRecord as bad:
        return Unreadable(str(bad))


def _check_record(path: str, index: int, record: Any, fmt: _FileFormat) -> Sample:
    where = f"{path}: record {index}"
    if not isinstance(record, dict):
        expected = f"an object with '{FORMAT_FIELDS[fmt.name]}'" if fmt.name else f"an object with {EXPECTED_FIELDS}"
        said = f" ({fmt.said()})" if fmt.name else ""
        raise BadRecord(f"{where}: expected {expected}, got {type(record).__name__}{said}")
    raw_id = record.get("id", str(index))
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool):
        raise BadRecord(f"{where}: 'id' must be a string or an integer, got {type(raw_id).__name__}")
    where = f"{path}: {_label(index, record)}"
    kind = _kind_of(where, record, fmt)
    if kind == "text":
        return TextSample(id=str(raw_id), text=read.text(where, record))
    if kind == "pretokenized":
        return TokenSample(str(raw_id), *read.pretokenized(where, record), source=where)
    unlearned: tuple[int, ...] = ()
    tools, fields = "", {}
    if kind == "sharegpt":
        system, turns, fields = read.sharegpt(where, record)
        tools = read.tool_definitions(where, record)
    elif kind == "openai":
        system, turns, unlearned, fields = read.openai(where, record)
        tools = read.tool_definitions(where, record)
    else:
        system, turns = read.alpaca(where, record)
    if not any(role == "assistant" for role, _ in turns):
        raise BadRecord(f"{where}: no assistant turn, so nothing to learn from it")
    if all(role != "assistant" or index in unlearned for index, (role, _) in enumerate(turns)):
        raise BadRecord(f"{where}: every assistant message has weight 0, so nothing to learn from it")
    tool_fields = tuple((index, json.dumps(value)) for index, value in sorted(fields.items()))
    return Conversation(id=str(raw_id), system=system, turns=tuple(turns), unlearned=unlearned,
                        tools=tools, tool_fields=tool_fields)


def _kind_of(where: str, record: dict, fmt: _FileFormat) -> str:
    """The format to read `record` in: the forced one, else the one whose field it has, which must be
    the file's."""
    fits = _formats_of(record)
    if fmt.forced:
        if FORMAT_FIELDS[fmt.name] not in record:
            other = f"; it has {_fields_of(fits)}" if fits else _keys_of(record)
            raise BadRecord(f"{where}: missing field '{FORMAT_FIELDS[fmt.name]}' ({fmt.said()}){other}")
        return fmt.name
    if len(fits) > 1:
        raise BadRecord(
            f"{where}: has {_fields_of(fits)}, the fields of {len(fits)} formats; set training.data_format to say which to read"
        )
    if not fits:
        if fmt.name is None:
            raise BadRecord(f"{where}: fits no format: expected {EXPECTED_FIELDS}{_keys_of(record)}")
        raise BadRecord(f"{where}: missing field '{FORMAT_FIELDS[fmt.name]}' ({fmt.said()}); it fits no format{_keys_of(record)}")
    if fits[0] != fmt.name:
        raise BadRecord(
            f"{where}: field '{FORMAT_FIELDS[fits[0]]}' is the {fits[0]} format, but {fmt.said()}; "
            "one format per file"
        )
    return fits[0]
