"""`jobgen data JOB.yaml --show N`: samples as the model sees them, learned tokens marked, and
`--json` their ids and labels, from the trainer's own tokenization."""

from __future__ import annotations

import json
import time

import yaml

from jobgen.job.conversations import load_conversations
from jobgen.train.data import IGNORE_INDEX, ChatTokenizer
from jobgen.train.modeling import load_tokenizer
from tests.helpers import jobgen
from tests.train.published_templates import QWEN25


def _job(tmp_path, tiny, **training):
    job = {"name": "show", "launch": {"procs_per_node": 1},
           "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "max_length": 48, **training}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_show_marks_what_is_learned_in_chatml(tmp_path, tiny):
    result = jobgen("data", str(_job(tmp_path, tiny)), "--show", "2", "--site", "none")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "# 2 sample(s) in ChatML (the tokenizer has no chat template); learned tokens are between ⟦ and ⟧"
    first = load_conversations(str(tiny / "data.json"))[0]
    answer = first.turns[1][1]
    assert f"⟦<|im_start|>⟧assistant\n⟦{answer}<|im_end|>\n⟧" in result.stdout
    assert "<|im_start|>user\n" + first.turns[0][1] + "<|im_end|>\n" in result.stdout  # not marked
    assert sum(line.startswith("# sample ") for line in lines) == 2


def test_json_is_the_trainers_ids_and_labels_in_the_models_template(tmp_path, tiny):
    template = tmp_path / "qwen2.5.jinja"
    template.write_text(QWEN25)
    result = jobgen("data", str(_job(tmp_path, tiny, chat_template=str(template), max_length=256)), "--show", "3", "--json",
                    "--site", "none")
    assert result.returncode == 0, result.stderr
    samples = [json.loads(line) for line in result.stdout.splitlines()]
    tokenizer = load_tokenizer(str(tiny / "model"))
    chat = ChatTokenizer(tokenizer, 256, str(template))
    conversations = load_conversations(str(tiny / "data.json"))[:3]
    assert [s["id"] for s in samples] == [c.id for c in conversations]
    for sample, conversation in zip(samples, conversations):
        ids, labels = chat(conversation)
        assert (sample["input_ids"], sample["labels"]) == (ids, labels)
        assert tokenizer.decode(ids).startswith("<|im_start|>system\n")
        assert any(label != IGNORE_INDEX for label in labels)


def test_a_cut_sample_says_so(tmp_path, tiny):
    result = jobgen("data", str(_job(tmp_path, tiny, max_length=16)), "--show", "1", "--site", "none")
    assert result.returncode == 0, result.stderr
    assert "16 tokens (cut from" in result.stdout and "to max_length)" in result.stdout


def test_show_writes_the_tool_calls_and_results_and_marks_the_calls_learned(tmp_path, tiny):
    from tests.test_data_formats import OPENAI_TOOLS

    template = tmp_path / "qwen2.5.jinja"
    template.write_text(QWEN25)
    data = tmp_path / "tools.json"
    data.write_text(json.dumps([OPENAI_TOOLS]))
    job = _job(tmp_path, tiny, data=str(data), chat_template=str(template), max_length=4096)
    result = jobgen("data", str(job), "--show", "1", "--site", "none")
    assert result.returncode == 0, result.stderr
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in result.stdout  # not marked
    assert '<|im_start|>assistant\n⟦<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in result.stdout
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n⟦It is sunny." in result.stdout
    # In ChatML the record is refused in one line, naming it and the setting.
    result = jobgen("data", str(_job(tmp_path, tiny, data=str(data), chat_template="chatml")), "--show", "1", "--site", "none")
    errors = [line for line in result.stderr.splitlines() if line.startswith("jobgen: error:")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert errors[0].startswith("jobgen: error: training.chat_template: conversation 't' has tool calls, results or definitions")


def test_the_whole_data_sets_cut_is_counted_by_prepare_and_shown_by_data(tmp_path, tiny):
    from jobgen.train.data import TokenizedDataset

    job = _job(tmp_path, tiny, max_length=48, prepared_cache=str(tmp_path / "stores"))
    before = jobgen("data", str(job), "--show", "1", "--site", "none")
    assert before.returncode == 0, before.stderr
    assert before.stdout.splitlines()[-1].startswith("# the whole data set: not prepared yet; `jobgen prepare` counts")
    assert not (tmp_path / "stores").exists()  # showing samples writes no store: `jobgen prepare` does
    prepared = jobgen("prepare", str(job), "--site", "none")
    assert prepared.returncode == 0, prepared.stderr
    tokenizer = load_tokenizer(str(tiny / "model"))
    conversations = load_conversations(str(tiny / "data.json"))
    cut = TokenizedDataset(conversations, ChatTokenizer(tokenizer, 48), tokenizer.pad_token_id).cut_lengths
    assert cut
    said = f"{len(cut)} of {len(conversations)} conversations cut at max_length 48, {sum(c - 48 for c in cut)} tokens lost"
    assert f"jobgen: {said}; the longest, " in prepared.stderr and "raise training.max_length" in prepared.stderr
    again = jobgen("prepare", str(job), "--site", "none")
    assert again.returncode == 0 and ") was prepared already; nothing to do\n" in again.stderr, again.stderr
    after = jobgen("data", str(job), "--show", "1", "--site", "none")
    assert after.returncode == 0, after.stderr
    assert after.stdout.splitlines()[-1].startswith("# the whole data set (store ") and said in after.stdout


def test_a_hub_model_the_hub_cannot_give_is_one_line_at_once(tmp_path, tiny):
    # Not in the (empty) cache, and HF_ENDPOINT a closed port: huggingface_hub's own client
    # retried each request for about a minute, printing two dozen lines, before its error.
    from tests.helpers import free_port

    job = _job(tmp_path, tiny, model="Qwen/Qwen-14B")
    endpoint = f"http://127.0.0.1:{free_port()}"
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": ""}
    for command in ("data", "prepare"):
        started = time.monotonic()
        result = jobgen(command, str(job), "--site", "none", env=env, timeout=40)
        took = time.monotonic() - started
        errors = [line for line in result.stderr.splitlines() if not line.startswith("jobgen: warning:")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr
        assert errors[0].startswith(f"jobgen: error: training.model: Qwen/Qwen-14B is not in {tmp_path / 'hf' / 'hub'} "
                                    f"(HF_HOME={tmp_path / 'hf'}) and the hub ({endpoint}) cannot be reached from here "
                                    "(Connection refused): run `jobgen prepare")
        assert took < 10, f"jobgen {command} took {took:.0f} s"
