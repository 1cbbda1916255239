"""Which chat template a job trains in, and where a Jinja template puts the assistant's words.

`training.chat_template` resolves (resolve_template) to CHATML, jobgen's own ChatML layout
(jobgen.train.data), or to the text of a Jinja template: the tokenizer's own (`tokenizer`, the
default where the tokenizer has one) or a file's. A conversation in a Jinja template is the
token sequence of `tokenizer.apply_chat_template(messages)`, and the learned tokens are the
assistant's part of it (assistant_spans):
- where the template marks that part with `{% generation %}`, the mask transformers returns for
  it (`return_assistant_tokens_mask`);
- else the part is found by rendering prefixes, as a Hugging Face user would: assistant message i
  starts where the conversation up to it, rendered with the generation prompt, ends, and ends where
  the conversation up to and including it ends, less a closing the template writes only at the end
  of a conversation (Phi-3's EOS, where no generation prompt follows): the tokens that rendering
  shares with the whole conversation, as axolotl finds them, where the rest is exactly the tokens
  the whole conversation ends with. The first rendering must be a prefix of the whole
  conversation's text, and each one's tokens a prefix of its tokens (no token across a boundary);
  where either fails, the part cannot be found exactly and NotExact says so, rather than a guess.
  The ids are apply_chat_template's in every case.
"""

from __future__ import annotations

import os
import re
from typing import AbstractSet, Any, Optional, Sequence

from jobgen.errors import UserError

CHATML = "chatml"  # jobgen's built-in layout, in place of a template text
TOKENIZER = "tokenizer"
# ChatML as a Jinja template, with jobgen's default system prompt: saved with a model trained in
# ChatML, so that inference writes conversations as training did.
CHATML_JINJA = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class NotExact(Exception):
    """The assistant's part of a conversation cannot be found exactly in this template."""


def tokenizer_template(tokenizer: Any) -> Optional[str]:
    """The tokenizer's own default chat template, or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: transformers uses "default"
        template = template.get("default")
    return template or None


def resolve_template(tokenizer: Any, setting: Optional[str], model: str) -> tuple[str, str]:
    """(CHATML or a Jinja template's text, how to name it in a log line) for `training.chat_template`
    (None: the tokenizer's own where it has one, else ChatML). Raises UserError."""
    own = tokenizer_template(tokenizer)
    if setting is None:
        return (own, f"the chat template of {model}") if own else (CHATML, "ChatML (the tokenizer has no chat template)")
    if setting == CHATML:
        return CHATML, "ChatML"
    if setting == TOKENIZER:
        if not own:
            raise UserError(
                f"training.chat_template is tokenizer, but the tokenizer of {model} has no chat template; "
                "set training.chat_template: chatml, or a path to a Jinja file"
            )
        return own, f"the chat template of {model}"
    return read_template_file(setting), f"the chat template in {setting}"


def read_template_file(path: str) -> str:
    if not os.path.isfile(path):
        raise UserError(
            f"training.chat_template: {path!r} is not a file; expected tokenizer, chatml or the path of a Jinja file"
        )
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"training.chat_template: cannot read {path!r}: {exc}") from None
    if not text.strip():
        raise UserError(f"training.chat_template: {path} is empty")
    return text


def has_generation_marks(template: str) -> bool:
    return bool(GENERATION_MARK.search(template))


def render(tokenizer: Any, template: str, messages: Sequence[dict], generation_prompt: bool = False,
           tools: Optional[list] = None) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, chat_template=template, tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    """The ids of rendered text as apply_chat_template makes them (the template writes any BOS)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def marked_spans(tokenizer: Any, template: str, messages: Sequence[dict],
                 skip: AbstractSet[int] = frozenset(), tools: Optional[list] = None) -> tuple[list[int], list[bool]]:
    """(ids, learned) from the template's `{% generation %}` marks; the marked runs of the
    assistant messages in `skip` (indices into `messages`) are not learned. `tools`: the
    function definitions, as apply_chat_template takes them."""
    out = tokenizer.apply_chat_template(
        list(messages), tools=tools, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    learned = [bool(m) for m in out["assistant_masks"]]
    if skip:
        runs = [i for i in range(len(learned)) if learned[i] and (i == 0 or not learned[i - 1])]
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(runs) != len(assistants):
            raise NotExact("its marked parts are not one per assistant message, so a message of weight 0 cannot be told apart")
        for start, index in zip(runs, assistants):
            if index in skip:
                end = start
                while end < len(learned) and learned[end]:
                    learned[end] = False
                    end += 1
    return list(out["input_ids"]), learned


def rendered_spans(tokenizer: Any, template: str, messages: Sequence[dict],
                   skip: AbstractSet[int] = frozenset(), tools: Optional[list] = None) -> tuple[list[int], list[bool]]:
    """(ids, learned) with each assistant message's part found by rendering prefixes (module
    docstring); every rendering gets the same `tools`. An assistant message of tool calls is
    learned like any other; a tool result is not."""
    text = render(tokenizer, template, messages, tools=tools)
    ids = encode(tokenizer, text)
    learned = [False] * len(ids)
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index in skip:
            continue
        try:
            before = render(tokenizer, template, messages[:index], generation_prompt=True, tools=tools)
            through = render(tokenizer, template, messages[: index + 1], tools=tools)
        except Exception as exc:  # a template may refuse a conversation that ends early
            raise NotExact(f"rendering the conversation up to message {index} failed: {exc}") from None
        start = _token_boundary(tokenizer, ids, text, before, f"the text before message {index}")
        end = _end_of_message(tokenizer, ids, text, through, index)
        if end <= start:
            raise NotExact(f"message {index} renders as no text of its own")
        learned[start:end] = [True] * (end - start)
    return ids, learned


def _end_of_message(tokenizer: Any, ids: list[int], text: str, through: str, index: int) -> int:
    """Where assistant message `index` ends in `ids`: the end of `through` (the conversation up to
    and including it), less the closing a template writes only at the end of a conversation (Phi-3's
    EOS, written when no generation prompt follows). Found as the tokens `through` shares with the
    whole conversation; the rest must be exactly the tokens the whole conversation ends with (the
    same closing), else the message itself is written differently and NotExact says so. Where the
    whole conversation has the closing (its last message), it is inside `through`, so learned."""
    if text.startswith(through):
        return _token_boundary(tokenizer, ids, text, through, f"message {index}")
    own = encode(tokenizer, through)
    shared = 0
    while shared < min(len(own), len(ids)) and own[shared] == ids[shared]:
        shared += 1
    closing = own[shared:]
    if not closing or ids[len(ids) - len(closing):] != closing:
        raise NotExact(f"message {index} is written differently when more of the conversation follows")
    return shared


def _token_boundary(tokenizer: Any, ids: list[int], text: str, prefix: str, what: str) -> int:
    """How many of `ids` spell exactly `prefix`, the start of `text`; NotExact if no whole tokens do."""
    if not text.startswith(prefix):
        raise NotExact(f"{what} is written differently when more of the conversation follows")
    head = encode(tokenizer, prefix)
    if ids[: len(head)] != head:
        raise NotExact(f"a token spans the end of {what}")
    return len(head)
