"""The prepared data store: the same tokens as the per-rank path, made once, never half-used."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

from jobgen.errors import UserError
from jobgen.job.conversations import load_conversations
from jobgen.job.models import Training
from jobgen.train.data import ChatTokenizer, TokenizedDataset, pack_rows
from jobgen.train.modeling import load_tokenizer
from jobgen.train.node_relay import NodeRelay
from jobgen.train.store import COMPLETE, ensure_store, inputs_for, prepare_once, store_key
from tests.train.conftest import subprocess_env


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny / "model"))


def _training(tiny, **fields) -> Training:
    return Training(**{"model": str(tiny / "model"), "data": str(tiny / "data.json"), "max_length": 128, **fields})


def _reference(training: Training, tokenizer) -> TokenizedDataset:
    chat = ChatTokenizer(tokenizer, training.max_length)
    return TokenizedDataset(load_conversations(training.data), chat, tokenizer.pad_token_id)


def _assert_same(stored, reference) -> None:
    assert stored.lengths == reference.lengths and stored.ids == reference.ids
    assert stored.label_counts == reference.label_counts
    for i in range(len(reference)):
        ids, labels = stored.sample(i)
        assert ids.tolist() == reference.input_ids[i] and labels.tolist() == reference.labels[i], i


@pytest.mark.parametrize("processes,max_length", [(1, 128), (2, 128), (2, 40)])
def test_store_holds_the_tokens_and_labels_of_the_per_rank_path(tiny, tokenizer, tmp_path, processes, max_length):
    training = _training(tiny, max_length=max_length)
    stored, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=processes)
    assert outcome == "prepared" and stored.path.startswith(str(tmp_path / "prepared"))
    reference = _reference(training, tokenizer)
    _assert_same(stored, reference)
    # What a batch is made of, padded and packed, is the same tensors.
    for name, tensor in reference.collate([0, 3, 7]).items():
        assert torch.equal(stored.collate([0, 3, 7])[name], tensor), name
    rows = pack_rows(reference.lengths, 256, seed=1)[:4]
    for name, tensor in reference.collate_packed(rows).items():
        assert torch.equal(stored.collate_packed(rows)[name], tensor), name
    assert stored.packed_rows(256, 1, preparer=True)[:4] == rows


def test_a_second_start_finds_the_store_and_a_change_of_input_makes_another(tiny, tokenizer, tmp_path):
    training = _training(tiny)
    first, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True)
    assert outcome == "prepared"
    again, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=False)
    assert (outcome, again.path) == ("found", first.path)
    # The data's content, not its name or time stamp, is the key.
    copy = tmp_path / "copy.json"
    copy.write_bytes((tiny / "data.json").read_bytes())
    folder = str(tmp_path / "prepared")
    assert store_key(inputs_for(_training(tiny, data=str(copy)), folder)) == os.path.basename(first.path)
    copy.write_text(json.dumps(json.loads(copy.read_text())[:-1]))
    keys = {store_key(inputs_for(t, folder)) for t in (training, _training(tiny, data=str(copy)), _training(tiny, max_length=64),
                                                      _training(tiny, data_format="sharegpt"))}
    assert len(keys) == 4


def test_an_incomplete_store_folder_is_never_used_and_is_made_again(tiny, tokenizer, tmp_path):
    training = _training(tiny)
    key = store_key(inputs_for(training, str(tmp_path / "prepared")))
    broken = tmp_path / "prepared" / key
    broken.mkdir(parents=True)
    (broken / "tokens.int32").write_bytes(b"\0" * 12)  # as if written by hand, without its marker
    stored, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True)
    assert outcome == "prepared" and (broken / COMPLETE).exists()
    _assert_same(stored, _reference(training, tokenizer))


def _prepare_job(tmp_path, tiny, data, **training) -> tuple:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": "prep", "resources": {"nodes": 1, "gpus_per_node": 0}, "launch": {"procs_per_node": 2},
        "training": {"model": str(tiny / "model"), "data": str(data), "max_length": 256, "prepared_cache": "stores", **training},
    }))
    return [sys.executable, "-m", "jobgen.cli", "prepare", str(job), "--site", "none"], subprocess_env()


@pytest.fixture(scope="module")
def big_data(tmp_path_factory):
    """Enough conversations that a preparation takes a few seconds."""
    from jobgen.train.tiny import synthetic_conversations

    path = tmp_path_factory.mktemp("big") / "data.json"
    path.write_text(json.dumps(synthetic_conversations(12_000, seed=1)))
    return path


def test_a_preparation_killed_midway_leaves_no_store_and_the_next_one_makes_it(tiny, tokenizer, tmp_path, big_data):
    command, env = _prepare_job(tmp_path, tiny, big_data)
    stores = tmp_path / "stores"
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (stores.exists() and any(p.name.startswith(".tmp-") for p in stores.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "slow"
        time.sleep(0.05)
    time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p for p in stores.iterdir() if p.is_dir()]
    assert left and all(p.name.startswith(".tmp-") for p in left)  # only the temporary folder: no store

    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "jobgen: prepared " in done.stderr and "tokenized 12000/12000 records (100%)" in done.stderr
    folders = [p for p in stores.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / COMPLETE).exists()  # the leftover is gone
    training = Training(model=str(tiny / "model"), data=str(big_data), max_length=256, prepared_cache=str(stores))
    stored, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=False)
    assert outcome == "found" and stored.path == str(folders[0])
    _assert_same(stored, _reference(training, tokenizer))


def test_two_preparations_at_once_make_one_good_store(tiny, tokenizer, tmp_path, big_data):
    command, env = _prepare_job(tmp_path, tiny, big_data, packing=True)
    procs = [subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    said = sorted("jobgen: prepared /" in out for out in outputs)
    assert said == [False, True], outputs  # one tokenized, the other found its store
    assert any("was prepared already" in out for out in outputs)
    stores = tmp_path / "stores"
    assert [p.name for p in stores.iterdir() if p.name.startswith(".tmp-")] == []
    training = Training(model=str(tiny / "model"), data=str(big_data), max_length=256, prepared_cache=str(stores))
    stored, outcome = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=False)
    reference = _reference(training, tokenizer)
    _assert_same(stored, reference)
    assert stored.packed_rows(256, 42, preparer=False) == pack_rows(reference.lengths, 256, 42)


def test_bad_data_is_one_line_for_the_preparer_and_for_every_waiting_rank(tiny, tokenizer, tmp_path):
    data = tmp_path / "bad.json"
    good = json.loads((tiny / "data.json").read_text())
    data.write_text(json.dumps(good[:3] + [{"id": "x", "conversations": [{"from": "bot", "value": "hi"}]}]))
    training = _training(tiny, data=str(data))
    waiter_error: list[BaseException] = []

    def wait() -> None:
        try:
            ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=False)
        except UserError as exc:
            waiter_error.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    with pytest.raises(UserError, match=r"record 3 \(id 'x'\): conversations\[0\]\.from is 'bot'") as raised:
        ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=1)
    waiting.join(timeout=30)
    assert [str(e) for e in waiter_error] == [str(raised.value)]

    command, env = _prepare_job(tmp_path, tiny, data)
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"jobgen: error: {data}: record 3 (id 'x')")


def test_a_preparers_error_stamped_2_min_behind_this_clock_still_reaches_the_waiting_rank(tmp_path):
    """Another node's preparer fails while this rank waits, and the file server stamps its error
    two minutes behind this node's clock: the rank sees the file appear, so the error is this
    start's (no clock is compared), and it ends with the preparer's line instead of waiting on."""
    target = str(tmp_path / "KEY")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            prepare_once(target, lambda temp: None, preparer=False)
        except UserError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    time.sleep(0.5)
    written = tmp_path / "written-elsewhere"
    written.write_text("data.json: record 3 (id 'x'): conversations[0].from is 'bot'\n")
    os.utime(written, (time.time() - 120, time.time() - 120))
    os.replace(written, target + ".failed")  # as it arrives: whole, with the server's time
    waiting.join(timeout=10)
    assert [str(e) for e in errors] == ["data.json: record 3 (id 'x'): conversations[0].from is 'bot'"]


def test_a_nodes_other_ranks_wait_for_its_local_rank_0_not_on_the_shared_folder(tmp_path, monkeypatch):
    """While a store is prepared, a node's ranks other than its local rank 0 look at the shared
    folder once, then wait on the node's own file, which local rank 0 writes when its own wait
    ends: the shared folder sees one waiting rank per node, not 8. The preparer's error reaches
    them the same way."""
    target, node = str(tmp_path / "shared" / "KEY"), tmp_path / "node-tmp"
    (tmp_path / "shared").mkdir()
    node.mkdir()
    ended: list[object] = []

    def follow(relay_path: str) -> None:
        try:
            ended.append(prepare_once(target, lambda temp: None, preparer=False, relay=NodeRelay(relay_path, leader=False)))
        except UserError as exc:
            ended.append(exc)

    follower = threading.Thread(target=follow, args=(str(node / "relay"),), daemon=True)
    follower.start()
    time.sleep(0.5)
    os.makedirs(os.path.join(target, COMPLETE))  # the preparer on another node is done...
    time.sleep(1.0)
    assert follower.is_alive() and not ended  # ...but this rank waits for its node's leader
    assert prepare_once(target, lambda temp: None, preparer=False, relay=NodeRelay(str(node / "relay"), leader=True)) == "found"
    follower.join(timeout=10)
    assert ended == ["waited"]

    other = str(tmp_path / "shared" / "OTHER")
    monkeypatch.setenv("JOBGEN_JOB_ID", "31")  # the preparer's error names this job segment
    (tmp_path / "shared" / "OTHER.failed").write_text("jobgen segment 31/0\ntraining.data: record 3 is not a conversation\n")
    follower = threading.Thread(target=lambda: ended.append(
        _raised(lambda: prepare_once(other, lambda temp: None, preparer=False, relay=NodeRelay(str(node / "r2"), leader=False)))),
        daemon=True)
    follower.start()
    with pytest.raises(UserError, match="^training.data: record 3 is not a conversation$"):
        prepare_once(other, lambda temp: None, preparer=False, relay=NodeRelay(str(node / "r2"), leader=True))
    follower.join(timeout=10)
    assert str(ended[-1]) == "training.data: record 3 is not a conversation"


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - what the follower ended with is the answer
        return exc
    return None


def test_an_earlier_starts_error_is_tried_again_and_this_segments_is_not(tmp_path, monkeypatch):
    """A TARGET.failed that was there before this start is an earlier start's (redone), unless it
    names this job segment: a rank that starts after its node's preparer failed still ends."""
    target = str(tmp_path / "KEY")
    (tmp_path / "KEY.failed").write_text("an old error\n")
    assert prepare_once(target, lambda temp: os.makedirs(os.path.join(temp, COMPLETE)), preparer=True) == "prepared"
    monkeypatch.setenv("JOBGEN_JOB_ID", "31")
    monkeypatch.setenv("JOBGEN_RESTART_COUNT", "2")
    other = str(tmp_path / "OTHER")

    def fails(temp: str) -> None:
        raise UserError("the data is bad")

    with pytest.raises(UserError, match="^the data is bad$"):
        prepare_once(other, fails, preparer=True)
    with pytest.raises(UserError, match="^the data is bad$"):  # a waiting rank that started later
        prepare_once(other, lambda temp: None, preparer=False)


def test_a_job_tokenizes_once_on_its_workers_and_its_restart_finds_the_store(tiny, tools, tmp_path):
    """2 ranks under torchrun: local rank 0 tokenizes with a worker per CPU while rank 1 polls;
    the next start of the same run maps the store."""
    from jobgen.train.tiny import synthetic_conversations

    data = tmp_path / "data.json"
    data.write_text(json.dumps(synthetic_conversations(600, seed=2)))  # enough chunks for the workers
    job = tools.write_job(tmp_path / "run", tiny, data=str(data), max_steps=1, save_interval=1, lr_schedule="constant")
    first = tools.train(job)
    assert first.returncode == 0, first.stdout
    assert "with 2 processes" in first.stdout and "prepared here" in first.stdout
    raw = yaml.safe_load(job.read_text())
    raw["training"]["max_steps"] = 2  # one more step: a resume
    job.write_text(yaml.safe_dump(raw))
    second = tools.train(job)
    assert second.returncode == 0, second.stdout
    assert "found, preparation skipped" in second.stdout and "tokenized" not in second.stdout
    startups = [json.loads(line) for line in (job.parent / "output" / "startup.jsonl").read_text().splitlines()]
    assert [entry["first_step"] for entry in startups] == [0, 1] and all("data" in e["seconds"] for e in startups)


def test_another_chat_layout_is_stored_conversation_by_conversation(tiny, tokenizer, tmp_path):
    """A layout other than ChatTokenizer's own (a subclass here) goes through its own __call__."""
    from jobgen.train.encode import BatchChatEncoder

    class Shouting(ChatTokenizer):
        def __call__(self, conversation):
            ids, labels = super().__call__(conversation)
            return ids[::-1], labels[::-1]

    conversations = load_conversations(str(tiny / "data.json"))[:5]
    chunk = BatchChatEncoder(Shouting(tokenizer, 64)).encode(conversations)
    expected = [Shouting(tokenizer, 64)(c) for c in conversations]
    assert chunk.tokens.tolist() == [t for ids, _ in expected for t in ids]
    assert chunk.lengths.tolist() == [len(ids) for ids, _ in expected]
    assert chunk.label_counts.tolist() == [sum(1 for l in labels[1:] if l != -100) for _, labels in expected]


def test_the_held_out_part_and_the_cut_are_in_the_store(tiny, tokenizer, tmp_path):
    """eval_fraction's conversations are prepared with the store, in its eval/ part, record by
    record as held_out says; the conversations cut at max_length are counted in meta.json."""
    from jobgen.train.evaluation import held_out

    training = _training(tiny, max_length=40, eval_fraction=0.25, seed=7)
    stored, _ = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=2)
    conversations = load_conversations(training.data)
    held = [c for i, c in enumerate(conversations) if held_out(i, 0.25, 7)]
    kept = [c for i, c in enumerate(conversations) if not held_out(i, 0.25, 7)]
    assert held and kept
    chat = ChatTokenizer(tokenizer, 40)
    for part, expected in ((stored, kept), (stored.held_out(), held)):
        reference = TokenizedDataset(expected, chat, tokenizer.pad_token_id)
        _assert_same(part, reference)
        longest = max(range(len(expected)), key=lambda i: len(chat.uncut(expected[i])[0]))
        assert part.meta["cut"] == {"conversations": len(reference.cut_lengths),
                                    "tokens_lost": sum(length - 40 for length in reference.cut_lengths),
                                    "longest": {"id": expected[longest].id, "tokens": max(reference.cut_lengths)}}
    assert stored.meta["eval"]["conversations"] == len(held) and stored.meta["cut"]["conversations"] > 0
    # Without eval_fraction the store has no held-out part, and its key is another.
    whole, _ = ensure_store(_training(tiny, max_length=40), str(tmp_path), lambda: tokenizer, preparer=True, processes=1)
    assert whole.held_out() is None and whole.path != stored.path and len(whole) == len(conversations)


def test_eval_data_is_a_store_of_its_own_shared_with_a_training_store_of_that_file(tiny, tokenizer, tmp_path):
    from jobgen.train.store import ensure_eval_store

    eval_file = tmp_path / "eval.json"
    eval_file.write_text(json.dumps(json.loads((tiny / "data.json").read_text())[:6]))
    training = _training(tiny, eval_data=str(eval_file))
    stored, _ = ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=1)
    evaluated, outcome = ensure_eval_store(training, str(tmp_path), lambda: tokenizer, True, stored, processes=1)
    assert outcome == "prepared" and stored.held_out() is None and len(stored) == len(load_conversations(training.data))
    as_training, outcome = ensure_store(_training(tiny, data=str(eval_file)), str(tmp_path), lambda: tokenizer, preparer=False)
    assert (outcome, as_training.path) == ("found", evaluated.path)
    _assert_same(evaluated, _reference(_training(tiny, data=str(eval_file)), tokenizer))


def test_a_split_that_holds_out_nothing_is_one_line(tiny, tokenizer, tmp_path):
    training = _training(tiny, eval_fraction=0.001)
    with pytest.raises(UserError) as error:
        ensure_store(training, str(tmp_path), lambda: tokenizer, preparer=True, processes=1)
    assert str(error.value).startswith("training.eval_fraction: the split (eval_fraction 0.001 by seed 42) holds out none")
    assert "\n" not in str(error.value)


def test_prepare_makes_the_eval_sets_store_too(tiny, tokenizer, tmp_path):
    """jobgen prepare leaves nothing for the ranks to tokenize: eval_data's store, or
    eval_fraction's held-out part, is made with the training store and said."""
    eval_file = tmp_path / "eval.json"
    eval_file.write_text(json.dumps(json.loads((tiny / "data.json").read_text())[:5]))
    command, env = _prepare_job(tmp_path, tiny, tiny / "data.json", eval_data="eval.json")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "jobgen: training.eval_data: prepared " in done.stderr and "(5 conversations, " in done.stderr
    eval_store, outcome = ensure_store(Training(model=str(tiny / "model"), data=str(eval_file), max_length=256,
                                                prepared_cache=str(tmp_path / "stores")), str(tmp_path), lambda: tokenizer, False)
    assert outcome == "found" and len(eval_store) == 5

    command, env = _prepare_job(tmp_path, tiny, tiny / "data.json", eval_fraction=0.25)
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "jobgen: eval_fraction 0.25: " in done.stderr and "held out (by seed 42) in its eval/ part" in done.stderr
