"""The data formats a job accepts (jobgen.job.conversations): ShareGPT, OpenAI messages and Alpaca,
in JSON and JSONL, detected from the items or forced by `training.data_format`; each read into the
same Conversation as its ShareGPT twin. A file of mixed formats, a record of two formats or of none,
and every bad record is one line naming the file, the record and the field; `jobgen validate` lists
them all (up to a count), the trainer's reader stops at the first."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from jobgen.errors import UserError
from jobgen.job.conversations import (
    CHAT_FORMATS,
    EXPECTED_FIELDS,
    FORMATS,
    MAX_PROBLEMS,
    Conversation,
    TokenSample,
    check_conversations,
    check_conversations_head,
    load_conversations,
)
from jobgen.job.models import Training
from tests.helpers import jobgen

LEGACY = "the legacy OpenAI function-calling spelling; give 'tool_calls', 'tool' messages and 'tools' instead"

# The same three conversations in each format: a system prompt, a plain one, and two rounds.
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                  {"from": "gpt", "value": "Hello."}]},
    {"id": "b", "conversations": [{"from": "user", "value": "2+2?"}, {"from": "assistant", "value": "4"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Red."},
                                  {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Blue."}]},
]
OPENAI = [
    {"id": "a", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello."}]},
    {"id": "b", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"id": "c", "messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
                             {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue."}]},
]
ALPACA = [
    {"id": "a", "system": "Be brief.", "instruction": "Hi", "input": "", "output": "Hello."},
    {"id": "b", "instruction": "2+2?", "output": "4"},
    {"id": "c", "instruction": "Another?", "input": None, "output": "Blue.", "history": [["Name a colour.", "Red."]]},
]
EXPECTED = [
    Conversation("a", "Be brief.", (("user", "Hi"), ("assistant", "Hello."))),
    Conversation("b", None, (("user", "2+2?"), ("assistant", "4"))),
    Conversation("c", None, (("user", "Name a colour."), ("assistant", "Red."),
                                              ("user", "Another?"), ("assistant", "Blue."))),
]
ITEMS = {"sharegpt": SHAREGPT, "openai": OPENAI, "alpaca": ALPACA}


def write(folder: Path, items: list, name: str = "data.json") -> str:
    path = folder / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(item) + "\n" for item in items))
    else:
        path.write_text(json.dumps(items, indent=1))
    return str(path)


def problems(path: str, data_format: str = "auto", **options) -> list[str]:
    return check_conversations(path, data_format, **options).problem_lines(path)


def first_problem(path: str, data_format: str = "auto") -> str:
    with pytest.raises(UserError) as info:
        load_conversations(path, data_format)
    message = str(info.value)
    assert "\n" not in message and message.startswith(path)
    return message[len(path) + 2:]


def test_the_job_field_offers_exactly_the_formats_read() -> None:
    assert typing.get_args(Training.model_fields["data_format"].annotation) == ("auto", *FORMATS)
    assert Training(model="m", data="d").data_format == "auto"
    assert "detects it from the records" in Training.model_fields["data_format"].description


@pytest.mark.parametrize("name", ["data.json", "data.jsonl"])
@pytest.mark.parametrize("data_format", CHAT_FORMATS)
def test_each_format_reads_as_the_same_conversations_detected_or_forced(tmp_path: Path, data_format: str, name: str) -> None:
    path = write(tmp_path, ITEMS[data_format], name)
    assert load_conversations(path) == EXPECTED
    assert load_conversations(path, data_format) == EXPECTED
    check = check_conversations(path)
    assert (check.format, check.format_source, check.records, check.good) == (data_format, "detected from record 0 (id 'a')", 3, 3)
    assert check.problems == []
    assert check_conversations_head(path, 10**6) == 3
    # Every other format, forced, refuses each item, naming the field it lacks and the one it has.
    for other in set(FORMATS) - {data_format}:
        lines = problems(path, other)
        assert len(lines) == 3 and f"(training.data_format is {other}); it has '" in lines[0], lines


def test_alpaca_joins_instruction_and_input_with_a_blank_line(tmp_path: Path) -> None:
    items = [
        {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
        {"instruction": "Translate to French.", "input": "", "output": "Give me a word."},
        {"instruction": "", "input": "Only an input.", "output": "ok"},
        {"instruction": "Say hi.", "output": "", "system": "You are terse."},
    ]
    read = load_conversations(write(tmp_path, items, "alpaca.jsonl"))
    assert [c.turns for c in read] == [
        (("user", "Translate to French.\n\ncat"), ("assistant", "chat")),
        (("user", "Translate to French."), ("assistant", "Give me a word.")),
        (("user", "Only an input."), ("assistant", "ok")),
        (("user", "Say hi."), ("assistant", "")),
    ]
    assert [c.id for c in read] == ["0", "1", "2", "3"] and read[3].system == "You are terse."


def test_sharegpt_role_aliases_and_a_system_field(tmp_path: Path) -> None:
    item = {"system": "Top-level system.", "conversations": [
        {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "user", "value": "c"},
        {"from": "assistant", "value": "d"}]}
    [read] = load_conversations(write(tmp_path, [item]))
    assert read.system == "Top-level system."
    assert read.turns == (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"))


BAD = {
    "sharegpt": [
        ({"conversations": [{"from": "bot", "value": "x"}]},
         "conversations[0].from is 'bot'; expected one of human, user, gpt, assistant, system, function_call, observation"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}]},
         'conversations[1].value[0] must be {"type": "function", "function": {"name": ..., "arguments": ...}}'),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "f(1)"}]},
         'conversations[1].value is not JSON; a function_call turn is {"name": ..., "arguments": ...}'),
        ({"conversations": [{"role": "user", "content": "q"}]},
         "conversations[0] has 'role', as an OpenAI message; a ShareGPT turn has 'from' and 'value'"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": "[{name: f}]"},
         "'tools' is text that is not JSON; give a list of function definitions"),
        ({"system": "s", "conversations": [{"from": "system", "value": "t"}, {"from": "gpt", "value": "a"}]},
         "conversations[0] is a system turn, and the record has a 'system' field too; give one"),
        ({"system": 3, "conversations": [{"from": "gpt", "value": "a"}]}, "'system' must be a string, got int"),
        ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn, so nothing to learn from it"),
    ],
    "openai": [
        ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]}, "no assistant turn, so nothing to learn from it"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                          "tool_calls": [{"id": "1", "type": "function"}]}]},
         'messages[1].tool_calls[0] must be {"type": "function", "function": {"name": ..., "arguments": ...}}'),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{city: Paris}"}}]}]},
         "messages[1].tool_calls[0]: 'arguments' is text that is not JSON; give a JSON object"),
        ({"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages[0] has 'tool_calls' on a user message; only the assistant calls tools"),
        ({"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f"}}]}, f"messages[0] has 'function_call', {LEGACY}"),
        ({"messages": [{"role": "function", "content": "x"}]}, f"messages[0].role is 'function', {LEGACY}"),
        ({"messages": [{"role": "user", "content": "q"}], "functions": [{"name": "f"}]}, f"'functions' is {LEGACY}"),
        ({"messages": [{"role": "user", "content": "q"}], "tools": {"type": "function"}},
         "'tools' must be a list of function definitions (objects), got {'type': 'function'}"),
        ({"messages": [{"role": "human", "content": "q"}]}, "messages[0].role is 'human'; expected one of system, user, assistant, tool"),
        ({"messages": [{"from": "human", "value": "q"}]}, "messages[0] has 'from', as a ShareGPT turn; an OpenAI message has 'role' and 'content'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
         "messages[0].content is a list of content parts; give the text as one string"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content must be a string, got NoneType"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]},
         "messages[1] is a system message; a system message may only come first"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]},
         "every assistant message has weight 0, so nothing to learn from it"),
        ({"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]},
         "messages[0].weight is given on a user message; only assistant messages are learned"),
        ({"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}, "messages[0].weight is 0.5; expected 0 or 1"),
        ({"messages": []}, "'messages' is empty"),
        ({"messages": {"role": "user"}}, "'messages' must be a list, got dict"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, "no assistant turn"),
    ],
    "alpaca": [
        ({"instruction": "q"}, "missing field 'output' (an alpaca record has 'instruction', 'output' and optionally 'input')"),
        ({"instruction": ["q"], "output": "a"}, "'instruction' must be a string, got list"),
        ({"instruction": "q", "output": None}, "'output' must be a string, got NoneType"),
        ({"instruction": "q", "input": 5, "output": "a"}, "'input' must be a string, got int"),
        ({"instruction": "q", "output": "a", "history": [["only one"]]}, "history[0] must be a pair of strings [instruction, output]"),
        ({"instruction": "q", "output": "a", "history": "x"}, "'history' must be a list of [instruction, output] pairs, got str"),
    ],
}
BAD_CASES = [(data_format, item, message) for data_format, cases in BAD.items() for item, message in cases]


@pytest.mark.parametrize("data_format, item, message", BAD_CASES, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD_CASES)])
def test_a_bad_item_is_one_line_naming_file_item_and_field(tmp_path: Path, data_format: str, item: dict, message: str) -> None:
    path = write(tmp_path, [ITEMS[data_format][0], {"id": "bad", **item}])
    assert first_problem(path).startswith(f"record 1 (id 'bad'): {message}")
    assert first_problem(path, data_format).startswith(f"record 1 (id 'bad'): {message}")


def test_a_file_of_mixed_formats_names_the_record_and_where_the_format_was_detected(tmp_path: Path) -> None:
    path = write(tmp_path, [OPENAI[0], OPENAI[1], SHAREGPT[2], ALPACA[1]], "mixed.jsonl")
    assert problems(path) == [
        f"{path}: record 2 (id 'c'): field 'conversations' is the sharegpt format, but the file is openai, "
        "detected from record 0 (id 'a'); one format per file",
        f"{path}: record 3 (id 'b'): field 'instruction' is the alpaca format, but the file is openai, "
        "detected from record 0 (id 'a'); one format per file",
    ]
    # The format comes from the first item that has one: items before it are named against it too.
    path = write(tmp_path, [{"id": "p", "prompt": "q", "completion": "a"}, "text", ALPACA[0]], "none-first.json")
    assert problems(path) == [
        f"{path}: record 0 (id 'p'): missing field 'instruction' (the file is alpaca, detected from record 2 (id 'a')); "
        "it fits no format; it has 'id', 'prompt', 'completion'",
        f"{path}: record 1: expected an object with 'instruction', got str (the file is alpaca, detected from record 2 (id 'a'))",
    ]


def test_a_record_of_two_formats_or_of_none_is_one_line(tmp_path: Path) -> None:
    both = {"id": "x", **SHAREGPT[1], **OPENAI[1]}
    path = write(tmp_path, [both, {"prompt": "plain"}, {}])
    assert problems(path) == [
        f"{path}: record 0 (id 'b'): has 'conversations' (sharegpt) and 'messages' (openai), the fields of 2 formats; "
        "set training.data_format to say which to read",
        f"{path}: record 1: fits no format: expected {EXPECTED_FIELDS}; it has 'prompt'",
        f"{path}: record 2: fits no format: expected {EXPECTED_FIELDS}; it has no fields",
    ]
    # Forced, the record is read in that format; the other's fields are left alone.
    [read] = load_conversations(write(tmp_path, [both], "one.json"), "openai")
    assert read.turns == (("user", "2+2?"), ("assistant", "4"))


def test_validate_lists_every_bad_record_up_to_a_count_and_the_trainer_stops_at_the_first(tmp_path: Path) -> None:
    good = OPENAI[1]
    items = [good] + [{"id": f"r{i}", "messages": [{"role": "user", "content": "q"}]} for i in range(MAX_PROBLEMS + 5)]
    items.insert(3, SHAREGPT[0])
    path = write(tmp_path, items, "many.jsonl")
    check = check_conversations(path)
    assert (check.records, check.good, check.problem_count) == (MAX_PROBLEMS + 7, 1, MAX_PROBLEMS + 6)
    lines = check.problem_lines(path)
    assert len(lines) == MAX_PROBLEMS + 1
    assert lines[0] == f"{path}: record 1 (id 'r0'): no assistant turn, so nothing to learn from it"
    assert lines[2].startswith(f"{path}: record 3 (id 'a'): field 'conversations' is the sharegpt format, but the file is openai")
    assert lines[-1] == f"{path}: 6 more bad records ({MAX_PROBLEMS + 6} in all; the first {MAX_PROBLEMS} are above)"
    assert first_problem(path) == lines[0][len(path) + 2:]
    # Lines that are not JSON are listed too, each where it is (the first line not being JSON
    # means the file is not JSONL at all: one line for the file).
    path = write(tmp_path, [good], "lines.jsonl")
    Path(path).write_text(json.dumps(good) + "\n{broken\n" + json.dumps(good) + "\n[1,\n")
    assert problems(path) == [
        f"{path}: line 2 is not valid JSON (Expecting property name enclosed in double quotes); expected one object per line",
        f"{path}: line 4 is not valid JSON (Expecting value); expected one object per line",
    ]
    Path(path).write_text('{\n  "messages": []\n}\n')
    with pytest.raises(UserError, match=r"lines.jsonl: line 1 is not valid JSON \(Expecting property name"):
        check_conversations(path)


@pytest.mark.parametrize("name", ["data.json", "data.jsonl"])
@pytest.mark.parametrize("data_format", CHAT_FORMATS)
def test_the_head_of_a_big_file_is_checked_in_every_format(tmp_path: Path, data_format: str, name: str) -> None:
    items = ITEMS[data_format] * 30 + [{"id": "late", "bogus": 1}]  # the mistake lies past the head
    path = write(tmp_path, items, name)
    text = Path(path).read_text()
    cut = len(text) // 2
    count = check_conversations_head(path, cut)
    assert 0 < count < len(items)
    check = check_conversations(path, max_chars=cut)
    assert (check.format, check.problems, check.records) == (data_format, [], count)
    bad = write(tmp_path, [ITEMS[data_format][0], {"id": "early", "bogus": 1}] + ITEMS[data_format] * 30, name)
    with pytest.raises(UserError, match=r"record 1 \(id 'early'\): missing field"):
        check_conversations_head(bad, cut)


def job_file(folder: Path, **training) -> Path:
    job = {
        "name": "formats",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": 1},
        "training": {"model": "org/name", "data": "data.jsonl", **training},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def errors_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("jobgen: error: ")]


def test_validate_reads_each_format_and_lists_the_bad_items(tmp_path: Path) -> None:
    for data_format in CHAT_FORMATS:
        write(tmp_path, ITEMS[data_format], "data.jsonl")
        result = jobgen("validate", str(job_file(tmp_path)), cwd=tmp_path)
        assert result.returncode == 0 and ": ok: " in result.stdout, result.stderr
        result = jobgen("validate", str(job_file(tmp_path, data_format=data_format)), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    # ALPACA is in the file; a job that says openai is refused record by record.
    result = jobgen("validate", str(job_file(tmp_path, data_format="openai")), cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    data = tmp_path / "data.jsonl"
    assert errors_of(result) == [
        f"jobgen: error: {data}: record {i} (id '{item['id']}'): missing field 'messages' (training.data_format is openai); "
        "it has 'instruction' (alpaca)"
        for i, item in enumerate(ALPACA)
    ]
    write(tmp_path, OPENAI + [{"id": f"bad{i}", "messages": [{"role": "function", "content": "x"}]} for i in range(MAX_PROBLEMS + 2)], "data.jsonl")
    result = jobgen("submit", "-s", "slurm", "--dry-run", str(job_file(tmp_path)), cwd=tmp_path)
    lines = errors_of(result)
    assert result.returncode == 2 and len(lines) == MAX_PROBLEMS + 1, result.stderr
    assert lines[0] == f"jobgen: error: {data}: record 3 (id 'bad0'): messages[0].role is 'function', {LEGACY}"
    assert lines[-1] == f"jobgen: error: {data}: 2 more bad records ({MAX_PROBLEMS + 2} in all; the first {MAX_PROBLEMS} are above)"
    result = jobgen("validate", str(job_file(tmp_path, data_format="csv")), cwd=tmp_path)
    assert result.returncode == 2 and "'training.data_format' is 'csv'" in result.stderr


def test_the_guides_record_of_each_format_reads_as_that_format(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "data.md").read_text()
    block = readme.split("One record of each:\n\n```jsonl\n", 1)[1].split("```", 1)[0]
    records = [json.loads(line) for line in block.splitlines()]
    assert len(records) == len(FORMATS)
    for data_format, record in zip(FORMATS, records):
        path = write(tmp_path, [record], f"{data_format}.jsonl")
        check = check_conversations(path)
        assert (check.format, check.problems) == (data_format, [])
        [read] = load_conversations(path)
        if data_format in CHAT_FORMATS:
            assert read.system == "Be brief." and read.turns[-1][0] == "assistant"
    assert load_conversations(path) == [TokenSample("a1", (17, 42, 9, 2), (-100, -100, 9, 2))]


def test_an_openai_assistant_message_of_weight_0_is_kept_and_marked_not_learned(tmp_path):
    path = write(tmp_path, [{"id": "w", "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red.", "weight": 0},
        {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue.", "weight": 1}]}])
    read = load_conversations(path)[0]
    assert read.turns[1] == ("assistant", "Red.") and read.unlearned == (1,)


# A conversation with a tool: OpenAI's spelling (arguments as JSON text, as OpenAI writes them) and
# LLaMA-Factory's ShareGPT twin read into the same Conversation.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OPENAI_TOOLS = {"id": "t", "tools": [WEATHER_TOOL], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."}]}
SHAREGPT_TOOLS = {"id": "t", "tools": json.dumps([WEATHER_TOOL["function"]]), "conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
    {"from": "observation", "value": "sunny"},
    {"from": "gpt", "value": "It is sunny."}]}


def test_tool_calls_results_and_definitions_are_read_in_openai_and_llama_factory_spelling(tmp_path: Path) -> None:
    [openai] = load_conversations(write(tmp_path, [OPENAI_TOOLS], "openai.json"))
    [sharegpt] = load_conversations(write(tmp_path, [SHAREGPT_TOOLS], "sharegpt.json"))
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert openai.messages() == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "id": "call_1"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    assert openai.tool_definitions() == sharegpt.tool_definitions() == [WEATHER_TOOL]
    assert sharegpt.messages()[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert [m["role"] for m in sharegpt.messages()] == ["user", "assistant", "tool", "assistant"]
    assert openai.uses_tools and not EXPECTED[0].uses_tools
    assert EXPECTED[0].messages() == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello."}]
    # "tool_calls": null or [], as some exports write on every message, is a message without calls.
    plain = {"messages": [{"role": "user", "content": "q", "tool_calls": None}, {"role": "assistant", "content": "a", "tool_calls": []}]}
    [read] = load_conversations(write(tmp_path, [plain], "plain.json"))
    assert not read.uses_tools and read.messages() == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def test_a_file_saved_with_a_byte_order_mark_reads_as_without_it(tmp_path: Path) -> None:
    # Windows editors (and pandas' to_json there) start a UTF-8 file with U+FEFF; it read as bad JSONL.
    for name in ("data.json", "data.jsonl"):
        plain = write(tmp_path, SHAREGPT, name)
        marked = tmp_path / f"bom-{name}"
        marked.write_bytes(b"\xef\xbb\xbf" + Path(plain).read_bytes())
        assert load_conversations(str(marked)) == load_conversations(plain)
        result = jobgen("validate", str(job_file(tmp_path, data=marked.name)), cwd=tmp_path)
        assert result.returncode == 0 and ": ok: " in result.stdout and "3 steps" in result.stdout, result.stderr


def test_a_csv_file_is_refused_naming_the_formats_read_and_a_conversion_that_works(tmp_path: Path) -> None:
    import shlex

    table = tmp_path / "alpaca.csv"
    table.write_text("instruction,output\n" + "".join(f"{item['instruction']},{item['output']}\n" for item in ALPACA))
    result = jobgen("validate", str(job_file(tmp_path, data="alpaca.csv")), cwd=tmp_path)
    formats = ("jobgen reads JSON (an array of records), JSONL (a record a line), Parquet (.parquet) and a folder "
               "written by datasets' save_to_disk")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = errors_of(result)
    assert line.startswith(f"jobgen: error: training.data: '{table}' is a CSV file, which jobgen does not read; {formats}: "
                           "convert it, e.g. python -c ")
    # The conversion it names makes a Parquet file of the same records, which the job reads.
    command = shlex.split(line.split("e.g. ", 1)[1])
    subprocess.run([sys.executable, *command[1:]], check=True)
    result = jobgen("validate", str(job_file(tmp_path, data="alpaca.parquet")), cwd=tmp_path)
    assert result.returncode == 0 and ": ok: " in result.stdout, result.stderr
    # A file of another name that is not JSON says the same of the formats, not "bad JSONL" alone.
    (tmp_path / "data.txt").write_text("instruction,output\nhi,hello\n")
    result = jobgen("validate", str(job_file(tmp_path, data="data.txt")), cwd=tmp_path)
    assert errors_of(result) == [f"jobgen: error: {tmp_path / 'data.txt'}: line 1 is not valid JSON (Expecting value), "
                                 f"so the file is neither a JSON array nor JSONL (one object per line); {formats}"]
