"""A user's mistake ends every rank at once with one line naming the problem, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import yaml

from jobgen.job.models import Training
from jobgen.job.conversations import load_conversations
from jobgen.train.dsconfig import build_config
from jobgen.errors import UserError
from jobgen.job.model_reference import check_model_reference

GOOD_TURNS = [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "hello"}]


def _write(tmp_path, items, name="data.json"):
    path = tmp_path / name
    path.write_text(json.dumps(items))
    return str(path)


@pytest.mark.parametrize(
    "item, expected",
    [
        ({"id": "a", "conversations": [{"from": "bot", "value": "x"}]},
         "record 1 (id 'a'): conversations[0].from is 'bot'; expected one of human, user, gpt, assistant, system"),
        ({"id": "a", "conversations": []}, "record 1 (id 'a'): 'conversations' is empty"),
        ({"id": "a", "conversations": "hi"}, "record 1 (id 'a'): 'conversations' must be a list, got str"),
        ({"id": "a", "conversations": [{"from": "user", "value": 3}]},
         "record 1 (id 'a'): conversations[0].value must be a string, got int"),
        ({"id": "a"}, "record 1 (id 'a'): missing field 'conversations'"),
        ({"id": "a", "conversations": [{"from": "user", "value": "q"}]}, "record 1 (id 'a'): no assistant turn"),
        ({"id": "a", "conversations": GOOD_TURNS + [{"from": "system", "value": "s"}]},
         "conversations[2] is a system turn; a system turn may only come first"),
        (["not", "an", "object"], "record 1: expected an object with 'conversations', got list"),
    ],
)
def test_malformed_conversation_names_file_item_and_field(tmp_path, item, expected):
    path = _write(tmp_path, [{"id": "ok", "conversations": GOOD_TURNS}, item])
    with pytest.raises(UserError) as info:
        load_conversations(path)
    assert str(info.value).startswith(path) and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_json_and_jsonl_both_load_and_broken_lines_are_named(tmp_path):
    item = {"id": 7, "conversations": [{"from": "system", "value": "be brief"}] + GOOD_TURNS}
    assert load_conversations(_write(tmp_path, [item]))[0].system == "be brief"
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text(json.dumps(item) + "\n\n" + json.dumps(item) + "\n")
    assert [c.id for c in load_conversations(str(jsonl))] == ["7", "7"]
    jsonl.write_text(json.dumps(item) + "\n{broken\n")
    with pytest.raises(UserError, match=r"data.jsonl: line 2 is not valid JSON"):
        load_conversations(str(jsonl))
    with pytest.raises(UserError, match=r"training.data: file '.*missing.json' does not exist"):
        load_conversations(str(tmp_path / "missing.json"))


def test_model_path_that_does_not_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"training.model: path '.*nowhere' does not exist"):
        check_model_reference(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="without config.json"):
        check_model_reference(str(tmp_path))
    check_model_reference("Qwen/Qwen-7B")  # a hub name is left to from_pretrained
    (tmp_path / "models").mkdir()
    with pytest.raises(UserError, match=r"path 'models/nowhere' does not exist"):
        check_model_reference("models/nowhere")  # a local folder "models" makes it a path


def _training(**fields) -> Training:
    return Training(model="m", data="d", **fields)


def test_deepspeed_config_with_a_scheduler_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}))
    with pytest.raises(UserError, match=r"has a 'scheduler' section \(WarmupLR\) with values of its own, which would "
                                        r"override the job's learning_rate and warmup; set its params to \"auto\""):
        build_config(_training(), 2, "fp32", str(config))


def test_deepspeed_config_that_disagrees_with_the_job_is_refused(tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    with pytest.raises(UserError, match=r"train_micro_batch_size_per_gpu is 4 but the job says 1"):
        build_config(_training(), 2, "fp32", str(config))


def test_bundled_configs_are_filled_from_the_job_and_have_no_scheduler():
    for stage in (2, 3):
        config = build_config(
            _training(zero_stage=stage, per_device_batch_size=3, gradient_accumulation=5, learning_rate=1e-4),
            4, "bf16", None,
        )
        assert "scheduler" not in config
        assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 5)
        assert config["train_batch_size"] == 60 and config["zero_optimization"]["stage"] == stage
        assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
        assert config["optimizer"]["params"]["lr"] == 1e-4 and config["optimizer"]["params"]["torch_adam"] is True


def _run_cli(job, tools, nproc=None, timeout=120):
    if nproc is None:
        command = [sys.executable, "-m", "jobgen.train", "--job", str(job)]
        env = tools.subprocess_env()
        return subprocess.run(command, cwd=job.parent, env=env, capture_output=True, text=True, timeout=timeout)
    return tools.train(job, nproc=nproc, timeout=timeout)


def test_missing_data_file_stops_both_ranks_with_one_line(make_job, tools):
    job = make_job("nodata", data="missing.json")
    started = time.monotonic()
    result = tools.train(job, nproc=2, timeout=120)
    assert result.returncode != 0
    lines = [l for l in result.stdout.splitlines() if l.startswith("jobgen-train: error:")]
    # One per rank that got that far: the first rank to fail ends its torchrun, which ends the
    # other rank, on a busy machine before it has read the job.
    assert set(lines) == {f"jobgen-train: error: training.data: file '{job.parent / 'missing.json'}' does not exist"}
    assert 1 <= len(lines) <= 2
    assert "jobgen/train/" not in result.stdout  # no traceback through the trainer
    report = tools.exit_report(job.parent)
    assert report["reason"] == "failed" and "does not exist" in report["message"]
    assert time.monotonic() - started < 120  # no waiting for the process-group timeout (3 min here)


def test_missing_model_and_invalid_job_exit_2_without_traceback(make_job, tools):
    job = make_job("nomodel", model="./models/nowhere")
    result = _run_cli(job, tools)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "jobgen-train: error: training.model: path './models/nowhere' does not exist (and it is not a hub name like org/name)"
    )
    assert "Traceback" not in result.stderr

    raw = yaml.safe_load(job.read_text())
    raw["training"]["learning_rat"] = 0.1
    job.write_text(yaml.safe_dump(raw))
    result = _run_cli(job, tools)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "unknown key 'training.learning_rat' (did you mean 'learning_rate'?)" in result.stderr


def test_unknown_lora_target_after_start_fails_every_rank_together(make_job, tools):
    job = make_job("target", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "c_attn"]})
    result = tools.train(job, nproc=2, timeout=120)
    assert result.returncode != 0
    assert "jobgen-train: error: training.lora.target_modules: ['c_attn'] not found" in result.stdout
    assert tools.exit_report(job.parent)["reason"] == "failed"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without usable CUDA: this one has it")
def test_gpu_job_where_cuda_is_unusable_is_an_error_not_a_cpu_run(make_job, tools):
    # The job decides the device: a GPU job never falls back to training on the CPU.
    job = make_job("nocuda", procs=1)
    raw = yaml.safe_load(job.read_text())
    raw["resources"]["gpus_per_node"], raw["launch"] = 1, {}
    job.write_text(yaml.safe_dump(raw))
    for entry in (["-m", "jobgen.train"], ["-m", "jobgen.train.probe"]):
        result = subprocess.run([sys.executable, *entry, "--job", str(job)], cwd=job.parent,
                                env=tools.subprocess_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        line = result.stderr.strip().splitlines()[-1]
        assert "error: resources.gpus_per_node is 1 but CUDA is not usable on" in line
        assert "set gpus_per_node: 0 and launch.procs_per_node for a CPU run" in line
        assert tools.exit_report(job.parent)["reason"] == "failed"
        assert not (job.parent / "output" / "checkpoints").exists()


def test_a_tracker_package_not_installed_is_one_line_before_the_model_loads(make_job, tools):
    job = make_job("nomlflow", procs=1, report_to=["wandb", "mlflow"])
    # mlflow is installed here: hide it from this one process, as on nodes without it.
    hide = "import sys; sys.modules['mlflow'] = None; from jobgen.train.__main__ import main; main()"
    result = subprocess.run([sys.executable, "-c", hide, "--job", str(job)], cwd=job.parent, env=tools.subprocess_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "jobgen-train: error: training.report_to has mlflow but the mlflow package is not installed on this node: "
        "pip install mlflow-skinny"
    )
    assert "Traceback" not in result.stderr and "loaded in" not in result.stderr  # before the model load
    assert not (job.parent / "trackers.json").exists()
