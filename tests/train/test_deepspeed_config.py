"""A user's DeepSpeed JSON as Hugging Face users write it: 'auto' filled from the job, conflicts
one line each and all at once, read at `validate`, and the Qwen guide's ds_config_zero2.json
(QwenLM/Qwen, finetune/ds_config_zero2.json, copied unedited) training as it is."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from jobgen.errors import UserError
from jobgen.job.models import Training
from jobgen.train.dsconfig import build_config, compiled_op_notice
from tests.helpers import jobgen

QWEN_DS_CONFIG_ZERO2 = """{
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1
    },
    "bf16": {
        "enabled": "auto"
    },
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto"
        }
    },

    "scheduler": {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto"
        }
    },

    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "none",
            "pin_memory": true
        },
        "allgather_partitions": true,
        "allgather_bucket_size": 2e8,
        "overlap_comm": true,
        "reduce_scatter": true,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": true
    },

    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 100,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": false
}"""


@pytest.fixture
def qwen_config(tmp_path):
    path = tmp_path / "ds_config_zero2.json"
    path.write_text(QWEN_DS_CONFIG_ZERO2)
    return path


def _training(**fields) -> Training:
    return Training(model="m", data="d", **fields)


def test_the_qwen_guides_config_is_filled_as_the_hf_trainer_fills_it(qwen_config):
    training = _training(per_device_batch_size=2, gradient_accumulation=4, learning_rate=1e-5, weight_decay=0.1,
                         adam_beta2=0.95, adam_epsilon=1e-6, precision="bf16", lr_schedule="cosine", warmup_ratio=0.01)
    config = build_config(training, 8, "bf16", str(qwen_config))
    assert "scheduler" not in config  # its WarmupLR of 'auto' values is run by jobgen itself (followed_schedule)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 4, 64)
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["gradient_clipping"] == 1.0  # the Trainer's max_grad_norm default
    assert config["zero_optimization"]["reduce_bucket_size"] == 2e8  # the user's own values stay


def test_every_conflict_with_the_job_is_one_line_all_at_once(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": "auto"}},
        "zero_allow_untested_optimizer": "auto",
    }))
    with pytest.raises(UserError) as caught:
        build_config(_training(learning_rate=2e-4), 2, "fp32", str(path))
    assert str(caught.value).splitlines() == [
        f"training.deepspeed_config: {path} has a 'scheduler' section (WarmupLR) with values of its own, which would "
        "override the job's learning_rate and warmup; set its params to \"auto\" (filled from the job, as the Hugging "
        "Face Trainer fills them), or remove it and set lr_schedule and warmup_steps or warmup_ratio in the job",
        f"training.deepspeed_config: {path}: train_micro_batch_size_per_gpu is 4 but the job says 1 "
        "(training.per_device_batch_size); set it to \"auto\" (or remove it) so the job decides, or change "
        "training.per_device_batch_size",
        f"training.deepspeed_config: {path}: zero_optimization.stage is 3 but the job says 2 (training.zero_stage); "
        "set it to \"auto\" (or remove it) so the job decides, or change training.zero_stage",
        f"training.deepspeed_config: {path}: optimizer.params.lr is 0.001 but the job says 0.0002 "
        "(training.learning_rate); set it to \"auto\" (or remove it) so the job decides, or change training.learning_rate",
        f"training.deepspeed_config: {path}: optimizer.params.betas is [0.9, 0.95] but the job says [0.9, 0.999] "
        "(training.adam_beta1/adam_beta2); set it to \"auto\" (or remove it) so the job decides, or change "
        "training.adam_beta1/adam_beta2",
        f"training.deepspeed_config: {path} has 'auto' at zero_allow_untested_optimizer, which jobgen does not fill; "
        "give a value",
    ]


def test_auto_zero3_bucket_sizes_come_from_the_models_hidden_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                      "stage3_prefetch_bucket_size": "auto",
                                                      "stage3_param_persistence_threshold": "auto"}}))
    zero = build_config(_training(zero_stage=3), 2, "fp32", str(path), hidden_size=64)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) == (4096, 3686, 640)


def test_an_optimizer_that_compiles_an_op_says_so(qwen_config):
    config = build_config(_training(), 2, "fp32", str(qwen_config))
    assert compiled_op_notice(config, "ds.json") == (
        "training.deepspeed_config: ds.json: optimizer AdamW makes DeepSpeed compile its fused_adam op when the job "
        "starts (a minute or more, and a CUDA compiler on GPU nodes) unless it was built at install; add "
        "\"torch_adam\": true to its params to use torch's own"
    )
    assert compiled_op_notice(build_config(_training(), 2, "fp32", None), "bundled") is None  # torch_adam


def _job(tmp_path, tiny, **training):
    job = {"name": "ds", "launch": {"procs_per_node": 2},
           "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), "precision": "fp32", **training}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_validate_reads_the_deepspeed_config(tmp_path, tiny, qwen_config):
    result = jobgen("validate", str(_job(tmp_path, tiny, deepspeed_config=str(tmp_path / "missing.json"))), "--site", "none")
    assert result.returncode == 2
    assert f"jobgen: error: training.deepspeed_config: file {str(tmp_path / 'missing.json')!r} does not exist" in result.stderr
    result = jobgen("validate", str(_job(tmp_path, tiny, deepspeed_config=str(qwen_config), learning_rate=1e-3)),
                    "--site", "none")
    assert result.returncode == 0, result.stderr
    assert "optimizer AdamW makes DeepSpeed compile its fused_adam op" in result.stderr


def test_the_qwen_guides_config_trains_unedited(tools, tiny, tmp_path, qwen_config):
    job = tools.write_job(tmp_path / "run", tiny, deepspeed_config=str(qwen_config), max_steps=2)
    result = tools.train(job, timeout=600)
    assert result.returncode == 0, result.stdout
    assert "optimizer AdamW makes DeepSpeed compile its fused_adam op" in result.stdout
    assert tools.adapter_weights(job.parent / "output")


# A ZeRO-3 JSON as the Hugging Face docs and the Qwen guide write it: the bucket sizes 'auto'.
ZERO3_AUTO_BUCKETS = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def test_auto_bucket_sizes_of_a_model_not_staged_name_the_cache_and_prepare_in_validate_and_render(tmp_path, tiny):
    # The sizes come from the model's hidden_size, which its config.json in the nodes' cache gives:
    # the cause is that config not being there, not a value the user forgot to give.
    ds = tmp_path / "ds_config_zero3.json"
    ds.write_text(json.dumps(ZERO3_AUTO_BUCKETS))
    job = _job(tmp_path, tiny, model="Qwen/Qwen-14B", method="full", zero_stage=3, deepspeed_config=str(ds))
    cache = tmp_path / "hf"
    said = (f"training.deepspeed_config: {ds} has 'auto' at zero_optimization.reduce_bucket_size, "
            "zero_optimization.stage3_prefetch_bucket_size, zero_optimization.stage3_param_persistence_threshold, "
            "which the model's hidden_size fills (as the Hugging Face Trainer does), and Qwen/Qwen-14B's config.json "
            f"is not in the cache the nodes use (HF_HOME={cache}) to read it from: stage the model there with "
            "`jobgen prepare JOB.yaml` (the nodes then fill them from it as the job starts), or give values")
    env = {"HF_HOME": str(cache)}
    result = jobgen("validate", str(job), "--site", "none", env=env)
    assert result.returncode == 2 and f"jobgen: error: {said}\n" in result.stderr, result.stderr
    assert "give a value" not in result.stderr
    result = jobgen("render", "-s", "slurm", str(job), "--site", "none", env=env)
    assert result.returncode == 0 and f"jobgen: warning: {said}\n" in result.stderr, result.stderr
    # Staged, the same file fills from the model's hidden_size (the tiny model's 64), as on the nodes.
    config = build_config(_training(zero_stage=3), 2, "bf16", str(ds), hidden_size=64)["zero_optimization"]
    assert config["reduce_bucket_size"] == 64 * 64


def _metrics(output):
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind, after_warmup", [
    ("WarmupLR", lambda step, total: 1.0),  # constant after the warmup, as the Trainer runs the guide's file
    ("WarmupDecayLR", lambda step, total: (total - step) / (total - 2)),
], ids=["WarmupLR", "WarmupDecayLR"])
def test_a_scheduler_of_auto_values_runs_as_the_hf_trainer_runs_it_and_validate_says_so(tools, tiny, tmp_path, kind, after_warmup):
    # The guide's files: WarmupLR with every param 'auto'. It trained with jobgen's cosine schedule.
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                                                   "torch_adam": True}},
        "scheduler": {"type": kind, "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                               "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": "auto"}, "train_micro_batch_size_per_gpu": "auto",
    }))
    job = tools.write_job(tmp_path / "run", tiny, deepspeed_config=str(ds), max_steps=6, warmup_steps=2,
                          learning_rate=1e-3, logging_interval=1)
    result = jobgen("validate", str(job), "--site", "none")
    shape = {"WarmupLR": "constant", "WarmupDecayLR": "linear"}[kind]
    after = {"WarmupLR": "constant", "WarmupDecayLR": "a linear decay to 0"}[kind]
    assert result.returncode == 0, result.stderr
    assert (f"jobgen: warning: training.deepspeed_config: {ds}: its scheduler {kind} runs, as in the Hugging Face "
            f"Trainer: the job's warmup to learning_rate, then {after} (lr_schedule {shape}); training.lr_schedule "
            "(cosine) is not used: remove the 'scheduler' section for it to decide") in result.stderr
    result = tools.train(job, nproc=1, timeout=600)  # the schedule is the same on any number of ranks
    assert result.returncode == 0, result.stdout
    for line in _metrics(job.parent / "output"):
        step = line["step"]
        expected = 1e-3 * (step / 2 if step < 2 else after_warmup(step, 6))
        assert math.isclose(line["lr"], expected, rel_tol=1e-9, abs_tol=1e-12), line
