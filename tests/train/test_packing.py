"""training.packing: several conversations per row, each attending only to itself, with the loss
and gradients of the same conversations unpacked, and an exact resume of a packed run."""

from __future__ import annotations

import json
import math
import random
import signal
from collections import Counter

import pytest
import torch

from jobgen.job.models import Training
from jobgen.job.conversations import load_conversations
from jobgen.train.data import BatchOrder, ChatTokenizer, MicroBatches, TokenizedDataset, pack_rows
from jobgen.train.modeling import load_model, load_tokenizer
from jobgen.train.trainer import _token_loss_sum


def _dataset(tiny, max_length=256):
    tokenizer = load_tokenizer(str(tiny / "model"))
    chat = ChatTokenizer(tokenizer, max_length)
    return TokenizedDataset(load_conversations(str(tiny / "data.json")), chat, tokenizer.pad_token_id)


def _qwen2_copy(tiny, folder):
    """The tiny model's tokenizer with a Qwen2-architecture model of the same size."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss_sum = _token_loss_sum(model, batch)
    tokens = int((batch["labels"][:, 1:] != -100).sum())
    (loss_sum / tokens).backward()
    return float(loss_sum.detach()), tokens, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("architecture,attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_packed_loss_and_gradients_equal_unpacked(tiny, tmp_path, architecture, attention):
    """The model as the trainer loads it (full fine-tune, fp32 on the CPU), the trainer's loss."""
    model_path = str(tiny / "model") if architecture == "llama" else _qwen2_copy(tiny, tmp_path / "qwen2")
    training = Training(model=model_path, data=str(tiny / "data.json"), method="full", precision="fp32")
    model = load_model(training, "fp32", torch.device("cpu"))
    model.set_attn_implementation(attention)
    dataset = _dataset(tiny)
    samples = list(range(16))
    rows = pack_rows([dataset.lengths[i] for i in samples], 256, seed=3)
    assert len(rows) < len(samples) and any(len(row) >= 3 for row in rows)  # really packed

    unpacked = _loss_and_grads(model, dataset.collate(samples))
    packed = _loss_and_grads(model, dataset.collate_packed(rows))
    assert packed[1] == unpacked[1]  # the same labelled tokens: the loss is normalised the same way
    assert packed[0] == pytest.approx(unpacked[0], rel=1e-5)
    assert packed[2].keys() == unpacked[2].keys() and len(packed[2]) > 10
    for name, grad in unpacked[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # The same rows with positions running on across conversations let them attend to each other.
    leaky = dataset.collate_packed(rows)
    leaky["position_ids"] = torch.arange(leaky["input_ids"].size(1)).expand_as(leaky["input_ids"])
    loss, _, grads = _loss_and_grads(model, leaky)
    assert loss != pytest.approx(unpacked[0], rel=1e-5)
    assert not all(torch.allclose(grads[n], g, rtol=1e-4, atol=1e-6) for n, g in unpacked[2].items())


def test_packed_rows_fit_and_cover_every_sample_once_per_epoch():
    rng = random.Random(0)
    # Mostly short conversations with a long tail, as chat data is.
    lengths = [min(511, int(rng.lognormvariate(4.5, 0.8))) + 1 for _ in range(1001)]
    rows = pack_rows(lengths, 512, seed=7)
    assert rows == pack_rows(lengths, 512, seed=7)  # a pure function, of no world size
    assert sorted(i for row in rows for i in row) == list(range(1001))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    assert sum(lengths) / (512 * len(rows)) > 0.95  # nearly full rows

    order = BatchOrder(len(rows), 12, seed=7)
    for epoch in (0, 1):
        ranks = [MicroBatches(None, order, 4, r, 3, 1, rows) for r in range(4)]
        seen = Counter(i for b in ranks for k in range(order.steps_per_epoch) for i in b.samples(b.units(epoch, k, 0)))
        assert sorted(seen) == list(range(1001)) and set(seen.values()) == {1}
    assert order.step(0, 0) != order.step(1, 0)  # rows are reshuffled every epoch


STEPS = 7  # 48 conversations in 20 rows of <= 256 tokens / (2 ranks x 2 rows): 5 steps per epoch; max_steps 7


@pytest.fixture(scope="module")
def packed_runs(tiny, tools, tmp_path_factory):
    """Packed, epochs: 1 with max_steps past it: an uninterrupted run, and one stopped and resumed."""
    root = tmp_path_factory.mktemp("packed")
    settings = dict(packing=True, max_length=256, gradient_accumulation=1, epochs=1, max_steps=STEPS, save_interval=100)
    straight = tools.write_job(root / "straight", tiny, **settings)
    done = tools.train(straight, JOBGEN_DEBUG_SAMPLE_LOG="1")
    assert done.returncode == 0, done.stdout
    interrupted = tools.write_job(root / "interrupted", tiny, **settings)
    proc = tools.start(interrupted, JOBGEN_DEBUG_STEP_DELAY="0.4", JOBGEN_DEBUG_SAMPLE_LOG="1")
    tools.wait_for_step(interrupted.parent / "output" / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)
    first_log = proc.communicate(timeout=120)[0]
    stopped = tools.exit_report(interrupted.parent)
    resumed = tools.train(interrupted, JOBGEN_DEBUG_SAMPLE_LOG="1")
    assert resumed.returncode == 0, first_log + resumed.stdout
    return {"straight": straight.parent, "interrupted": interrupted.parent, "stopped": stopped,
            "completed": tools.exit_report(interrupted.parent), "log": done.stdout}


def test_packed_run_stopped_and_resumed_ends_bitwise_equal(packed_runs, tools):
    stopped, completed = packed_runs["stopped"], packed_runs["completed"]
    assert stopped["reason"] == "stopped" and 3 <= stopped["last_step"] < STEPS
    assert (completed["first_step"], completed["last_step"]) == (stopped["last_step"], STEPS)
    straight = tools.adapter_weights(packed_runs["straight"] / "output")
    resumed = tools.adapter_weights(packed_runs["interrupted"] / "output")
    assert straight.keys() == resumed.keys() and straight
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert any(straight[k].abs().sum() > 0 for k in straight if "lora_B" in k)


def test_packed_run_sees_every_sample_once_per_epoch_and_cycles_to_max_steps(packed_runs):
    assert f"{STEPS} steps (5 per epoch)" in packed_runs["log"]
    expected = {f"tiny-{i:05d}" for i in range(48)}
    for run in ("straight", "interrupted"):
        seen: dict[int, Counter] = {}
        for rank_log in (packed_runs[run] / "output").glob("samples-rank*.jsonl"):
            for line in rank_log.read_text().splitlines():
                record = json.loads(line)
                seen.setdefault(record["epoch"], Counter()).update(record["ids"])
        assert sorted(seen) == [0, 1]  # epochs: 1, but max_steps cycles the data
        assert set(seen[0]) == expected and set(seen[0].values()) == {1}, run
        assert set(seen[1]) < expected and set(seen[1].values()) == {1}, run  # steps 6-7: part of the second pass
    metrics = [json.loads(l) for l in (packed_runs["straight"] / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert metrics[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ends at max_steps
    assert metrics[3]["lr"] == pytest.approx(2e-4 * 0.5 * (1 + math.cos(math.pi * 4 / STEPS)), rel=1e-9)  # step 4
