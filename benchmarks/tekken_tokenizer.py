"""A real published tokenizer without the hub: Mistral's Tekken (Mistral NeMo's, 131k byte-level BPE),
from the file the `mistral-common` package ships, as a Hugging Face tokenizer folder.

    pip download --no-deps mistral-common -d DIR && unzip -o DIR/mistral_common-*.whl 'mistral_common/data/*' -d DIR
    python benchmarks/tekken_tokenizer.py DIR/mistral_common/data/tekken_240911.json OUT

`benchmarks/data_prepare.py --tokenizer OUT` then tokenizes with it: a modern large-vocabulary
tokenizer (a regex pre-tokenizer and byte-level BPE, as Llama 3's and Qwen's), where the tiny
model's 384-token one splits every word into several tokens. The ids are the file's ranks (the
1,000 control tokens Mistral puts first are left out) plus ChatML's special tokens; the text's
split into tokens is Tekken's.
"""

from __future__ import annotations

import base64
import json
import sys


def main(tekken_json: str, out: str) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with open(tekken_json, encoding="utf-8") as handle:
        tekken = json.load(handle)
    size = tekken["config"]["default_vocab_size"] - tekken["config"]["default_num_special_tokens"]
    ranks = {base64.b64decode(entry["token_bytes"]): entry["rank"] for entry in tekken["vocab"][:size]}

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(_: str) -> dict[bytes, int]:
            return ranks

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Converter(vocab_file=tekken_json, pattern=tekken["config"]["pattern"], extra_special_tokens=specials).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=specials[1:])
    tokenizer.save_pretrained(out)
    print(f"{out}: {len(tokenizer)} tokens; {tokenizer.tokenize('The gradient of 12345 checkpoints, resumed.')}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
