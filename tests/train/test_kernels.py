"""training.attention and training.liger_kernel: which kernels compute the model.

Liger's kernels are Triton kernels for GPUs, and flash-attn needs one too, so on the CPU these tests
check what a CPU job and a node without the package see; the GPU path itself runs in
benchmarks/gpu_finetune.py (the nemo-*-liger runs, BENCHMARKS.md).
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from tests.helpers import jobgen


def _validate(tmp_path, tiny, **training):
    job = {"name": "kernels", "launch": {"procs_per_node": 2},
           "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), **training}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return jobgen("validate", str(path), "--site", "none", cwd=tmp_path)


def test_a_cpu_job_with_liger_or_flash_attention_is_refused_before_the_queue(tmp_path, tiny):
    result = _validate(tmp_path, tiny, liger_kernel=True)
    assert result.returncode == 2
    assert ("training.liger_kernel: Liger's kernels run on GPUs only; set it false for a CPU job "
            "(resources.gpus_per_node is 0)") in result.stderr
    result = _validate(tmp_path, tiny, attention="flash_attention_2")
    assert result.returncode == 2
    assert "training.attention: flash_attention_2 runs on GPUs only; use sdpa or auto" in result.stderr
    assert _validate(tmp_path, tiny, attention="sdpa").returncode == 0


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_attention_implementation_named_is_the_one_the_model_runs(tiny, attention):
    from jobgen.job.models import Training
    from jobgen.train.modeling import load_model

    training = Training(model=str(tiny / "model"), data="d.json", method="full", attention=attention)
    model = load_model(training, "fp32", torch.device("cpu"))
    assert model.config._attn_implementation == attention


def test_liger_on_a_node_without_the_package_is_one_line(tiny, monkeypatch):
    from jobgen.errors import UserError
    from jobgen.job.models import Training
    from jobgen.train.modeling import load_model

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # not importable, as on a node without it
    training = Training(model=str(tiny / "model"), data="d.json", liger_kernel=True)
    with pytest.raises(UserError) as raised:
        load_model(training, "fp32", torch.device("cpu"))
    assert str(raised.value).startswith("training.liger_kernel: the liger-kernel package is not importable on this node")
    assert str(raised.value).endswith("pip install liger-kernel, or set liger_kernel false")
    assert "\n" not in str(raised.value)


def test_changing_kernels_does_not_block_a_resume():
    from jobgen.job.models import Training
    from jobgen.train.prepare import resume_settings

    plain = Training(model="m", data="d.json")
    fast = Training(model="m", data="d.json", liger_kernel=True, attention="sdpa")
    assert resume_settings(plain) == resume_settings(fast)
