"""A tiny random causal LM, its tokenizer and synthetic conversations, built locally.

    python -m jobgen.train.tiny DIR [--conversations N] [--hidden-size 64] [--layers 2]

writes `DIR/model/` (a Llama-architecture model with random weights, saved with `save_pretrained`,
and a byte-level BPE tokenizer with the chat special tokens, saved beside it) and `DIR/data.json`
(N synthetic conversations). Everything is deterministic and nothing is downloaded; tests, the
benchmark and the README demo use it in place of a real model.
"""

from __future__ import annotations

import argparse
import json
import os
import random

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the model learns to answer short questions about numbers colours animals and places with "
    "one clear sentence while the user asks again in other words"
).split()
_COLOURS = ["red", "green", "blue", "yellow", "black", "white"]
_ANIMALS = ["cat", "dog", "owl", "fox", "horse", "whale"]


def synthetic_conversations(count: int, seed: int = 0) -> list[dict]:
    """`count` conversations in the training-data format, the same for the same arguments."""
    rng = random.Random(seed)
    items = []
    for index in range(count):
        turns = []
        if index % 5 == 0:
            turns.append({"from": "system", "value": "You answer in one sentence."})
        for _ in range(1 + index % 3):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            kind = rng.randrange(3)
            if kind == 0:
                question, answer = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
            elif kind == 1:
                animal, colour = rng.choice(_ANIMALS), rng.choice(_COLOURS)
                question, answer = f"What colour is the {animal}?", f"The {animal} is {colour}."
            else:
                filler = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 30)))
                question, answer = f"Say something about {filler}.", f"Here is something: {filler}."
            turns += [{"from": "user", "value": question}, {"from": "assistant", "value": answer}]
        items.append({"id": f"tiny-{index:05d}", "conversations": turns})
    return items


def build_tokenizer(corpus: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def build(directory: str, conversations: int = 64, hidden_size: int = 64, layers: int = 2, vocab_size: int = 384) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    items = synthetic_conversations(conversations)
    corpus = [turn["value"] for item in items for turn in item["conversations"]] + ["user\n", "assistant\n", "system\n"]
    tokenizer = build_tokenizer(corpus, vocab_size)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    model_dir = os.path.join(directory, "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with open(os.path.join(directory, "data.json"), "w", encoding="utf-8") as handle:
        json.dump(items, handle, indent=1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jobgen.train.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    build(args.directory, args.conversations, args.hidden_size, args.layers)
    print(f"wrote {os.path.join(args.directory, 'model')} and {os.path.join(args.directory, 'data.json')}")


if __name__ == "__main__":
    main()
