"""A checkpoint resumes on any world size: a run of 2 ranks stopped, then resumed on 1, 2 and 3
ranks (gloo on the CPU), goes on as the uninterrupted 2-rank run does, step by step."""

from __future__ import annotations

import json
import shutil
import signal
from collections import defaultdict
from pathlib import Path

import pytest
import torch

# 48 conversations, 12 per optimizer step (3 per micro-batch x 2 rounds x 2 ranks): 4 steps per
# epoch, 8 in all. 12 splits over 1 rank (3 x 4 rounds), 2 (3 x 2) and 3 (2 x 2). No dropout: its
# masks are drawn per rank, so they differ when the ranks hold other samples.
LORA = dict(per_device_batch_size=3, gradient_accumulation=2, epochs=2, save_interval=3, keep_checkpoints=5,
            lora={"r": 4, "alpha": 8, "dropout": 0.0})
STEPS = 8


def _metrics(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "output" / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


def _samples_by_step(run_dir: Path) -> dict[int, list[str]]:
    steps: dict[int, list[str]] = defaultdict(list)
    for rank_log in (run_dir / "output").glob("samples-rank*.jsonl"):
        for line in rank_log.read_text().splitlines():
            record = json.loads(line)
            steps[record["step"]] += record["ids"]
    return {step: sorted(ids) for step, ids in steps.items()}


def _resume_copy(stopped: Path, target: Path, tools, tiny: Path, procs: int, **settings) -> Path:
    """The stopped run directory, copied, with its job file asking for `procs` ranks."""
    shutil.copytree(stopped, target)
    for rank_log in (target / "output").glob("samples-rank*.jsonl"):
        rank_log.unlink()
    return tools.write_job(target, tiny, procs, **settings)


@pytest.fixture(scope="module")
def lora_runs(tiny, tools, tmp_path_factory):
    """ZeRO-2 LoRA: uninterrupted on 2 ranks; stopped by SIGTERM on 2 ranks, then resumed on 1, 2 and 3."""
    root = tmp_path_factory.mktemp("resize")
    straight = tools.write_job(root / "straight", tiny, **LORA)
    done = tools.train(straight, JOBGEN_DEBUG_SAMPLE_LOG="1")
    assert done.returncode == 0, done.stdout

    job = tools.write_job(root / "stopped", tiny, **LORA)
    proc = tools.start(job, JOBGEN_DEBUG_STEP_DELAY="0.4")
    tools.wait_for_step(job.parent / "output" / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    stopped = tools.exit_report(job.parent)
    assert stopped["reason"] == "stopped" and 2 <= stopped["last_step"] < STEPS - 1, stopped
    resumed = {}
    for procs in (1, 2, 3):
        copy = _resume_copy(job.parent, root / f"on-{procs}", tools, tiny, procs, **LORA)
        result = tools.train(copy, nproc=procs, JOBGEN_DEBUG_SAMPLE_LOG="1")
        assert result.returncode == 0, result.stdout
        resumed[procs] = (copy.parent, result.stdout)
    return {"straight": straight.parent, "stopped": stopped, "resumed": resumed}


@pytest.mark.parametrize("procs", [1, 3])
def test_lora_stopped_on_2_ranks_resumes_on_another_count_with_the_same_loss_curve(lora_runs, tools, procs):
    run_dir, log = lora_runs["resumed"][procs]
    first = lora_runs["stopped"]["last_step"]
    report = tools.exit_report(run_dir)
    assert (report["reason"], report["first_step"], report["last_step"]) == ("completed", first, STEPS)
    split = {1: "micro-batch 3 x 4 accumulation", 3: "micro-batch 2 x 2 accumulation"}[procs]
    assert f"global batch 12 = {procs} ranks x {split}" in log
    straight, resumed = _metrics(lora_runs["straight"]), _metrics(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # the 2-rank segment, then this one
    for step, loss in resumed.items():  # the ranks sum in another order: float tolerance, not bitwise
        assert loss == pytest.approx(straight[step], rel=1e-6, abs=0), step
    expected, got = tools.adapter_weights(lora_runs["straight"] / "output"), tools.adapter_weights(run_dir / "output")
    assert expected.keys() == got.keys() and expected
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_each_step_trains_the_same_samples_whatever_the_rank_count(lora_runs):
    straight = _samples_by_step(lora_runs["straight"])
    first = lora_runs["stopped"]["last_step"]
    assert sorted(straight) == list(range(1, STEPS + 1)) and all(len(ids) == 12 for ids in straight.values())
    for procs, (run_dir, _) in lora_runs["resumed"].items():
        resumed = _samples_by_step(run_dir)
        assert resumed == {step: straight[step] for step in range(first + 1, STEPS + 1)}, procs


def test_lora_resumed_on_the_same_2_ranks_is_still_bitwise(lora_runs, tools):
    run_dir, _ = lora_runs["resumed"][2]
    straight, resumed = _metrics(lora_runs["straight"]), _metrics(run_dir)
    assert resumed == straight
    expected, got = tools.adapter_weights(lora_runs["straight"] / "output"), tools.adapter_weights(run_dir / "output")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_full_zero3_checkpoint_of_2_ranks_resumes_on_3(tiny, tools, tmp_path):
    """Full fine-tune, ZeRO-3 (each parameter cut in 2, then in 3 padded pieces), saves in the
    foreground. 18 samples per step: 48 make 2 whole steps and a short one of 12 each epoch, in
    which some ranks get no samples in their last round (they still join the step, with weight 0)."""
    from safetensors.torch import load_file

    settings = dict(method="full", zero_stage=3, async_save=False, per_device_batch_size=3, gradient_accumulation=3,
                    max_steps=6, save_interval=3, keep_checkpoints=5)
    straight = tools.write_job(tmp_path / "straight", tiny, **settings)
    assert tools.train(straight).returncode == 0
    job = tools.write_job(tmp_path / "on-3", tiny, 3, **settings)
    shutil.copytree(straight.parent / "output" / "checkpoints" / "step-000003", job.parent / "output" / "checkpoints" / "step-000003")
    result = tools.train(job, nproc=3)
    assert result.returncode == 0, result.stdout
    assert "(step 3, written by 2 ranks, resharded to 3)" in result.stdout
    assert "global batch 18 = 3 ranks x micro-batch 3 x 2 accumulation" in result.stdout
    assert tools.exit_report(job.parent)["first_step"] == 3
    expected, got = _metrics(straight.parent), _metrics(job.parent)
    assert sorted(got) == [4, 5, 6]
    assert all(got[step] == pytest.approx(expected[step], rel=1e-6, abs=0) for step in got)
    a = load_file(str(straight.parent / "output" / "final" / "model.safetensors"))
    b = load_file(str(job.parent / "output" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
