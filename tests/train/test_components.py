"""The trainer's components on their own: chat layout, batch order, LR shapes, stop flag, exit file."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest

from jobgen.errors import UserError
from jobgen.job.conversations import load_conversations
from jobgen.train.data import IGNORE_INDEX, BatchOrder, ChatTokenizer, MicroBatches, TokenizedDataset, split_global_batch
from jobgen.train.exit_report import ExitReport, write_exit_report
from jobgen.train.stop import StopRequest
from jobgen.train.schedule import LRFactor


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny / "model")


def _conversation(tmp_path, turns):
    path = tmp_path / "one.json"
    path.write_text(json.dumps([{"id": "x", "conversations": turns}]))
    return load_conversations(str(path))[0]


def test_chat_layout_and_loss_only_on_assistant_turns(tmp_path, tokenizer):
    conversation = _conversation(tmp_path, [
        {"from": "user", "value": "What is 2 plus 2?"},
        {"from": "assistant", "value": "2 plus 2 is 4."},
        {"from": "user", "value": "And 3 plus 3?"},
        {"from": "assistant", "value": "6."},
    ])
    ids, labels = ChatTokenizer(tokenizer, max_length=512)(conversation)
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n"
        "<|im_start|>assistant\n2 plus 2 is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3 plus 3?<|im_end|>\n"
        "<|im_start|>assistant\n6.<|im_end|>\n"
    )
    learned = tokenizer.decode([t for t, l in zip(ids, labels) if l != IGNORE_INDEX])
    assert learned == "<|im_start|>2 plus 2 is 4.<|im_end|>\n<|im_start|>6.<|im_end|>\n"
    assert all(l in (IGNORE_INDEX, t) for t, l in zip(ids, labels))


def test_truncation_to_max_length(tmp_path, tokenizer):
    conversation = _conversation(tmp_path, [{"from": "user", "value": "a " * 200}, {"from": "assistant", "value": "b"}])
    ids, labels = ChatTokenizer(tokenizer, max_length=16)(conversation)
    assert len(ids) == len(labels) == 16
    # The dataset counts what it cut, for the trainer's warning.
    short = _conversation(tmp_path, [{"from": "user", "value": "a"}, {"from": "assistant", "value": "b"}])
    whole = len(ChatTokenizer(tokenizer, max_length=4096)(conversation)[0])
    chat = ChatTokenizer(tokenizer, max_length=whole - 1)
    assert TokenizedDataset([conversation, short], chat, 0).cut_lengths == [whole]


def _steps(num, global_batch, world, epoch, lengths=None, max_micro=3):
    """Each step's samples as `world` ranks train them: {rank: [units of every accumulation round]}."""
    micro, accumulation = split_global_batch(global_batch, world, max_micro)
    order = BatchOrder(num, global_batch, seed=5, lengths=lengths)
    ranks = [MicroBatches(None, order, world, r, micro, accumulation) for r in range(world)]
    return [[[b.units(epoch, k, m) for m in range(accumulation)] for b in ranks] for k in range(order.steps_per_epoch)]


@pytest.mark.parametrize("lengths", [None, [((i * 37) % 23) + 1 for i in range(40)]])
def test_each_step_trains_the_same_samples_on_any_world_size_and_every_sample_once_per_epoch(lengths):
    """40 samples, 12 per step: 3 whole steps and a short one of 4; on 1 to 4 and on 6 ranks."""
    for epoch in (0, 1):
        by_world = {w: _steps(40, 12, w, epoch, lengths) for w in (1, 2, 3, 4, 6)}
        reference = [sorted(i for rank in step for rounds in rank for i in rounds) for step in by_world[1]]
        assert [len(s) for s in reference] == [12, 12, 12, 4]
        assert sorted(i for s in reference for i in s) == list(range(40))
        for world, steps in by_world.items():
            assert [sorted(i for rank in step for rounds in rank for i in rounds) for step in steps] == reference, world
            assert steps == _steps(40, 12, world, epoch, lengths)  # a pure function
    assert _steps(40, 12, 2, 0, lengths) != _steps(40, 12, 2, 1, lengths)  # every epoch reshuffles


def test_global_batch_is_split_with_the_largest_micro_batch_or_refused_in_one_line():
    assert split_global_batch(12, 2, 3) == (3, 2)
    assert split_global_batch(12, 3, 3) == (2, 2)  # 4 per rank: micro-batches of 3 would not divide it
    assert split_global_batch(12, 1, 3) == (3, 4)
    assert split_global_batch(12, 12, 8) == (1, 1)
    with pytest.raises(UserError) as refused:
        split_global_batch(8, 3, 2, procs_per_node=1)
    assert str(refused.value) == (
        "training.global_batch_size: 8 samples per optimizer step cannot be split evenly over 3 ranks; world sizes "
        "that divide it: 1, 2, 4, 8 (resources.nodes 1, 2, 4, 8 at 1 per node), or set training.global_batch_size "
        "to a multiple of 3"
    )
    with pytest.raises(UserError, match=r"world sizes that divide it: 1, 2, 4, 8, 16 \(resources.nodes 1, 2, 4 at 4 per node\)"):
        split_global_batch(16, 12, 2, procs_per_node=4)
    with pytest.raises(UserError, match=r"divide it: 1, 2, 4, 8 \(none a multiple of 3 processes per node\), or set"):
        split_global_batch(8, 3, 2, procs_per_node=3)


def test_length_grouping_puts_similar_lengths_together():
    lengths = [(i * 7919) % 500 + 1 for i in range(400)]
    grouped = [u for step in _steps(400, 16, 2, 0, lengths, max_micro=8) for rank in step for u in rank]
    plain = [u for step in _steps(400, 16, 2, 0, None, max_micro=8) for rank in step for u in rank]

    def spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)

    assert spread(grouped) < spread(plain) / 3


def test_lr_shapes_follow_transformers():
    cosine, linear, constant = (LRFactor(s, warmup=2, total=10) for s in ("cosine", "linear", "constant"))
    assert [cosine(0), cosine(1), cosine(2)] == [0.0, 0.5, 1.0]
    assert cosine(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5))) and cosine(10) == pytest.approx(0.0)
    assert linear(6) == pytest.approx(0.5) and linear(10) == 0.0
    assert constant(9) == 1.0


def test_stop_request_only_records_the_first_signal():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)}
    try:
        stop = StopRequest().install()
        assert not stop.requested and stop.signal_name is None
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGUSR2"
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_exit_report_is_written_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBGEN_JOB_ID", "123")
    monkeypatch.setenv("JOBGEN_RESTART_COUNT", "2")
    report = ExitReport(reason="stopped", signal="SIGTERM", first_step=3, last_step=7, checkpoint="/c", message="m")
    path = write_exit_report(str(tmp_path), report)
    payload = json.loads(open(path).read())
    assert set(payload) == {"reason", "signal", "first_step", "last_step", "checkpoint", "started_at",
                            "ended_at", "train_seconds", "message", "job_id", "restart", "failure", "nodes"}
    assert payload["reason"] == "stopped" and payload["ended_at"] >= payload["started_at"]
    # The segment it reports on, as segments.jsonl names it, for `jobgen status`.
    assert (payload["job_id"], payload["restart"]) == ("123", 2)
    assert os.listdir(tmp_path) == ["trainer-exit.json"]


def test_model_and_data_resolve_against_cwd_and_output_dir_against_run_dir(tiny, tmp_path, monkeypatch):
    import shutil

    from jobgen.job.models import Job
    from jobgen.train.prepare import prepare

    shutil.copy(tiny / "data.json", tmp_path / "conversations.json")
    monkeypatch.chdir(tmp_path)
    job = Job.model_validate({
        "launch": {"procs_per_node": 2},
        "training": {"model": str(tiny / "model"), "data": "conversations.json", "output_dir": "out",
                     "prepared_cache": "stores"},
    })
    prepared = prepare(job, str(tmp_path / "runs" / "r1"), world_size=2)
    assert prepared.training.data == str(tmp_path / "conversations.json")
    assert prepared.training.prepared_cache == str(tmp_path / "stores")  # as the data: against the working directory
    assert prepared.output_dir == str(tmp_path / "runs" / "r1" / "out")
    assert prepared.ds_config["train_batch_size"] == 2


def test_metrics_writer_writes_jsonl_and_tensorboard(tmp_path, monkeypatch):
    from jobgen.train.metrics import MetricsWriter

    monkeypatch.setenv("JOBGEN_JOB_ID", "123")
    monkeypatch.setenv("JOBGEN_RESTART_COUNT", "2")
    from jobgen.train.trackers import Trackers

    trackers = Trackers(["tensorboard"], str(tmp_path), str(tmp_path), "r1", {})
    writer = MetricsWriter(str(tmp_path), enabled=True, total_steps=4, first_step=0, trackers=trackers)
    writer.write({"step": 1, "loss": 2.0, "lr": 0.1})
    writer.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert {k: record[k] for k in ("step", "loss", "lr", "total_steps")} == {"step": 1, "loss": 2.0, "lr": 0.1, "total_steps": 4}
    assert record["seconds_left"] >= 0  # three more steps at this segment's pace so far
    assert (record["job_id"], record["restart"]) == ("123", 2)  # the segment that wrote it, for `jobgen plot`
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_stop_file_of_the_batch_shell_is_a_stop_request(tmp_path):
    from jobgen.train.stop import STOP_FILE, signal_name

    stop = StopRequest(stop_file=str(tmp_path / STOP_FILE))
    assert not stop.requested
    (tmp_path / STOP_FILE).touch()
    assert stop.requested and stop.signal_name == "stop file" and signal_name(stop.signum) == "stop file"


def test_a_non_finite_loss_ends_the_run_naming_the_kept_checkpoint():
    from jobgen.train.trainer import check_finite

    check_finite(5, [2.5, 0.3, 1e30], "ckpt/step-000004")  # large but finite: trains on
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(RuntimeError, match=r"training diverged at step 5: .* the last checkpoint, ckpt/step-000004, is kept"):
            check_finite(5, [2.5, bad], "ckpt/step-000004")

