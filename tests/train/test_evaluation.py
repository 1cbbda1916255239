"""Evaluation on a held-out set: eval_fraction held out by seed, the loss every eval_interval
steps in metrics.jsonl, token-weighted over all ranks: the loss of the same conversations under
the final model, computed here on one process."""

from __future__ import annotations

import json

import torch

from jobgen.job.conversations import load_conversations
from jobgen.train.data import IGNORE_INDEX, ChatTokenizer
from jobgen.train.evaluation import split_eval
from jobgen.train.modeling import load_tokenizer


def test_the_held_out_set_is_a_pure_function_of_the_data_and_seed(tiny):
    conversations = load_conversations(str(tiny / "data.json"))
    train, held = split_eval(conversations, 0.1, seed=42)
    assert len(held) == 5 and len(train) == 43  # 4.8 rounded up
    assert {c.id for c in train}.isdisjoint(c.id for c in held)
    assert split_eval(conversations, 0.1, seed=42) == (train, held)
    assert split_eval(conversations, 0.1, seed=43)[1] != held


def held_out_loss(tiny, adapter, held, max_length: int, with_tokens: bool = False):
    """The token-weighted loss of the `held` conversations under the tiny model with `adapter`,
    computed here on one process (and the tokens it is over)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    chat = ChatTokenizer(load_tokenizer(str(tiny / "model")), max_length)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), adapter)
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for conversation in held:
            ids, labels = chat(conversation)
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            target = torch.tensor(labels[1:])
            total += float(torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum"))
            tokens += int((target != IGNORE_INDEX).sum())
    return (total / tokens, tokens) if with_tokens else total / tokens


def test_eval_loss_is_token_weighted_over_all_ranks(tools, tiny, tmp_path):
    job = tools.write_job(tmp_path / "run", tiny, eval_fraction=0.25, eval_interval=2, max_steps=4, max_length=96)
    result = tools.train(job)
    assert result.returncode == 0, result.stdout
    records = [json.loads(line) for line in (job.parent / "output" / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if "eval_loss" in r}
    assert sorted(evaluated) == [2, 4]
    assert "eval at step 4: loss" in result.stdout

    _, held = split_eval(load_conversations(str(tiny / "data.json")), 0.25, seed=42)
    loss, tokens = held_out_loss(tiny, job.parent / "output" / "final", held, 96, with_tokens=True)
    assert evaluated[4]["eval_tokens"] == tokens
    assert abs(evaluated[4]["eval_loss"] - loss) < 1e-4

    # What `jobgen status` prints under the segments (this run has no scheduler's run directory).
    from jobgen.rundir.metrics import last_eval
    from jobgen.rundir.outcome import _eval_of, format_lines

    newest = _eval_of(last_eval(job.parent, {"training": {"output_dir": "output"}}))
    report = {"run_dir": str(job.parent), "segments": [], "probe": None, "step": 4, "total_steps": 4,
              "last_loss": records[-1]["loss"], "last_eval": newest}
    assert (f"last eval loss {evaluated[4]['eval_loss']:.4f}, perplexity {evaluated[4]['eval_perplexity']:.2f} "
            "at step 4") in format_lines(report)
