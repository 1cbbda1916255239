"""Every file a user gives jobgen, whatever its bytes, is read or refused with a message naming
the file: the job file, a site profile, a template override, the conversation data. Never a
traceback. The readers are called directly inside hypothesis (fast); the CLI runs a few fixed cases."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobgen.script import render as render_module
from jobgen.job.layers import apply_override, load_site, resolve_job
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.job.conversations import FORMATS, check_conversations, check_conversations_head, load_conversations
from jobgen.job.record_formats import OPENAI_ROLES, SHAREGPT_ROLES, TOOL_ROLES
from jobgen.errors import UserError
from tests.helpers import REPO, jobgen

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD_JOB = {
    "name": "fuzz",
    "resources": {"nodes": 1, "gpus_per_node": 0},
    "launch": {"procs_per_node": 1},
    "training": {"model": "org/name", "data": "data.json"},
}

# YAML-ish values, keys included that are not strings (1:, null:, true:), as an editor may leave.
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
KEYS = st.text(max_size=10) | st.integers() | st.none() | st.booleans()
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4), max_leaves=15
)
# Every dotted key of a job, so wrong values land where validation looks, not only at the top.
FIELDS = [
    f"{section}.{field}" if field else section
    for section, info in Job.model_fields.items()
    for field in [None, *getattr(info.annotation, "model_fields", {})]
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def assert_refused_well(error: Exception, path: Path) -> None:
    """One line per problem, each naming the file; never a traceback's text."""
    lines = str(error).splitlines()
    assert lines, f"an empty message for {path}"
    for line in lines:
        assert line.startswith(f"{path}:") or line.startswith(f"template {path}"), line
        assert "Traceback" not in line


def read_job(path: Path, content: bytes) -> None:
    path.write_bytes(content)
    try:
        resolve_job(path)
    except JobgenError as error:
        assert_refused_well(error, path)


def with_value(dotted: str, value) -> dict:
    job = json.loads(json.dumps(GOOD_JOB))
    section, _, field = dotted.partition(".")
    if field and isinstance(job.get(section), dict):
        job[section][field] = value
    elif field:
        job[section] = {field: value}
    else:
        job[section] = value
    return job


# --- job file and site profile (jobgen.job.layers) ---------------------------------------------------


@FUZZ
@given(content=st.binary(max_size=300))
def test_a_job_file_of_any_bytes(folder: Path, content: bytes) -> None:
    read_job(folder / "bytes.yaml", content)


@FUZZ
@given(content=st.text(max_size=300))
def test_a_job_file_of_any_text(folder: Path, content: str) -> None:
    read_job(folder / "text.yaml", content.encode())


@FUZZ
@given(dotted=st.sampled_from(FIELDS), value=VALUES)
def test_a_job_file_with_any_value_in_a_real_key(folder: Path, dotted: str, value) -> None:
    read_job(folder / "value.yaml", yaml.safe_dump(with_value(dotted, value), allow_unicode=True).encode())


@FUZZ
@given(document=VALUES)
def test_a_job_file_of_any_yaml_document(folder: Path, document) -> None:
    read_job(folder / "doc.yaml", yaml.safe_dump(document).encode())


@FUZZ
@given(content=st.binary(max_size=200) | VALUES.map(lambda v: yaml.safe_dump({"defaults": v, "templates": v}).encode()))
def test_a_site_profile_of_any_content(folder: Path, content: bytes) -> None:
    path = folder / "site.yaml"
    path.write_bytes(content)
    try:
        load_site(str(path))
    except JobgenError as error:
        assert_refused_well(error, path)


def test_site_profile_values_of_the_wrong_kind_are_one_line(folder: Path) -> None:
    cases = {
        "templates: {a: 1}\n": "'templates' is {'a': 1}; expected the name of a folder, relative to the profile",
        'templates: "a\\0b"\n': "'templates' is 'a\\x00b'; expected the name of a folder",
        f"templates: {'x' * 5000}\n": f"'templates' folder {folder / ('x' * 5000)} does not exist",
        "defaults: [a]\n": "'defaults' must be a mapping of job keys",
        "1: x\nzz: y\n": "unknown key '1' in site profile",
    }
    path = folder / "site-cases.yaml"
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(JobgenError) as info:
            load_site(str(path))
        assert str(info.value).startswith(f"{path}: {message}")


@FUZZ
@given(dotted=st.sampled_from(FIELDS), raw=st.text(max_size=40))
def test_any_set_value(dotted: str, raw: str) -> None:
    layered = json.loads(json.dumps(GOOD_JOB))
    try:
        apply_override(layered, f"{dotted}={raw}")
    except JobgenError as error:
        assert len(str(error).splitlines()) == 1 and str(error).startswith("--set ")


def test_a_set_value_yaml_cannot_read_is_taken_as_text() -> None:
    for raw in ("9" * 5000, "[" * 3000, "2020-13-45", "!!binary zz"):
        layered: dict = {}
        apply_override(layered, f"name={raw}")
        assert layered == {"name": raw}


def test_yaml_that_expands_or_nests_without_end_is_refused_quickly(folder: Path) -> None:
    # Nine levels of nine aliases each: 9**9 values once expanded, a few hundred bytes of YAML.
    levels = "abcdefghi"
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{name}: &{name} [{', '.join([f'*{below}'] * 9)}]\n" for below, name in zip(levels, levels[1:])
    )
    cases = {
        "bomb.yaml": (bomb + "environment: {setup: *i}\n", "more than 10000 values once YAML aliases are expanded"),
        "self.yaml": ("environment: {setup: &s [*s]}\n", "nested more than 32 levels deep"),
        "deep.yaml": ("name: " + "[" * 200 + "]" * 200 + "\n", "nested more than 32 levels deep"),
        "int.yaml": ("resources: {nodes: " + "9" * 5000 + "}\n", "Exceeds the limit (4300 digits)"),
        "nul.yaml": ("name: a\0b\n", "character U+0000 at line 1, column 8 is not allowed"),
        "keys.yaml": ("1: x\nnull: y\n", "'1' is 1: Keys should be strings"),
    }
    for name, (text, message) in cases.items():
        path = folder / name
        path.write_text(text)
        with pytest.raises(JobgenError, match=re.escape(message)):
            resolve_job(path)


# --- template overrides (jobgen.script.render) -----------------------------------------------------------

JINJA_PIECES = st.sampled_from(
    ["{{", "}}", "{%", "%}", "{##", "##}", " if ", " endif ", " for x in ", " endfor ", " block prologue ", " endblock ",
     " extends 'bundled/slurm.sh.j2' ", " extends 'slurm.sh.j2' ", " include 'nope.j2' ", "job.name", "job.nosuch", "x",
     "|raw", "|comment", "1/0", "(", ")", "'", "\n", " ", "é", "\x00", "\udcff"]
)
TEMPLATES = st.binary(max_size=120) | st.lists(JINJA_PIECES, max_size=25).map(
    lambda pieces: "".join(pieces).encode("utf-8", "surrogateescape")
)


@FUZZ
@given(content=TEMPLATES, name=st.sampled_from(["slurm.sh.j2", "node.sh.j2", "job.sh.j2"]))
def test_a_template_override_of_any_content(folder: Path, monkeypatch_module, content: bytes, name: str) -> None:
    overrides = folder / "templates"
    overrides.mkdir(exist_ok=True)
    for old in overrides.iterdir():
        old.unlink()
    (overrides / name).write_bytes(content)
    (folder / "site-t.yaml").write_text("templates: templates\n")
    (folder / "job-t.yaml").write_text(yaml.safe_dump(GOOD_JOB))
    resolved = resolve_job(folder / "job-t.yaml", str(folder / "site-t.yaml"))
    try:
        render_module.render(resolved, "slurm")
    except JobgenError as error:
        [line] = str(error).splitlines()
        assert line.startswith((f"{overrides}/", f"{REPO}/templates/", "slurm.sh.j2:", "node.sh.j2:", "job.sh.j2:")), line


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    # Compiled overrides go to a cache of this test's own, not the user's one in /tmp.
    patch = pytest.MonkeyPatch()
    cache = tmp_path_factory.mktemp("bytecode")
    patch.setattr(render_module, "_bytecode_cache", lambda: jinja2.FileSystemBytecodeCache(str(cache)))
    yield patch
    patch.undo()


# --- conversation data (jobgen.train.data) -------------------------------------------------------

TEXT = st.text(max_size=8)
ROLE = st.sampled_from([*SHAREGPT_ROLES, *OPENAI_ROLES, *TOOL_ROLES, "bot"])
TURN = st.fixed_dictionaries({}, optional={"from": ROLE | VALUES, "value": TEXT | VALUES, "role": ROLE})
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": ROLE | VALUES, "content": TEXT | VALUES, "tool_calls": VALUES, "weight": st.sampled_from([0, 1, 0.5, True]) | VALUES,
    "from": ROLE,
})
# Items of each format, of no format and of several, with every field right or wrong.
ITEM = st.fixed_dictionaries({}, optional={
    "id": VALUES,
    "conversations": st.lists(TURN | VALUES, max_size=3) | VALUES,
    "messages": st.lists(MESSAGE | VALUES, max_size=3) | VALUES,
    "instruction": TEXT | VALUES,
    "input": TEXT | VALUES,
    "output": TEXT | VALUES,
    "system": TEXT | VALUES,
    "history": st.lists(st.lists(TEXT, max_size=3) | VALUES, max_size=2) | VALUES,
    "tools": VALUES,
}) | VALUES
# And good items of each format, so that files of one format, of mixed ones and of good and bad
# items come up too.
GOOD_ITEM = st.one_of(
    st.builds(lambda user, q, bot, a: {"conversations": [{"from": user, "value": q}, {"from": bot, "value": a}]},
              st.sampled_from(["human", "user"]), TEXT, st.sampled_from(["gpt", "assistant"]), TEXT),
    st.builds(lambda q, a: {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}, TEXT, TEXT),
    st.builds(lambda q, i, a: {"instruction": q, "input": i, "output": a}, TEXT, TEXT, TEXT),
)
DATA_FORMAT = st.sampled_from(["auto", *FORMATS])


def as_data(items: list, jsonl: bool) -> bytes:
    if jsonl:
        return "".join(json.dumps(item) + "\n" for item in items).encode()
    return json.dumps(items).encode()


def read_data(path: Path, content: bytes, data_format: str = "auto") -> None:
    path.write_bytes(content)
    for read in (lambda: load_conversations(str(path), data_format), lambda: check_conversations_head(str(path), 64, data_format)):
        try:
            read()
        except UserError as error:
            message = str(error)
            assert "\n" not in message and message.startswith((str(path), "training.data: ")), message
    # What `jobgen validate` lists: one line per bad item, each naming the file; the trainer's
    # reader stops at the first of them.
    try:
        check = check_conversations(str(path), data_format, max_problems=2)
    except UserError as error:
        assert "\n" not in str(error)
        return
    for line in check.problem_lines(str(path)):
        assert "\n" not in line and line.startswith(f"{path}: "), line
    if check.problems:
        with pytest.raises(UserError) as info:
            load_conversations(str(path), data_format)
        assert str(info.value) == check.problems[0]
    else:
        assert len(load_conversations(str(path), data_format)) == check.good == check.records


@FUZZ
@given(content=st.binary(max_size=300))
def test_data_of_any_bytes(folder: Path, content: bytes) -> None:
    read_data(folder / "data.json", content)


@FUZZ
@given(content=st.text(max_size=300))
def test_data_of_any_text(folder: Path, content: str) -> None:
    read_data(folder / "data.jsonl", content.encode())


@FUZZ
@given(items=st.lists(ITEM | GOOD_ITEM, max_size=4), jsonl=st.booleans(), data_format=DATA_FORMAT)
def test_data_of_any_json_shape(folder: Path, items: list, jsonl: bool, data_format: str) -> None:
    read_data(folder / "shapes.json", as_data(items, jsonl), data_format)


def test_data_nested_or_numbered_beyond_what_json_reads_is_refused(folder: Path) -> None:
    cases = {
        "deep.json": ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
        "deep.jsonl": ('{"a": ' * 100_000 + "1" + "}" * 100_000, "line 1 is not valid JSON (nested too deeply)"),
        "number.json": ("[" + "9" * 5000 + "]", "not valid JSON: Exceeds the limit (4300 digits)"),
    }
    for name, (text, message) in cases.items():
        path = folder / name
        path.write_text(text)
        with pytest.raises(UserError) as info:
            load_conversations(str(path))
        assert str(info.value).startswith(f"{path}: {message}")


# --- the command itself, for a few fixed cases ---------------------------------------------------


def test_a_latin1_job_file_is_one_line_naming_the_byte(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_bytes("name: café\n".encode("latin-1"))
    for command in (["validate"], ["render", "-s", "slurm"], ["submit", "-s", "slurm", "--dry-run"]):
        result = jobgen(*command, str(config))
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.splitlines() == [
            f"jobgen: error: {config}: not UTF-8 text: byte 0xe9 at line 1, column 10; save the file as UTF-8"
        ]


def test_a_latin1_site_profile_template_override_and_data_file_are_named(tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "slurm.sh.j2").write_bytes("# caf\xe9\n".encode("latin-1"))
    (tmp_path / "site.yaml").write_text("templates: templates\n")
    (tmp_path / "data.json").write_bytes("[\n{\"id\": \"caf\xe9\"}]".encode("latin-1"))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(GOOD_JOB))
    result = jobgen("render", "-s", "slurm", "--site", str(tmp_path / "site.yaml"), str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"jobgen: error: {tmp_path}/templates/slurm.sh.j2: not UTF-8 text: byte 0xe9 at line 1, column 6" in result.stderr
    result = jobgen("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"jobgen: error: {tmp_path}/data.json: not UTF-8 text: byte 0xe9 at line 2, column 12" in result.stderr
    (tmp_path / "site.yaml").write_bytes(b"description: caf\xe9\n")
    result = jobgen("validate", "--site", str(tmp_path / "site.yaml"), str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"jobgen: error: {tmp_path}/site.yaml: not UTF-8 text: byte 0xe9 at line 1, column 17; save the file as UTF-8"]


def test_a_template_override_mistake_is_one_line_with_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "site.yaml").write_text("templates: templates\n")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(GOOD_JOB))
    override = tmp_path / "templates" / "slurm.sh.j2"
    cases = {
        "{% extends 'bundled/slurm.sh.j2' %}\n{% block prologue %}\n{{ partiton }}\n{% endblock %}\n":
            f"{override}:3: 'partiton' is undefined",
        "#!/bin/bash\n{% if job.name %}\n": f"{override}:2: Unexpected end of template. Jinja was looking "
            "for the following tags: 'elif' or 'else' or 'endif'. The innermost block that needs to be closed is 'if'.",
        "{% extends 'slurm.sh.j2' %}\n": "slurm.sh.j2: extends or includes itself, directly or through another "
            "template; an override extends the shipped one as 'bundled/slurm.sh.j2'",
    }
    for text, message in cases.items():
        override.write_text(text)
        result = jobgen("render", "-s", "slurm", "--site", str(tmp_path / "site.yaml"), str(config))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert [line for line in result.stderr.splitlines() if "error" in line] == [f"jobgen: error: {message}"]
