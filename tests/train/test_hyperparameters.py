"""The guide's and the Hugging Face Trainer's hyperparameters: warmup_ratio, Adam's betas and
epsilon (tests/train/test_deepspeed_config.py fills them into DeepSpeed), LoRA modules_to_save
and bias, and the total steps `validate` prints. Checkpoints written before these fields resume."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from jobgen.errors import UserError
from jobgen.job.models import Training
from jobgen.train.modeling import load_model
from jobgen.train.prepare import resume_settings
from tests.helpers import jobgen


def test_warmup_ratio_rounds_up_as_the_hf_trainer_and_excludes_warmup_steps():
    assert Training(model="m", data="d", warmup_ratio=0.1).warmup_of(95) == 10
    assert Training(model="m", data="d", warmup_steps=7).warmup_of(95) == 7
    with pytest.raises(ValidationError, match="training.warmup_steps and training.warmup_ratio are both set; give one"):
        Training(model="m", data="d", warmup_steps=7, warmup_ratio=0.1)


def test_validate_prints_the_total_steps_and_warmup(tmp_path, tiny):
    """48 conversations, global batch 2 x 2 ranks x 2 = 8: 6 steps per epoch."""
    job = {"name": "steps", "launch": {"procs_per_node": 2},
           "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "per_device_batch_size": 2,
                        "gradient_accumulation": 2, "epochs": 3, "warmup_ratio": 0.1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = jobgen("validate", str(path), "--site", "none")
    assert result.returncode == 0, result.stderr
    assert "; global batch 8; 3 epoch(s) x 6 steps = 18 steps, warmup 2; lora," in result.stdout


def test_lora_modules_to_save_train_in_full_and_bias_reaches_peft(tiny):
    training = Training(model=str(tiny / "model"), data="d", precision="fp32",
                        lora={"r": 4, "alpha": 8, "modules_to_save": ["lm_head"], "bias": "lora_only"})
    model = load_model(training, "fp32", "cpu")
    config = model.peft_config["default"]
    assert config.modules_to_save == ["lm_head"] and config.bias == "lora_only"
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("lm_head.modules_to_save" in name for name in trainable)
    assert any("lora_A" in name for name in trainable)


def test_an_unknown_module_to_save_is_one_line(tiny):
    training = Training(model=str(tiny / "model"), data="d", precision="fp32", lora={"modules_to_save": ["score"]})
    with pytest.raises(UserError, match=r"training.lora.modules_to_save: \['score'\] not found in"):
        load_model(training, "fp32", "cpu")


def test_new_fields_at_their_defaults_leave_a_checkpoints_settings_as_before():
    before = {"model", "data", "method", "lora", "learning_rate", "warmup_steps"}  # a few of the older fields
    settings = resume_settings(Training(model="m", data="d"))
    assert before <= set(settings)
    assert not {"warmup_ratio", "adam_beta1", "adam_beta2", "adam_epsilon"} & set(settings)
    assert set(settings["lora"]) == {"r", "alpha", "dropout", "target_modules"}
    changed = resume_settings(Training(model="m", data="d", adam_beta2=0.95, lora={"bias": "all"}))
    assert changed["adam_beta2"] == 0.95 and changed["lora"]["bias"] == "all"
