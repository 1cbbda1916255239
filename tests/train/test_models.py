"""training.model as users bring it: a model with code of its own (trust_remote_code), a
pre-quantized checkpoint, and a config.json transformers cannot load, refused by `validate` in one
line before the queue, and by the trainer before anything distributed."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import yaml

from tests.helpers import jobgen

CONFIGURATION = '''from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tinycustom"
'''
MODELING = '''from transformers import LlamaForCausalLM

from .configuration_tinycustom import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
'''
CODE_FILES = "configuration_tinycustom.py, modeling_tinycustom.py"


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def custom_model(tiny, tmp_path_factory):
    """The tiny model as a model type transformers lacks, built by code in its folder (auto_map)."""
    folder = tmp_path_factory.mktemp("custom") / "model"
    shutil.copytree(tiny / "model", folder)
    (folder / "configuration_tinycustom.py").write_text(CONFIGURATION)
    (folder / "modeling_tinycustom.py").write_text(MODELING)
    _edit_config(folder, model_type="tinycustom", architectures=["TinyCustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_tinycustom.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM",
    })
    return folder


def _validate(tmp_path, tiny, model, env=None, *options, **training):
    job = {"name": "m", "launch": {"procs_per_node": 2},
           "training": {"model": str(model), "data": str(tiny / "data.json"), **training}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return jobgen("validate", str(path), *options, cwd=tmp_path, env=env)


def errors(result) -> str:
    """stderr less its warnings (the tiny job's batch is far below the usual one)."""
    return "".join(line for line in result.stderr.splitlines(keepends=True) if not line.startswith("jobgen: warning:"))


def test_validate_refuses_a_models_own_code_without_trust_remote_code(tmp_path, tiny, custom_model):
    result = _validate(tmp_path, tiny, custom_model, None, "--site", "none")
    assert result.returncode == 2
    assert errors(result) == (
        f"jobgen: error: training.model: {custom_model} runs its own code ({CODE_FILES} in config.json's 'auto_map'); "
        "set training.trust_remote_code: true to run it on every node, or use a model transformers supports\n"
    )
    assert _validate(tmp_path, tiny, custom_model, None, "--site", "none", trust_remote_code=True).returncode == 0


def test_a_site_may_forbid_trust_remote_code(tmp_path, tiny, custom_model):
    (tmp_path / "sites").mkdir()
    (tmp_path / "sites" / "strict.yaml").write_text(yaml.safe_dump({"policy": {"allow_trust_remote_code": False}}))
    env = {"JOBGEN_SITE_PATH": str(tmp_path / "sites"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    result = _validate(tmp_path, tiny, custom_model, env, "--site", "strict", trust_remote_code=True)
    assert result.returncode == 2
    assert errors(result).endswith(
        "training.trust_remote_code is true, but site strict forbids running a model's own code "
        f"(policy.allow_trust_remote_code: false in {tmp_path / 'sites' / 'strict.yaml'}); use a model that "
        "transformers supports\n"
    )


def test_a_model_with_its_own_code_trains_with_trust_remote_code_and_is_refused_without(
        custom_model, tools, tmp_path, tiny):
    modules = {"HF_MODULES_CACHE": str(tmp_path / "modules")}  # where transformers copies the model's code
    refused = tools.write_job(tmp_path / "refused", tiny, procs=1, model=str(custom_model), max_steps=2)
    result = tools.train(refused, nproc=1, **modules)
    assert result.returncode != 0
    assert (f"jobgen-train: error: training.model: {custom_model} runs its own code ({CODE_FILES} in config.json's "
            "'auto_map'); set training.trust_remote_code: true") in result.stdout
    assert "jobgen/train/" not in result.stdout  # no traceback through the trainer (torchrun prints its own)

    job = tools.write_job(tmp_path / "trusted", tiny, model=str(custom_model), trust_remote_code=True, max_steps=2)
    result = tools.train(job, nproc=1, **modules)
    assert result.returncode == 0, result.stdout
    assert f"training.trust_remote_code: running the code that {custom_model} ships: {CODE_FILES}" in result.stdout
    assert tools.adapter_weights(job.parent / "output")  # adapters of the custom model, trained


def test_config_fields_that_cannot_load_are_named(tmp_path, tiny):
    folder = tmp_path / "model"
    shutil.copytree(tiny / "model", folder)
    _edit_config(folder, model_type="not_a_model_type")
    result = _validate(tmp_path, tiny, folder, None, "--site", "none")
    assert result.returncode == 2
    assert (f"training.model: {folder / 'config.json'}: model_type 'not_a_model_type' is not known to the transformers "
            "installed here and the model has no code of its own ('auto_map'); upgrade transformers") in result.stderr
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
    result = _validate(tmp_path, tiny, folder, None, "--site", "none")
    assert f"training.model: {folder / 'config.json'} has no 'model_type'" in result.stderr


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


@pytest.fixture
def gptq_model(tiny, tmp_path):
    """The tiny model's config as a GPTQ checkpoint's (Qwen/Qwen-7B-Chat-Int4 is one)."""
    folder = tmp_path / "gptq"
    shutil.copytree(tiny / "model", folder)
    _edit_config(folder, quantization_config=GPTQ)
    return folder


def test_a_gptq_checkpoint_trains_only_as_qlora(tmp_path, tiny, gptq_model):
    result = _validate(tmp_path, tiny, gptq_model, None, "--site", "none", method="lora")
    assert result.returncode == 2
    assert errors(result) == (
        f"jobgen: error: training.model: {gptq_model} is a pre-quantized GPTQ checkpoint (quantization_config.quant_method), "
        "which method lora cannot train; set training.method: qlora to train LoRA adapters on its GPTQ weights, or use "
        "the model's unquantized checkpoint\n"
    )


@pytest.mark.skipif(importlib.util.find_spec("gptqmodel") is not None, reason="gptqmodel is installed here")
def test_a_gptq_checkpoint_without_its_packages_is_refused_before_the_queue(tmp_path, tiny, gptq_model):
    result = _validate(tmp_path, tiny, gptq_model, None, "--site", "none", method="qlora")
    assert result.returncode == 2
    assert errors(result).startswith(f"jobgen: error: training.model: {gptq_model} is a pre-quantized GPTQ checkpoint; "
                                    "training adapters on it needs ")
    assert "gptqmodel" in result.stderr and errors(result).count("\n") == 1


def test_a_gptq_checkpoint_loads_with_its_own_quantization_not_bitsandbytes(gptq_model, tiny):
    from jobgen.job.models import Training
    from jobgen.train.modeling import prequantized

    training = Training(model=str(gptq_model), data="d.json", method="qlora")
    assert prequantized(training) == "gptq"  # load_model then passes no BitsAndBytesConfig
    assert prequantized(training.model_copy(update={"model": str(tiny / "model")})) is None
