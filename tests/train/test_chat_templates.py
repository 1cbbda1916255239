"""training.chat_template: conversations tokenized exactly as apply_chat_template writes them, with
labels on the assistant's part only, for the published templates of Llama 3, Llama 3.1, Mistral, Gemma,
Qwen 2.5 and Phi-3 (tests/train/published_templates.py), a Jinja file with {% generation %} marks, and
templates whose assistant part cannot be found exactly."""

from __future__ import annotations

import pytest

from jobgen.errors import UserError
from jobgen.job.conversations import Conversation
from jobgen.train.chat_template import CHATML
from jobgen.train.data import IGNORE_INDEX, ChatTokenizer
from jobgen.train.trainer import check_chat_template, template_digest
from tests.train.published_templates import CLOSING, FAMILIES, family_tokenizer

ONE_ROUND = Conversation("one", None, (("user", "What is two plus two?"), ("assistant", "Two plus two is four.")))
TWO_ROUNDS = Conversation("two", None, (
    ("user", "Name a colour."), ("assistant", "Red."),
    ("user", "Another one?"), ("assistant", " Blue, like the sky.\n"),  # Llama 3 and Gemma trim it
))
WITH_SYSTEM = Conversation("sys", "Be brief.", (("user", "Hello there"), ("assistant", "Hello.")))


def messages(conversation: Conversation) -> list[dict]:
    system = [{"role": "system", "content": conversation.system}] if conversation.system is not None else []
    return system + [{"role": role, "content": text} for role, text in conversation.turns]


def learned_runs(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The learned tokens, one list per contiguous run."""
    runs: list[list[int]] = []
    previous = False
    for token, label in zip(ids, labels):
        learned = label != IGNORE_INDEX
        if learned:
            assert label == token  # a label is the token itself or not learned
            if not previous:
                runs.append([])
            runs[-1].append(token)
        previous = learned
    return runs


def expected_answers(family: str, conversation: Conversation) -> list[str]:
    """Each assistant message as the family's template writes it: content, then end of turn."""
    trims = family in ("llama3", "llama3.1", "gemma")
    end = FAMILIES[family][4]
    answers = [(text.strip() if trims else text) + end for role, text in conversation.turns if role == "assistant"]
    if conversation.turns[-1][0] == "assistant":  # the conversation's closing is learned where it has one
        answers[-1] += CLOSING.get(family, "")
    return answers


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("conversation", [ONE_ROUND, TWO_ROUNDS, WITH_SYSTEM], ids=lambda c: c.id)
def test_ids_are_apply_chat_template_and_labels_only_the_assistant_part(family, conversation):
    tokenizer = family_tokenizer(family)
    if family in ("mistral", "gemma") and conversation.system is not None:
        pytest.skip("these templates refuse a system message (test_a_template_that_refuses_a_record_is_one_line)")
    chat = ChatTokenizer(tokenizer, max_length=4096)
    assert chat.chat_template == tokenizer.chat_template  # the tokenizer's own, by default
    ids, labels = chat(conversation)

    assert ids == list(tokenizer.apply_chat_template(messages(conversation), tokenize=True)["input_ids"])
    answers = expected_answers(family, conversation)
    runs = learned_runs(ids, labels)
    assert [tokenizer.decode(run) for run in runs] == answers
    # token by token: each run is exactly the answer's own tokens, where the rendered text has them
    assert runs == [tokenizer(answer, add_special_tokens=False)["input_ids"] for answer in answers]


def test_phi3_learns_each_end_of_turn_and_the_eos_only_where_the_conversation_has_it():
    # Phi-3 writes the EOS after the last message when no generation prompt follows, so the
    # conversation up to an earlier answer ends differently from the whole one: it was refused.
    tokenizer = family_tokenizer("phi3")
    ids, labels = ChatTokenizer(tokenizer, 4096, "tokenizer", model="microsoft/Phi-3-mini-4k-instruct")(TWO_ROUNDS)
    assert ids == list(tokenizer.apply_chat_template(messages(TWO_ROUNDS), tokenize=True)["input_ids"])
    assert tokenizer.decode(ids) == (
        "<|user|>\nName a colour.<|end|>\n<|assistant|>\nRed.<|end|>\n<|user|>\nAnother one?<|end|>\n"
        "<|assistant|>\n Blue, like the sky.\n<|end|>\n<|endoftext|>"
    )
    tokens = tokenizer.convert_ids_to_tokens(ids)
    learned = [token for token, label in zip(tokens, labels) if label != IGNORE_INDEX]
    first, second = (tokenizer.convert_ids_to_tokens(tokenizer(answer, add_special_tokens=False)["input_ids"])
                     for answer in ("Red.<|end|>\n", " Blue, like the sky.\n<|end|>\n<|endoftext|>"))
    assert learned == first + second  # token by token; the EOS once, after the last answer
    assert tokens.count("<|endoftext|>") == 1 and labels[tokens.index("<|endoftext|>")] != IGNORE_INDEX


def test_qwen_writes_its_default_system_prompt_and_it_is_not_learned():
    tokenizer = family_tokenizer("qwen2.5")
    ids, labels = ChatTokenizer(tokenizer, 4096)(ONE_ROUND)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nTwo plus two is four.<|im_end|>\n"
    )
    assert tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX]) == "Two plus two is four.<|im_end|>\n"


def test_chatml_is_the_default_without_a_template_and_chosen_by_name():
    plain = family_tokenizer("qwen2.5", template=None)
    assert ChatTokenizer(plain, 64).chat_template == CHATML
    assert ChatTokenizer(family_tokenizer("llama3"), 64, "chatml").chat_template == CHATML
    with pytest.raises(UserError, match="training.chat_template is tokenizer, but the tokenizer of m has no chat "
                                        "template; set training.chat_template: chatml"):
        ChatTokenizer(plain, 64, "tokenizer", model="m")


def test_chatml_keeps_the_old_layout_and_system_prompt(tmp_path):
    tokenizer = family_tokenizer("qwen2.5")
    ids, labels = ChatTokenizer(tokenizer, 4096, "chatml")(ONE_ROUND)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    learned = tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])
    assert learned == "<|im_start|>Two plus two is four.<|im_end|>\n"


GENERATION_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_jinja_file_with_generation_marks_learns_what_it_marks(tmp_path):
    path = tmp_path / "marked.jinja"
    path.write_text(GENERATION_MARKED)
    tokenizer = family_tokenizer("qwen2.5")
    chat = ChatTokenizer(tokenizer, 4096, str(path))
    assert chat.chat_template == GENERATION_MARKED
    ids, labels = chat(TWO_ROUNDS)
    assert ids == list(tokenizer.apply_chat_template(messages(TWO_ROUNDS), chat_template=GENERATION_MARKED,
                                                     tokenize=True)["input_ids"])
    assert [tokenizer.decode(run) for run in learned_runs(ids, labels)] == ["Red.<|im_end|>", " Blue, like the sky.\n<|im_end|>"]


def test_a_missing_jinja_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"training.chat_template: '.*nope.jinja' is not a file; expected tokenizer, chatml"):
        ChatTokenizer(family_tokenizer("qwen2.5"), 64, str(tmp_path / "nope.jinja"))


def test_an_assistant_part_that_cannot_be_found_exactly_names_the_model_and_the_fix():
    # The last answer is written with a closing mark the earlier ones lack (as templates that
    # drop earlier reasoning do): rendering prefixes cannot find the part exactly.
    last_differs = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% if loop.last %}{{ ' <end>' }}{% endif %}"
        "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tokenizer = family_tokenizer("llama3", template=last_differs)
    with pytest.raises(UserError) as caught:
        ChatTokenizer(tokenizer, 4096, model="my-org/odd-model")(TWO_ROUNDS)
    assert str(caught.value) == (
        "training.chat_template: conversation 'two': the assistant's part cannot be found exactly in the chat "
        "template of my-org/odd-model (the text before message 1 is written differently when more of the conversation follows); "
        "set training.chat_template: chatml, or a Jinja file whose assistant part is marked with {% generation %}"
    )


def test_a_token_across_the_boundary_is_not_guessed():
    # No space between the header and the answer: "A" and the answer's first letters merge into one token.
    glued = "{% for m in messages %}{{ m['role'][0] | upper }}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A{% endif %}"
    tokenizer = family_tokenizer("llama3", template=glued)
    answer = Conversation("glued", None, (("user", "Hello there"), ("assistant", "nother one")))
    assert "Another" in tokenizer.convert_ids_to_tokens(tokenizer("UHello thereAnother one")["input_ids"])
    with pytest.raises(UserError, match="conversation 'glued': the assistant's part cannot be found exactly .*a token spans"):
        ChatTokenizer(tokenizer, 4096, model="m")(answer)


def test_a_template_that_refuses_a_record_is_one_line():
    with pytest.raises(UserError) as caught:
        ChatTokenizer(family_tokenizer("gemma"), 4096, model="google/gemma-7b-it")(WITH_SYSTEM)
    assert str(caught.value) == (
        "training.chat_template: conversation 'sys': the chat template of google/gemma-7b-it refuses it: System role "
        "not supported; set training.chat_template: chatml to train it in ChatML"
    )


def test_truncation_cuts_ids_and_labels_alike():
    ids, labels = ChatTokenizer(family_tokenizer("llama3"), 8)(TWO_ROUNDS)
    assert len(ids) == len(labels) == 8


def test_a_checkpoint_resumes_only_in_the_layout_it_trained_in():
    llama = ChatTokenizer(family_tokenizer("llama3"), 64, model="meta-llama/Meta-Llama-3-8B-Instruct")
    chatml = ChatTokenizer(family_tokenizer("llama3"), 64, "chatml")
    written_before_templates: dict = {}  # no chat_template recorded: trained in ChatML
    check_chat_template(written_before_templates, chatml, "step-000010")
    check_chat_template({"chat_template": template_digest(llama.chat_template)}, llama, "step-000010")
    with pytest.raises(UserError) as caught:
        check_chat_template(written_before_templates, llama, "step-000010")
    assert str(caught.value) == (
        "training.chat_template: checkpoint step-000010 was trained in ChatML, this job trains in the chat template "
        "of meta-llama/Meta-Llama-3-8B-Instruct; set training.chat_template: chatml to resume, or use a new "
        "training.output_dir to start in the new layout"
    )


def test_a_run_in_the_models_template_saves_it_with_the_model(tools, tiny, tmp_path):
    """The tiny tokenizer has ChatML's tokens; trained in Qwen 2.5's template, its final tokenizer
    carries that template, so inference writes conversations as training did."""
    from transformers import AutoTokenizer

    from tests.train.published_templates import QWEN25

    template = tmp_path / "qwen2.5.jinja"
    template.write_text(QWEN25)
    job = tools.write_job(tmp_path / "run", tiny, chat_template=str(template), max_steps=2)
    result = tools.train(job, nproc=1)
    assert result.returncode == 0, result.stdout
    assert f"chat template: the chat template in {template}" in result.stdout
    assert AutoTokenizer.from_pretrained(job.parent / "output" / "final").chat_template == QWEN25


def test_an_assistant_message_of_weight_0_is_in_the_ids_but_not_learned(tmp_path):
    first_not_learned = Conversation("w", None, TWO_ROUNDS.turns, unlearned=(1,))
    for family in ("llama3", "qwen2.5"):
        tokenizer = family_tokenizer(family)
        chat = ChatTokenizer(tokenizer, 4096)
        ids, labels = chat(first_not_learned)
        assert ids == chat(TWO_ROUNDS)[0]
        assert [tokenizer.decode(run) for run in learned_runs(ids, labels)] == expected_answers(family, TWO_ROUNDS)[1:]
    tokenizer = family_tokenizer("qwen2.5")
    ids, labels = ChatTokenizer(tokenizer, 4096, "chatml")(first_not_learned)
    assert [tokenizer.decode(run) for run in learned_runs(ids, labels)] == ["<|im_start|>", " Blue, like the sky.\n<|im_end|>\n"]
    path = tmp_path / "marked.jinja"
    path.write_text(GENERATION_MARKED)
    ids, labels = ChatTokenizer(tokenizer, 4096, str(path))(first_not_learned)
    assert [tokenizer.decode(run) for run in learned_runs(ids, labels)] == [" Blue, like the sky.\n<|im_end|>"]
