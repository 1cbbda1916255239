"""A new run from another run's weights (training.init_from), and a resume from a chosen, not the
newest, checkpoint (jobgen submit --resume-from): 2 ranks, ZeRO-2 + LoRA with dropout, on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from jobgen.rundir import rewind
from jobgen.rundir.files import STOP_REQUESTED
from tests.helpers import jobgen


@pytest.fixture(scope="module")
def finished(tiny, tools, tmp_path_factory) -> Path:
    """A run of 12 steps that keeps its checkpoints of steps 3, 6, 9 and 12, and its final adapter."""
    job = tools.write_job(tmp_path_factory.mktemp("init") / "first", tiny, keep_checkpoints=5)
    done = tools.train(job)
    assert done.returncode == 0, done.stdout
    return job.parent / "output"


def _weights(checkpoint: Path) -> dict:
    """Every rank's fp32 pieces of the trainable weights, by (rank, name)."""
    pieces = {}
    for shard in sorted((checkpoint / "universal").glob("rank-*.pt")):
        for name, entry in torch.load(shard, weights_only=True)["params"].items():
            pieces[shard.name, name] = entry["fp32"]
    return pieces


def _stopped_at_step_zero(tools, job: Path) -> dict:
    """Run `job` with the batch shell's stop request already there: it stops before its first step
    and checkpoints the weights it started from as step 0."""
    (job.parent / STOP_REQUESTED).write_text("")
    result = tools.train(job)
    assert result.returncode == 0, result.stdout
    (job.parent / STOP_REQUESTED).unlink()
    report = tools.exit_report(job.parent)
    assert report["reason"] == "stopped" and report["checkpoint"].endswith("step-000000"), report
    return {"log": result.stdout, "step0": job.parent / "output" / "checkpoints" / "step-000000"}


def test_init_from_a_checkpoint_starts_a_new_run_at_step_zero_from_its_weights(finished, tools, tiny, tmp_path):
    source = tmp_path / "source" / "step-000006"
    shutil.copytree(finished / "checkpoints" / "step-000006", source)
    job = tools.write_job(tmp_path / "second", tiny, init_from=str(source))
    started = _stopped_at_step_zero(tools, job)
    assert f"initialized from checkpoint {source} (weights only: step 0" in started["log"]
    theirs, ours = _weights(source), _weights(started["step0"])
    assert theirs.keys() == ours.keys() and theirs
    for key in theirs:
        assert torch.equal(theirs[key], ours[key]), key
    state = json.loads((started["step0"] / "trainer_state.json").read_text())
    assert state["lr_scheduler"]["last_epoch"] == 0  # its own schedule, from the start

    # Its restart resumes from its own checkpoint: init_from is not read again, even gone.
    shutil.rmtree(source)
    resumed = tools.train(job)
    assert resumed.returncode == 0, resumed.stdout
    assert "training.init_from not read: this run resumes from its own checkpoint" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (job.parent / "output" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert tools.exit_report(job.parent)["first_step"] == 0


def test_init_from_an_adapter_folder_starts_from_its_weights(finished, tools, tiny, tmp_path):
    job = tools.write_job(tmp_path / "second", tiny, init_from=str(finished / "final"))
    started = _stopped_at_step_zero(tools, job)
    assert "initialized from adapter" in started["log"]
    final = tools.adapter_weights(finished)
    ours = _weights(started["step0"])
    assert {name.replace(".default", "") for _, name in ours} == set(final)
    for (_, name), value in ours.items():
        assert torch.equal(final[name.replace(".default", "")].flatten(), value), name


def test_init_from_mistakes_are_one_line_at_validate(finished, tiny, tmp_path, tools):
    checkpoint = finished / "checkpoints" / "step-000006"
    half = tmp_path / "checkpoints" / ".tmp-step-000015"
    shutil.copytree(checkpoint, half)
    (half / "COMPLETE").unlink()
    cases = [
        ({"init_from": str(tmp_path / "nowhere")}, f"training.init_from: folder '{tmp_path / 'nowhere'}' does not exist"),
        ({"init_from": str(half)}, f"training.init_from: '{half}' is an incomplete checkpoint (no COMPLETE"),
        ({"init_from": str(finished / "final"), "lora": {"r": 8, "alpha": 16}},
         "has LoRA r 4, this job 8; set training.lora.r: 4 to train on from it"),
        ({"init_from": str(checkpoint), "method": "full"},
         "was trained with method lora, this job is full; set training.method: lora"),
        ({"init_from": str(tiny / "model"), "method": "full"},
         f"is a full model folder, not a jobgen checkpoint or adapter; set training.model: {tiny / 'model'} instead"),
    ]
    for index, (fields, expected) in enumerate(cases):
        job = tools.write_job(tmp_path / f"job{index}", tiny, **fields)
        result = jobgen("validate", str(job), cwd=job.parent)
        assert result.returncode != 0, (fields, result.stderr)
        assert expected in result.stderr and "Traceback" not in result.stderr, (fields, result.stderr)
        assert len([line for line in result.stderr.splitlines() if "init_from" in line]) == 1, result.stderr


def test_init_from_an_adapter_of_another_shape_is_refused_on_the_nodes(finished, tools, tiny, tmp_path):
    """A script rendered and handed to the scheduler without validate: the trainer says the same line."""
    job = tools.write_job(tmp_path / "second", tiny, init_from=str(finished / "final"), lora={"r": 8, "alpha": 16})
    result = tools.train(job, nproc=1)  # refused before any weight is read
    assert result.returncode != 0
    assert "jobgen-train: error: training.init_from:" in result.stdout and "has LoRA r 4, this job 8" in result.stdout
    assert "jobgen/train/" not in result.stdout  # torchrun reports the exit status; no jobgen frame


def test_resume_from_a_chosen_checkpoint_sets_the_later_ones_aside_and_ends_as_an_uninterrupted_run(finished, tools, tmp_path):
    run = tmp_path / "again"
    shutil.copytree(finished.parent, run)
    shutil.rmtree(run / "output" / "final")
    output = run / "output"
    step = rewind.chosen_step(output, "step-000006")
    moved = rewind.set_aside_after(output, step)
    assert [p.name for p in moved] == ["step-000009", "step-000012"]
    assert moved[0].parent.parent == output / "checkpoints-set-aside"
    assert sorted(p.name for p in (output / "checkpoints").iterdir() if p.is_dir()) == ["step-000003", "step-000006"]
    assert (moved[0].parent / "metrics-after.jsonl").exists()

    resumed = tools.train(run / "job.yaml")
    assert resumed.returncode == 0, resumed.stdout
    assert tools.exit_report(run)["first_step"] == 6
    steps = [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # the set-aside steps' lines went with their checkpoints
    ours, straight = tools.adapter_weights(output), tools.adapter_weights(finished)
    assert ours.keys() == straight.keys() and ours
    for name in straight:
        assert torch.equal(ours[name], straight[name]), name
    assert sorted(p.name for p in moved[0].parent.iterdir() if p.is_dir()) == ["step-000009", "step-000012"]


def test_resume_from_a_checkpoint_the_run_does_not_have_is_one_line(finished, tmp_path):
    run = tmp_path / "again"
    shutil.copytree(finished.parent, run, ignore=shutil.ignore_patterns("final", "prepared"))
    import yaml

    job = yaml.safe_load((run / "job.yaml").read_text())
    (run / "job.yaml").write_text(yaml.safe_dump({**job, "run_dir": str(run)}))
    result = jobgen("submit", "--scheduler", "local", "--dry-run", "--resume-from", "step-000007", str(run / "job.yaml"),
                    cwd=run.parent)
    assert result.returncode != 0
    assert (f"--resume-from: 'step-000007' is not a complete checkpoint of this run in {run / 'output' / 'checkpoints'} "
            "(it has: step-000003, step-000006, step-000009, step-000012); give one of them") in result.stderr
    result = jobgen("submit", "--scheduler", "local", "--dry-run", "--resume-from", "6", str(run / "job.yaml"),
                    cwd=run.parent)
    assert result.returncode == 0, result.stderr
    assert "resuming from step-000006; later checkpoints (step-000009, step-000012): would be set aside" in result.stderr
    assert (run / "output" / "checkpoints" / "step-000012").exists()  # a dry run moves nothing
