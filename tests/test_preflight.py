"""`jobgen validate` and `jobgen submit` check the files a job names before it waits in a queue:
a typo is refused with one line, a path this machine cannot see is a warning, and render checks
nothing (a script may be rendered for another machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from jobgen.job import preflight
from jobgen.errors import JobgenError
from jobgen.job.models import Job
from jobgen.job.conversations import check_conversations_head, load_conversations
from tests.helpers import jobgen

TURNS = [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "hello"}]
UNSEEN_TOP = "/jobgen-test-no-such-mount"  # a top-level folder no machine running the tests has

COMMANDS = {
    "validate": ["validate"],
    "submit --dry-run": ["submit", "-s", "slurm", "--dry-run"],
    "submit local": ["submit", "-s", "local"],
}


def job_file(folder: Path, **training) -> Path:
    job = {
        "name": "pf",
        "resources": {"nodes": 1, "gpus_per_node": 0},
        "launch": {"procs_per_node": 1},
        "training": {"model": "org/name", "data": "data.json", **training},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def write_conversations(path: Path, count: int = 2) -> Path:
    path.write_text(json.dumps([{"id": i, "conversations": TURNS} for i in range(count)]))
    return path


def errors_of(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("jobgen: error: ")]


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_missing_data_file_is_refused_before_anything_is_written(tmp_path: Path, command: list[str]) -> None:
    config = job_file(tmp_path, data="data/convs.json")
    (tmp_path / "data").mkdir()
    result = jobgen(*command, str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert errors_of(result) == [f"jobgen: error: training.data: file '{tmp_path}/data/convs.json' does not exist"]
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "runs").exists(), "a refused job left a run directory"


def test_a_typo_is_refused_with_the_closest_existing_name(tmp_path: Path) -> None:
    write_conversations(tmp_path / "conversations.json")
    result = jobgen("validate", str(job_file(tmp_path, data="conversation.json")), cwd=tmp_path)
    assert result.returncode == 2
    assert f"does not exist (did you mean '{tmp_path}/conversations.json'?)" in result.stderr
    result = jobgen("validate", str(job_file(tmp_path, data="dta/conversations.json")), cwd=tmp_path)
    assert result.returncode == 2
    assert f"does not exist: there is no '{tmp_path}/dta'" in result.stderr


def test_a_hub_dataset_name_as_data_says_how_to_make_it_files(tmp_path: Path) -> None:
    write_conversations(tmp_path / "conversations.json")
    config = job_file(tmp_path, data="conversations.json")
    job = yaml.safe_load(config.read_text())
    job["training"]["eval_data"] = "tatsu-lab/alpaca"
    config.write_text(yaml.safe_dump(job))
    result = jobgen("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert errors_of(result) == [
        f"jobgen: error: training.eval_data: file '{tmp_path}/tatsu-lab/alpaca' does not exist: there is no "
        f"'{tmp_path}/tatsu-lab'; if 'tatsu-lab/alpaca' is a Hugging Face Hub dataset, jobgen reads files, not hub "
        "names: download it (hf download tatsu-lab/alpaca --repo-type dataset --local-dir alpaca) and list the "
        ".parquet or .jsonl files of the split to use in training.eval_data"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("data.jsonl", json.dumps({"conversations": TURNS}) + "\n{broken\n",
         "data.jsonl: line 2 is not valid JSON (Expecting property name enclosed in double quotes); expected one object per line"),
        ("data.json", '[\n {"conversations": []}\n {"conversations": []}\n]\n',
         "data.json: not valid JSON at line 3 column 2: Expecting ',' delimiter"),
        ("data.json", '[{"id": "a", "conversations": [{"from": "bot", "value": "x"}]}]',
         "data.json: record 0 (id 'a'): conversations[0].from is 'bot'; expected one of human, user, gpt, assistant, system, function_call, observation"),
        ("data.json", '[{"id": "caf\xe9", "conversations": []}]', "data.json: not UTF-8 text: byte 0xe9 at line 1, column 13; save the file as UTF-8"),
    ],
    ids=["jsonl", "json array", "wrong role", "latin-1"],
)
def test_data_that_the_trainer_would_refuse_is_refused_naming_the_place(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_bytes(content.encode("latin-1"))
    result = jobgen("submit", "-s", "slurm", "--dry-run", str(job_file(tmp_path, data=name)), cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert errors_of(result) == [f"jobgen: error: {tmp_path}/{message}"]


def test_a_local_model_folder_must_exist_and_hold_config_json(tmp_path: Path) -> None:
    write_conversations(tmp_path / "data.json")
    (tmp_path / "models" / "base").mkdir(parents=True)
    cases = {
        # "models" is a folder here, so the trainer reads models/llama as a path, not a hub name.
        "models/llama": f"training.model: folder '{tmp_path}/models/llama' does not exist",
        "llama-local": f"training.model: folder '{tmp_path}/llama-local' does not exist (and it is not a hub name like org/name)",
        "models/base": f"training.model: '{tmp_path}/models/base' is a directory without config.json; expected a saved model",
    }
    for model, message in cases.items():
        result = jobgen("validate", str(job_file(tmp_path, model=model)), cwd=tmp_path)
        assert result.returncode == 2 and errors_of(result) == [f"jobgen: error: {message}"], model
    (tmp_path / "models" / "base" / "config.json").write_text('{"model_type": "llama"}')
    for model in ("models/base", "meta-llama/Meta-Llama-3-8B"):  # a hub name the nodes' cache lacks only warns
        result = jobgen("validate", str(job_file(tmp_path, model=model)), cwd=tmp_path)
        assert result.returncode == 0 and ": ok: " in result.stdout, result.stderr


def test_max_length_above_the_models_positions_is_refused_naming_both_numbers(tmp_path: Path) -> None:
    write_conversations(tmp_path / "data.json")
    model = tmp_path / "models" / "small"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 4096}')
    result = jobgen("validate", str(job_file(tmp_path, model="models/small", max_length=32768)), cwd=tmp_path)
    assert result.returncode == 2 and errors_of(result) == [
        f"jobgen: error: training.max_length 32768 is above the 4096 positions {model} has (max_position_embeddings "
        f"in {model}/config.json): rows that long index past its position table or run on positions it never "
        "trained; lower training.max_length to 4096 or less"
    ]
    assert jobgen("validate", str(job_file(tmp_path, model="models/small", max_length=4096)), cwd=tmp_path).returncode == 0
    # A RoPE scaling's factor stretches the positions (Qwen2.5's YaRN: 32768 x 4).
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }))
    assert jobgen("validate", str(job_file(tmp_path, model="models/small", max_length=131072)), cwd=tmp_path).returncode == 0
    result = jobgen("validate", str(job_file(tmp_path, model="models/small", max_length=262144)), cwd=tmp_path)
    assert "is above the 131072 positions" in result.stderr and "(max_position_embeddings x rope_scaling.factor in" in result.stderr


def test_records_with_tools_are_refused_before_the_queue_where_the_job_trains_in_chatml(tmp_path: Path) -> None:
    # The trainer refuses them at its start (tests/train/test_tool_calls.py); validate says the same
    # line where the files tell the layout: ChatML set, or a model whose tokenizer has no template.
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    with_tools = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "tool_calls": [call]},
                  {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C in Paris."}]
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
                    + "\n" + json.dumps({"id": "w1", "messages": with_tools}) + "\n")
    plain, templated = tmp_path / "plain", tmp_path / "templated"
    for folder, tokenizer_config in ((plain, {}), (templated, {"chat_template": "{{ messages }}"})):
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    fix = ("has tool calls, results or definitions, and {} has no way to write them; set training.chat_template: "
           "tokenizer for a model whose template renders tools (Llama 3.1, Qwen 2.5), or the path of a Jinja file that does")
    where = f"training.chat_template: {data}: record 1 (id 'w1') "
    cases = {
        (plain, None): where + fix.format(f"ChatML (the tokenizer of {plain} has no chat template)"),
        (templated, "chatml"): where + fix.format("ChatML (training.chat_template is chatml)"),
        (templated, None): None,
    }
    for (model, template), message in cases.items():
        settings = {"model": str(model), "data": str(data), **({"chat_template": template} if template else {})}
        result = jobgen("validate", str(job_file(tmp_path, **settings)), cwd=tmp_path)
        if message is None:
            assert result.returncode == 0 and ": ok: " in result.stdout, result.stderr
        else:
            assert result.returncode == 2 and errors_of(result) == [f"jobgen: error: {message}"], (model, template, result.stderr)


def test_a_path_this_machine_cannot_see_is_a_warning_and_the_submit_goes_on(tmp_path: Path) -> None:
    config = job_file(tmp_path, data=f"{UNSEEN_TOP}/data.json", model=f"{UNSEEN_TOP}/models/llama")
    result = jobgen("submit", "-s", "slurm", "--dry-run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"jobgen: warning: training.data: '{UNSEEN_TOP}/data.json' is not visible from this machine; not checked" in result.stderr
    assert f"jobgen: warning: training.model: '{UNSEEN_TOP}/models/llama' is not visible from this machine; not checked" in result.stderr
    assert result.stdout.startswith("#!")


def test_a_global_batch_bigger_than_the_data_is_a_warning_naming_both(tmp_path: Path) -> None:
    """40 records at a global batch of 64: every step is a whole epoch, which validate's
    `12 epoch(s) x 1 steps` alone does not make plain."""
    write_conversations(tmp_path / "data.json", count=40)
    config = job_file(tmp_path, per_device_batch_size=8, gradient_accumulation=8, epochs=12)
    result = jobgen("validate", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("jobgen: warning: training.data has 40 records, fewer than one global batch of 64 (training.per_device_batch_size 8 "
            "x world size 1 x training.gradient_accumulation 8): every optimizer step is a whole epoch (12 step(s) in all for "
            "training.epochs 12); lower training.per_device_batch_size or training.gradient_accumulation, or add data"
            ) in result.stderr.splitlines()
    assert "12 epoch(s) x 1 steps = 12 steps" in result.stdout
    submitted = jobgen("submit", "-s", "slurm", "--dry-run", str(config), cwd=tmp_path)
    assert "training.data has 40 records, fewer than one global batch of 64" in submitted.stderr
    given = jobgen("validate", str(config), "--set", "training.global_batch_size=48", "--set", "training.max_steps=30", cwd=tmp_path)
    assert ("training.data has 40 records, fewer than one global batch of 48 (training.global_batch_size): every optimizer "
            "step is a whole epoch (training.max_steps 30: as many passes over the data); lower training.global_batch_size, "
            "or add data") in given.stderr
    # One batch of data or more: no warning.
    write_conversations(tmp_path / "data.json", count=64)
    assert "global batch" not in jobgen("validate", str(config), cwd=tmp_path).stderr


def test_relative_paths_are_the_working_directorys_as_on_the_nodes(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    write_conversations(work / "data.json")
    config = job_file(tmp_path, data="data.json")
    config.write_text(config.read_text() + f"environment: {{workdir: {work}}}\n")
    assert jobgen("validate", str(config), cwd=tmp_path).returncode == 0
    (work / "data.json").unlink()
    write_conversations(tmp_path / "data.json")  # the submit directory's is not the one used
    result = jobgen("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and f"training.data: file '{work}/data.json' does not exist" in result.stderr


def test_a_probe_job_and_render_check_no_files(tmp_path: Path) -> None:
    config = job_file(tmp_path, data="missing.json", model="./missing-model")
    probe = ["--set", "launch.entrypoint=jobgen-probe"]
    assert jobgen("validate", str(config), *probe, cwd=tmp_path).returncode == 0
    assert jobgen("submit", "-s", "pbs", "--dry-run", str(config), *probe, cwd=tmp_path).returncode == 0
    assert jobgen("render", "-s", "slurm", str(config), cwd=tmp_path).returncode == 0


def test_checking_the_files_imports_no_training_library(tmp_path: Path) -> None:
    # The checks use the trainer's own reader and model rule, whose modules import torch lazily.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    config = job_file(tmp_path, data=str(write_conversations(tmp_path / "data.json")), model=str(tmp_path / "model"))
    code = (
        "import sys; from jobgen.cli import main\n"
        f"try: main(['validate', {str(config)!r}])\n"
        "except SystemExit as end: print('EXIT', end.code, file=sys.stderr)\n"
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers', 'peft', 'datasets') if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "EXIT 0" in result.stderr and "HEAVY []" in result.stderr, result.stderr


def test_a_big_data_file_is_checked_in_its_first_part_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "CHECK_WHOLE_BYTES", 1000)
    line = json.dumps({"conversations": TURNS}) + "\n"
    data = tmp_path / "data.jsonl"
    data.write_text(line * 100 + "{broken\n")  # the mistake lies past the part checked here
    job = Job.model_validate(yaml.safe_load(job_file(tmp_path, data=str(data)).read_text()))
    [warning] = [w for w in preflight.check_job_files(job) if w.startswith("training.data")]  # (org/name: not cached)
    assert warning.startswith(f"training.data: '{data}' is ") and "the trainer checks them all" in warning
    assert f"only its first {1000 // len(line)} records" in warning
    data.write_text(line * 3 + "{broken\n" + line * 100)
    with pytest.raises(JobgenError, match=r"data.jsonl: line 4 is not valid JSON"):
        preflight.check_job_files(job)


TEXT = st.text(max_size=30)  # quotes, backslashes and non-ASCII, so cuts land inside escapes too
OTHER = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
# One conversation in each format the trainer reads (jobgen.job.conversations).
SHAPES = {
    "sharegpt": lambda question, answer: {"conversations": [{"from": "user", "value": question}, {"from": "assistant", "value": answer}]},
    "openai": lambda question, answer: {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]},
    "alpaca": lambda question, answer: {"instruction": question, "input": "", "output": answer},
}
CONVERSATIONS = st.sampled_from(sorted(SHAPES)).flatmap(lambda data_format: st.lists(
    st.builds(
        lambda id_, question, answer, other: {"id": id_, "other": other, **SHAPES[data_format](question, answer)},
        st.integers(0, 10**6) | TEXT, TEXT, TEXT, OTHER,  # other: true, null and 1.5e-07 can be cut too
    ),
    min_size=1,
    max_size=20,
))


@settings(max_examples=300, deadline=None)
@given(items=CONVERSATIONS, layout=st.sampled_from(["array", "indented", "jsonl"]), ascii_only=st.booleans(), data=st.data())
def test_a_cut_anywhere_in_good_data_is_never_taken_for_a_mistake(tmp_path_factory, items, layout, ascii_only, data) -> None:
    # The first part of a big file ends mid-item, in any format; only what the cut splits may go unchecked.
    if layout == "jsonl":  # as json.dumps writes it by default: the trainer splits lines at U+2028 too
        text = "".join(json.dumps(item) + "\n" for item in items)
    else:
        text = json.dumps(items, indent=2 if layout == "indented" else None, ensure_ascii=ascii_only)
    path = tmp_path_factory.mktemp("head") / "data.json"
    path.write_text(text, encoding="utf-8")
    cut = data.draw(st.integers(0, len(text)), label="cut")
    count = check_conversations_head(str(path), cut)
    assert 0 <= count <= len(items)
    if cut == len(text):
        assert count == len(load_conversations(str(path)))


ODD_PATHS = st.sampled_from(["", ".", "..", "/", "//x", "a/../../..", "x" * 300, "/x" * 3000, "a\0b", "~/data.json", "/dev/null", "/proc"])


@settings(max_examples=200, deadline=None)
@given(data=ODD_PATHS | st.text(max_size=20), model=ODD_PATHS | st.text(max_size=20))
def test_any_path_is_checked_warned_about_or_refused_in_one_line_each(tmp_path_factory, data: str, model: str) -> None:
    folder = tmp_path_factory.mktemp("any")
    job = Job.model_validate({**yaml.safe_load(job_file(folder).read_text()),
                              "training": {"model": model, "data": data}, "environment": {"workdir": str(folder)}})
    try:
        warnings = preflight.check_job_files(job)
    except JobgenError as error:
        lines = str(error).splitlines()
        assert 1 <= len(lines) <= 2 and all(line.startswith(("training.", "/")) for line in lines), lines
    else:
        assert all("\n" not in warning and warning.startswith("training.") for warning in warnings)


# Configs as the hub serves them: one transformers builds, one that runs its own code.
QWEN2_CONFIG = {"model_type": "qwen2", "hidden_size": 64, "architectures": ["Qwen2ForCausalLM"]}
QWEN_CONFIG = {"model_type": "qwen", "hidden_size": 64, "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                                                                     "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"}}


def test_a_hub_model_not_cached_is_checked_on_the_hub_where_it_is_reachable(tmp_path: Path) -> None:
    # A stand-in for the hub (tests.hub_stand_in), answering as the hub does: the real one is not reachable here.
    from tests.hub_stand_in import HubStandIn

    write_conversations(tmp_path / "data.json")
    env = {"HF_HOME": str(tmp_path / "hf")}  # empty: the model is not cached, so only the hub can tell
    with HubStandIn({"Qwen/Qwen-14B-Chat": QWEN_CONFIG, "Qwen/Qwen2.5-7B-Instruct": QWEN2_CONFIG}) as hub:
        env["HF_ENDPOINT"] = hub.url
        for command in (["validate"], ["submit", "-s", "slurm", "--dry-run"]):
            result = jobgen(*command, str(job_file(tmp_path, model="Qwen/Qwen-14B-Chatt")), cwd=tmp_path, env=env)
            assert result.returncode == 2 and result.stdout == "", result.stderr
            assert errors_of(result) == [
                f"jobgen: error: training.model: 'Qwen/Qwen-14B-Chatt' is not a model on the hub ({hub.url}) (did you "
                "mean 'Qwen/Qwen-14B-Chat'?); check its name, or, for a private model, give a token with access to it "
                "(HF_TOKEN, or `hf auth login`)"]
        result = jobgen("validate", str(job_file(tmp_path, model="Qwen/Qwen-14B-Chat")), cwd=tmp_path, env=env)
        assert result.returncode == 2
        assert errors_of(result) == [
            "jobgen: error: training.model: Qwen/Qwen-14B-Chat runs its own code (configuration_qwen.py, modeling_qwen.py "
            "in config.json's 'auto_map'); set training.trust_remote_code: true to run it on every node, or use a model "
            "transformers supports"]
        result = jobgen("validate", str(job_file(tmp_path, model="Qwen/Qwen2.5-7B-Instruct", model_revision="v9")),
                        cwd=tmp_path, env=env)
        assert errors_of(result) == [
            f"jobgen: error: training.model_revision: 'v9' is not a branch, tag or commit of Qwen/Qwen2.5-7B-Instruct on "
            f"the hub ({hub.url}); give one of its branches (main), tags or commits"]
        for model, more in (("Qwen/Qwen-14B-Chat", {"trust_remote_code": True}), ("Qwen/Qwen2.5-7B-Instruct", {})):
            result = jobgen("validate", str(job_file(tmp_path, model=model, **more)), cwd=tmp_path, env=env)
            assert result.returncode == 0 and ": ok: " in result.stdout, result.stderr
            assert "is not in the cache the nodes use" in result.stderr and "not checked" not in result.stderr
        assert f"/api/models/Qwen/Qwen2.5-7B-Instruct/revision/main" in hub.requests


def test_where_the_hub_cannot_be_reached_validate_says_what_was_not_checked(tmp_path: Path) -> None:
    write_conversations(tmp_path / "data.json")
    result = jobgen("validate", str(job_file(tmp_path, model="Qwen/Qwen-14B-Chatt")), cwd=tmp_path,
                    env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr
    assert (f"jobgen: warning: training.model: Qwen/Qwen-14B-Chatt is not in the cache the nodes use (HF_HOME={tmp_path / 'hf'}): "
            "run `jobgen prepare JOB.yaml` on a machine with internet, or the nodes will try to download it; the hub "
            "(http://127.0.0.1:9) cannot be reached from here (Connection refused), so its name, revision and config "
            "(model type, its own code and trust_remote_code) were not checked\n") in result.stderr
