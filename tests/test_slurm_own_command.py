"""A Hugging Face Trainer script of the user's own (launch.command) on the real Slurm test cluster:
2 nodes x 1 rank, plain DDP on gloo (the Trainer's own), preempted mid-run, requeued by Slurm and
resumed from the checkpoint JobgenCallback saved at the signal, via launch.resume_argument. Every
step is trained once, and the final loss equals an uninterrupted run's exactly (the Trainer's
resume restores its RNG states and skips the batches it trained, so on CPU it is exact)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen
from tests.test_slurm_requeue import (VENV_PATH, job_fields, preempt_everything, release_when_requeued, segments,
                                      wait_for, wait_until_done)

pytestmark = pytest.mark.usefixtures("slurm_cluster")

FINETUNE = r'''import json, os, sys, time

from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

from jobgen.train.hf import JobgenCallback

tiny, out = sys.argv[1], sys.argv[2]
resume = sys.argv[sys.argv.index("--resume_from_checkpoint") + 1] if "--resume_from_checkpoint" in sys.argv else None
tokenizer = AutoTokenizer.from_pretrained(f"{tiny}/model")
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
texts = [" ".join(turn["value"] for turn in record["conversations"]) for record in json.load(open(f"{tiny}/data.json"))]
encoded = tokenizer(texts, truncation=True, max_length=32, padding="max_length")
dataset = [{"input_ids": ids, "attention_mask": mask, "labels": ids}
           for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]


class SlowAndLogged(TrainerCallback):
    """Slows each step (so the test can preempt mid-run) and logs each step's loss once, on rank 0."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("STEP_DELAY", "0")))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(f"{out}/steps.jsonl", "a") as log:
                log.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


args = TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, save_steps=100, report_to=[], use_cpu=True, seed=1,
                         dataloader_num_workers=0, **json.loads(os.environ.get("EXTRA_ARGS", "{}")))
model = AutoModelForCausalLM.from_pretrained(f"{tiny}/model")
trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[JobgenCallback(), SlowAndLogged()])
trainer.train(resume_from_checkpoint=resume)
'''


def start(folder: Path, tiny: Path, name: str, step_delay: float) -> tuple[str, Path]:
    folder.mkdir(parents=True)
    (folder / "finetune.py").write_text(FINETUNE)
    job = {
        "name": f"jobgen-test-{name}",
        "resources": {"nodes": 2, "gpus_per_node": 0, "time_limit": "00:20:00", "partition": "debug", "exclusive": True},
        "launch": {"procs_per_node": 1, "command": ["python", "finetune.py", str(tiny), "out"],
                   "resume_argument": "--resume_from_checkpoint {checkpoint}", "checkpoints": "out/checkpoint-*"},
        "environment": {"variables": {"STEP_DELAY": step_delay}},
        "requeue": {"max_restarts": 3, "warning_seconds": 30},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "slurm", "job.yaml"], cwd=folder,
                         env={**os.environ, "PATH": VENV_PATH}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), folder / "runs" / f"jobgen-test-{name}"


def logged(folder: Path) -> list[dict]:
    path = folder / "out" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_preempted_trainer_script_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "jobgen.train.tiny", str(tiny)], check=True, capture_output=True)
    reference_id, _ = start(tmp_path / "reference", tiny, "hf-reference", step_delay=0)
    assert wait_until_done(reference_id, timeout=300) == "COMPLETED"
    job_id, run_dir = start(tmp_path / "preempted", tiny, "hf-preempt", step_delay=2)
    wait_for(lambda: any(entry["step"] >= 3 for entry in logged(tmp_path / "preempted")), "step 3", timeout=240)
    preempt_everything()
    release_when_requeued(job_id, restarts=1)
    assert wait_until_done(job_id, timeout=300) == "COMPLETED"

    first, second = segments(run_dir)
    assert first["outcome"] == "preempted" and second["outcome"] == "completed", (first, second)
    # Saved at the signal (checkpoint-N), and the restart resumed from it: no step lost, none twice.
    assert second["first_step"] == first["last_step"] >= 3
    log = jobgen("logs", str(run_dir)).stdout
    assert f"resuming from {tmp_path}/preempted/out/checkpoint-{first['last_step']} (launch.resume_argument)" in log
    steps = [entry["step"] for entry in logged(tmp_path / "preempted")]
    assert steps == list(range(1, 13)), steps
    reference = logged(tmp_path / "reference")
    assert [entry["step"] for entry in reference] == list(range(1, 13))
    assert logged(tmp_path / "preempted")[-1]["loss"] == reference[-1]["loss"]
    status = jobgen("status", str(run_dir)).stdout
    assert "own program (launch.command)" in status
    print(f"preempted at step {first['last_step']}; final loss {reference[-1]['loss']} in both")
