"""Tool calls in a model's own chat template: the published Llama 3.1 and Qwen 2.5 templates render
`tools`, `tool_calls` and tool results; a conversation with them is tokenized exactly as
apply_chat_template(messages, tools=...) writes it, the assistant's calls and answers learned, the
tool results and definitions not. ChatML, and a template that drops tools, refuse it in one line."""

from __future__ import annotations

import json

import pytest

from jobgen.errors import UserError
from jobgen.job.conversations import load_conversations
from jobgen.train.data import ChatTokenizer
from tests.test_data_formats import OPENAI_TOOLS, SHAREGPT_TOOLS, WEATHER_TOOL
from tests.train.published_templates import family_tokenizer
from tests.train.test_chat_templates import learned_runs

# OPENAI_TOOLS as transformers' chat-template documentation writes it (arguments an object).
HF_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "It is sunny."},
]
# What each family learns: the call as its template writes it, then the answer, each with its end of turn.
LEARNED = {
    "llama3.1": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is sunny.<|eot_id|>"],
    "qwen2.5": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
                "It is sunny.<|im_end|>\n"],
}


def read(tmp_path, record: dict):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record]))
    [conversation] = load_conversations(str(path))
    return conversation


@pytest.mark.parametrize("family", sorted(LEARNED))
def test_ids_are_apply_chat_template_with_tools_and_only_calls_and_answers_are_learned(family, tmp_path):
    tokenizer = family_tokenizer(family)
    chat = ChatTokenizer(tokenizer, 4096)
    ids, labels = chat(read(tmp_path, OPENAI_TOOLS))

    expected = tokenizer.apply_chat_template(HF_MESSAGES, tools=[WEATHER_TOOL], tokenize=True, return_dict=True)
    assert ids == list(expected["input_ids"])
    text = tokenizer.decode(ids)
    assert '"description": "The weather in a city."' in text  # the definitions are in the ids...
    runs = learned_runs(ids, labels)
    assert [tokenizer.decode(run) for run in runs] == LEARNED[family]  # ...and only the calls and answers learned
    assert runs == [tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in LEARNED[family]]

    # LLaMA-Factory's ShareGPT spelling of the same conversation trains the same tokens (its call has no id,
    # which neither template writes).
    assert chat(read(tmp_path, SHAREGPT_TOOLS)) == (ids, labels)


def test_a_tool_call_of_weight_0_is_in_the_ids_but_not_learned(tmp_path):
    record = json.loads(json.dumps(OPENAI_TOOLS))
    record["messages"][1]["weight"] = 0
    tokenizer = family_tokenizer("qwen2.5")
    chat = ChatTokenizer(tokenizer, 4096)
    ids, labels = chat(read(tmp_path, record))
    assert ids == chat(read(tmp_path, OPENAI_TOOLS))[0]
    assert [tokenizer.decode(run) for run in learned_runs(ids, labels)] == ["It is sunny.<|im_end|>\n"]


def test_chatml_refuses_a_conversation_with_tools_in_one_line(tmp_path):
    with pytest.raises(UserError) as caught:
        ChatTokenizer(family_tokenizer("qwen2.5"), 4096, "chatml")(read(tmp_path, OPENAI_TOOLS))
    assert str(caught.value) == (
        "training.chat_template: conversation 't' has tool calls, results or definitions, and ChatML has no way "
        "to write them; set training.chat_template: tokenizer for a model whose template renders tools "
        "(Llama 3.1, Qwen 2.5), or the path of a Jinja file that does"
    )


def test_a_template_that_drops_tool_calls_is_refused_naming_the_record(tmp_path):
    """Llama 3's template (before 3.1) writes each message's content only: the call would be lost."""
    record = {key: value for key, value in OPENAI_TOOLS.items() if key != "tools"}
    with pytest.raises(UserError) as caught:
        ChatTokenizer(family_tokenizer("llama3"), 4096, model="meta-llama/Meta-Llama-3-8B-Instruct")(read(tmp_path, record))
    assert str(caught.value) == (
        "training.chat_template: conversation 't' has tool calls, and the chat template of "
        "meta-llama/Meta-Llama-3-8B-Instruct drops them (it writes the conversation the same without them); set "
        "training.chat_template to a Jinja file that renders tools (the model family's own, as Llama 3.1 and Qwen 2.5 "
        "publish theirs)"
    )
    with pytest.raises(UserError, match="conversation 't' has tool definitions, and the chat template of"):
        ChatTokenizer(family_tokenizer("llama3"), 4096, model="meta-llama/Meta-Llama-3-8B-Instruct")(read(tmp_path, OPENAI_TOOLS))


def test_a_template_that_refuses_tool_messages_names_the_fix_that_writes_them(tmp_path):
    """Mistral's template raises on any role but user and assistant; ChatML is no way out for tools."""
    with pytest.raises(UserError) as caught:
        ChatTokenizer(family_tokenizer("mistral"), 4096, model="mistralai/Mistral-7B-Instruct-v0.2")(read(tmp_path, OPENAI_TOOLS))
    assert str(caught.value) == (
        "training.chat_template: conversation 't': the chat template of mistralai/Mistral-7B-Instruct-v0.2 refuses it: "
        "Conversation roles must alternate user/assistant/user/assistant/...; set training.chat_template to a Jinja "
        "file that renders tools (the model family's own, as Llama 3.1 and Qwen 2.5 publish theirs)"
    )
