"""Evaluation on a held-out set: eval_fraction held out record by record by seed, the loss every eval_interval
steps in metrics.jsonl, token-weighted over all ranks: the loss of the same conversations under
the final model, computed here on one process."""

from __future__ import annotations

import json

import numpy
import torch

from jobgen.job.conversations import load_conversations
from jobgen.train.data import IGNORE_INDEX, ChatTokenizer
from jobgen.train.evaluation import held_out, held_out_mask
from jobgen.train.modeling import load_tokenizer


def test_the_held_out_set_is_a_function_of_each_record_s_index_and_the_seed():
    """No count of the data is needed: chunks of a stream decide as the whole does."""
    whole = held_out_mask(0, 10_000, 0.1, seed=42)
    assert 900 < whole.sum() < 1100
    chunks = [held_out_mask(first, 700, 0.1, seed=42) for first in range(0, 10_000, 700)]
    assert (numpy.concatenate(chunks)[:10_000] == whole).all()
    assert [held_out(i, 0.1, 42) for i in range(200)] == whole[:200].tolist()
    assert (held_out_mask(0, 10_000, 0.1, seed=43) != whole).any()
    assert not held_out_mask(0, 1000, 0.0, seed=42).any() and held_out_mask(0, 1000, 1.0, seed=42).all()


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

    held = [c for i, c in enumerate(load_conversations(str(tiny / "data.json"))) if held_out(i, 0.25, 42)]
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


def test_an_eval_run_stopped_and_resumed_evaluates_as_the_uninterrupted_one(tools, tiny, tmp_path):
    """The held-out set comes from the store at each start: the same conversations, the same
    losses, and the same final adapter, bit for bit."""
    import signal

    fields = {"eval_fraction": 0.25, "eval_interval": 2, "save_interval": 2, "max_steps": 6, "max_length": 96}
    straight = tools.write_job(tmp_path / "straight", tiny, **fields)
    done = tools.train(straight)
    assert done.returncode == 0, done.stdout
    interrupted = tools.write_job(tmp_path / "interrupted", tiny, **fields)
    proc = tools.start(interrupted, JOBGEN_DEBUG_STEP_DELAY="0.4")
    tools.wait_for_step(interrupted.parent / "output" / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    first_log = proc.communicate(timeout=120)[0]
    resumed = tools.train(interrupted)
    assert resumed.returncode == 0, first_log + resumed.stdout
    assert "resumed from" in resumed.stdout and "found, preparation skipped" in resumed.stdout
    held = sum(held_out(i, 0.25, 42) for i in range(len(load_conversations(str(tiny / "data.json")))))
    assert f"data: eval set {held} conversations" in resumed.stdout

    def evaluations(run) -> dict:
        lines = (run.parent / "output" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: (r["eval_loss"], r["eval_tokens"]) for r in map(json.loads, lines) if "eval_loss" in r}

    # The step the stop came at saves without evaluating: every other evaluation is the same.
    resumed_evaluations = evaluations(interrupted)
    assert sorted(evaluations(straight)) == [2, 4, 6] and 6 in resumed_evaluations
    assert resumed_evaluations.items() <= evaluations(straight).items()
    assert tools.adapter_weights(straight.parent / "output").keys() == tools.adapter_weights(interrupted.parent / "output").keys()
    for name, tensor in tools.adapter_weights(straight.parent / "output").items():
        assert torch.equal(tensor, tools.adapter_weights(interrupted.parent / "output")[name]), name
