"""Stop, checkpoint and exact resume with 2 ranks (ZeRO-2 + LoRA with dropout, gloo on the CPU)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.processes import ranks_of

STEPS = 12  # 48 conversations / 2 ranks / batch 2 / accumulation 2 = 6 steps per epoch, 2 epochs


@pytest.fixture(scope="module")
def runs(tiny, tools, tmp_path_factory):
    """An uninterrupted run, and a run stopped by SIGTERM to torchrun then resumed."""
    root = tmp_path_factory.mktemp("resume")
    straight = tools.write_job(root / "straight", tiny)
    done = tools.train(straight, JOBGEN_DEBUG_SAMPLE_LOG="1")
    assert done.returncode == 0, done.stdout

    interrupted = tools.write_job(root / "interrupted", tiny)
    proc = tools.start(interrupted, JOBGEN_DEBUG_STEP_DELAY="0.4", JOBGEN_DEBUG_SAMPLE_LOG="1")
    tools.wait_for_step(interrupted.parent / "output" / "metrics.jsonl", 4, proc)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to both workers
    first_log = proc.communicate(timeout=120)[0]
    stopped = tools.exit_report(interrupted.parent)
    resumed = tools.train(interrupted, JOBGEN_DEBUG_SAMPLE_LOG="1")
    assert resumed.returncode == 0, first_log + resumed.stdout
    return {"straight": straight.parent, "interrupted": interrupted.parent, "stopped": stopped,
            "completed": tools.exit_report(interrupted.parent), "resume_log": resumed.stdout}


def test_sigterm_stops_with_a_checkpoint_and_a_rerun_completes(runs):
    stopped, completed = runs["stopped"], runs["completed"]
    assert stopped["reason"] == "stopped" and stopped["signal"] == "SIGTERM"
    assert stopped["first_step"] == 0 and 4 <= stopped["last_step"] < STEPS
    assert stopped["checkpoint"].endswith(f"step-{stopped['last_step']:06d}")
    assert completed["reason"] == "completed" and completed["signal"] is None
    assert completed["first_step"] == stopped["last_step"] and completed["last_step"] == STEPS
    assert "resumed from" in runs["resume_log"]
    # The restart maps the data its first start tokenized, and says so.
    assert "found, preparation skipped" in runs["resume_log"]
    startups = [json.loads(line) for line in (runs["interrupted"] / "output" / "startup.jsonl").read_text().splitlines()]
    assert len(startups) == 2 and all("data" in entry["seconds"] for entry in startups)


def test_resumed_adapter_is_bitwise_identical_to_uninterrupted(runs, tools):
    straight = tools.adapter_weights(runs["straight"] / "output")
    resumed = tools.adapter_weights(runs["interrupted"] / "output")
    assert straight.keys() == resumed.keys() and straight
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    initial_b = [name for name in straight if "lora_B" in name]
    assert any(straight[name].abs().sum() > 0 for name in initial_b)  # training changed the weights


def _samples_per_epoch(output: Path) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for rank_log in output.glob("samples-rank*.jsonl"):
        for line in rank_log.read_text().splitlines():
            record = json.loads(line)
            seen.setdefault(record["epoch"], Counter()).update(record["ids"])
    return seen


def test_every_sample_is_seen_once_per_epoch_across_the_interruption(runs):
    expected = {f"tiny-{i:05d}" for i in range(48)}
    for output in (runs["straight"] / "output", runs["interrupted"] / "output"):
        seen = _samples_per_epoch(output)
        assert sorted(seen) == [0, 1]
        for epoch, counts in seen.items():
            assert set(counts) == expected, epoch
            assert set(counts.values()) == {1}, (epoch, [k for k, v in counts.items() if v > 1])


def test_metrics_lines_carry_token_weighted_loss_and_rank_timings(runs):
    lines = [json.loads(l) for l in (runs["straight"] / "output" / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, STEPS + 1))
    for line in lines:
        assert line["loss"] > 0 and line["tokens_per_s"] > 0 and line["samples_per_s"] > 0
        assert line["step_seconds_max"] >= line["step_seconds_min"] > 0 and line["peak_memory_mb"] > 0
    assert lines[-1]["lr"] == pytest.approx(0.0, abs=1e-12)  # cosine ends at zero: the job's schedule ran


def test_checkpoint_holds_manifest_rng_and_sampler_position(runs):
    checkpoints = sorted(p for p in (runs["straight"] / "output" / "checkpoints").iterdir() if p.is_dir())
    assert [p.name for p in checkpoints] == ["step-000009", "step-000012"]  # keep_checkpoints = 2
    newest = checkpoints[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["world_size"] == 2 and len(manifest["config_digest"]) == 64
    assert {"rng/rank-00000.pt", "rng/rank-00001.pt", "universal/rank-00000.pt", "universal/rank-00001.pt",
            "trainer_state.json"} <= set(manifest["files"])
    state = json.loads((newest / "trainer_state.json").read_text())
    assert (state["epoch"], state["steps_in_epoch"], state["global_batch"]) == (2, 0, 8)
    assert state["lr_scheduler"]["last_epoch"] == 12


def _copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    for stale in ("final", "metrics.jsonl"):
        path = target / "output" / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for rank_log in (target / "output").glob("samples-rank*.jsonl"):
        rank_log.unlink()
    return target / "job.yaml"


def test_corrupted_newest_checkpoint_is_skipped_and_temp_checkpoint_ignored(runs, tools, tmp_path):
    job = _copy_run(runs["straight"], tmp_path / "copy")
    checkpoints = tmp_path / "copy" / "output" / "checkpoints"
    victim = next(p for p in (checkpoints / "step-000012").rglob("*optim_states.pt"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    half_written = checkpoints / ".tmp-step-000013"
    half_written.mkdir()
    (half_written / "COMPLETE").write_text("13\n")  # even a marker inside a temp dir does not count

    result = tools.train(job)
    assert result.returncode == 0, result.stdout
    assert "skipping checkpoint" in result.stdout and "step-000012" in result.stdout
    report = tools.exit_report(job.parent)
    assert (report["reason"], report["first_step"], report["last_step"]) == ("completed", 9, STEPS)
    assert not half_written.exists()
    assert (checkpoints / "corrupt-step-000012").is_dir()  # set aside, so pruning cannot prefer it
    straight = tools.adapter_weights(runs["straight"] / "output")
    again = tools.adapter_weights(job.parent / "output")
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_resuming_on_a_world_size_that_cannot_split_the_global_batch_is_refused_at_once(runs, tools, tmp_path, tiny):
    job = _copy_run(runs["straight"], tmp_path / "copy")
    tools.write_job(job.parent, tiny, procs=3)
    started = time.monotonic()
    result = tools.train(job, nproc=3)
    assert result.returncode != 0
    assert ("jobgen-train: error: training.global_batch_size: 8 samples per optimizer step cannot be split evenly "
            "over 3 ranks; world sizes that divide it: 1, 2, 4, 8") in result.stdout
    assert "jobgen/train/" not in result.stdout  # no traceback through the trainer (torchrun prints its own)
    report = tools.exit_report(job.parent)
    assert report["reason"] == "failed" and "cannot be split evenly over 3 ranks" in report["message"]
    assert time.monotonic() - started < 120  # no waiting for the process-group timeout (3 min here)


def test_resuming_with_a_different_max_steps_is_refused_in_one_line(runs, tools, tmp_path, tiny):
    """The checkpoint's run had 12 steps on a cosine schedule; 20 would bend its learning rate."""
    job = _copy_run(runs["straight"], tmp_path / "copy")
    tools.write_job(job.parent, tiny, max_steps=20)
    result = tools.train(job, nproc=1)  # refused before the global batch is split: one rank says it
    assert result.returncode != 0
    assert ("jobgen-train: error: training.max_steps: checkpoint step-000012 belongs to a run of 12 steps on a cosine "
            "schedule, this job has 20") in result.stdout
    assert "jobgen/train/" not in result.stdout


def test_resuming_in_another_chat_template_is_refused_in_one_line(runs, tools, tmp_path, tiny):
    """The checkpoint trained in ChatML (the tiny tokenizer has no template of its own)."""
    job = _copy_run(runs["straight"], tmp_path / "copy")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}")
    tools.write_job(job.parent, tiny, chat_template=str(template))
    result = tools.train(job, nproc=1)  # refused before the global batch is split: one rank says it
    assert result.returncode != 0
    assert (f"jobgen-train: error: training.chat_template: checkpoint step-000012 was trained in ChatML, this job "
            f"trains in the chat template in {template}; set training.chat_template: chatml to resume, or use a new "
            "training.output_dir to start in the new layout") in result.stdout
    assert "jobgen/train/" not in result.stdout


def test_signal_to_one_worker_stops_every_rank_at_the_same_step(tools, tiny, tmp_path):
    job = tools.write_job(tmp_path / "direct", tiny)
    proc = tools.start(job, JOBGEN_DEBUG_STEP_DELAY="0.4")
    tools.wait_for_step(job.parent / "output" / "metrics.jsonl", 2, proc)
    workers = ranks_of(proc.pid)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGUSR1)  # only rank 1 hears it, as with a per-process signal
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    report = tools.exit_report(job.parent)
    assert report["reason"] == "stopped" and report["signal"] == "SIGUSR1"
    assert Path(report["checkpoint"], "COMPLETE").exists()
    manifest = json.loads(Path(report["checkpoint"], "manifest.json").read_text())
    assert manifest["step"] == report["last_step"] < STEPS


def test_full_zero3_bf16_stopped_by_sigusr1_through_torchrun_resumes_bitwise(tools, tiny, tmp_path):
    """torchrun forwards SIGUSR1 only when told to (--signals-to-handle); the batch scripts do that."""
    from safetensors.torch import load_file

    settings = dict(method="full", zero_stage=3, precision="bf16", gradient_checkpointing=True, epochs=1)
    straight = tools.write_job(tmp_path / "straight", tiny, **settings)
    assert tools.train(straight).returncode == 0
    job = tools.write_job(tmp_path / "interrupted", tiny, **settings)
    forward = ("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",)
    proc = tools.start(job, launcher_args=forward, JOBGEN_DEBUG_STEP_DELAY="0.4")
    tools.wait_for_step(job.parent / "output" / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    stopped = tools.exit_report(job.parent)
    assert (stopped["reason"], stopped["signal"]) == ("stopped", "SIGUSR1") and stopped["last_step"] < 6
    resumed = tools.train(job)
    assert resumed.returncode == 0, resumed.stdout
    assert tools.exit_report(job.parent)["first_step"] == stopped["last_step"]
    a = load_file(str(straight.parent / "output" / "final" / "model.safetensors"))
    b = load_file(str(job.parent / "output" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
