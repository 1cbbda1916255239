"""Each method trains under torchrun and leaves an output that transformers/peft load back."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import torch

from tests.train.conftest import subprocess_env


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]


def test_full_zero3_with_gradient_checkpointing_saves_a_loadable_model(make_job, tools, tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = make_job("full", method="full", zero_stage=3, gradient_checkpointing=True, epochs=1)
    result = tools.train(job)
    assert result.returncode == 0, result.stdout
    assert tools.exit_report(job.parent)["reason"] == "completed"
    final = job.parent / "output" / "final"
    trained = AutoModelForCausalLM.from_pretrained(final).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny / "model").state_dict()
    assert trained.keys() == initial.keys()
    assert all(trained[k].shape == initial[k].shape for k in initial)  # gathered, not ZeRO-3 shards
    assert all(not torch.equal(trained[k], initial[k]) for k in initial)
    assert AutoTokenizer.from_pretrained(final).convert_tokens_to_ids("<|im_end|>") is not None


def bitsandbytes_import_says() -> str:
    """What `import bitsandbytes` prints on this machine, as a CPU rank imports it (on a CPU with
    AVX-512 BF16 and no `kernels` package: "Failed to load CPU gemm_4bit_forward ..."); often nothing."""
    result = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(format='%(message)s'); "
                             "import bitsandbytes"], capture_output=True, text=True, timeout=300,
                            env=subprocess_env(CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr
    return result.stderr.strip()


def test_lora_rank_imports_neither_bitsandbytes_nor_mlflow_and_waits_in_a_collective_as_long_as_the_job_says(make_job, tools):
    # PYTHONPROFILEIMPORTTIME lists every module each process imports, so this holds on any CPU,
    # whether or not bitsandbytes would print anything here.
    job = make_job("lora-imports", max_steps=2, collective_timeout_minutes=7)
    result = tools.train(job, nproc=1, PYTHONPROFILEIMPORTTIME="1")  # every rank imports the same
    assert result.returncode == 0, result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stdout.splitlines() if line.startswith("import time:")}
    assert "peft" in imported and "deepspeed" in imported
    # peft's attempt is listed too, as `bitsandbytes` alone: refused at once. Importing it loads its
    # backends and layers (bitsandbytes.nn, bitsandbytes.backends.cpu.ops: where the warning is).
    assert sorted(name for name in imported if name.startswith("bitsandbytes.")) == []
    assert "gemm_4bit" not in result.stdout
    # DeepSpeed's autotuner imports mlflow when it is installed (here it is, for the tracker tests):
    # seconds of every rank's start-up for a tracker this job does not use.
    assert [name for name in imported if name.startswith("mlflow.")] == []  # its attempt, refused, may be listed
    # DeepSpeed's Muon module, imported by every ZeRO engine, decorates its kernels with
    # torch.compile, which imports torch._inductor: a CPU-second a rank, for an optimizer not used.
    assert "deepspeed.runtime.zero.muon.original_muon" in imported
    assert "torch._inductor.compile_fx" not in imported
    assert "process group: 1 ranks over gloo; a collective fails after 7 min (launch.collective_timeout_minutes)" in result.stdout


MUON_FIRST_CALL = """
import sys, torch
from jobgen.train.modeling import import_deepspeed
import_deepspeed()
from deepspeed.runtime.zero.muon import original_muon
assert "torch._inductor.compile_fx" not in sys.modules
compiled = []
def stand_in_compile(function=None, **options):  # what torch.compile returns: a function that runs it
    compiled.append(function.__name__)
    return lambda *args, **kwargs: ("compiled", function(*args, **kwargs))
torch.compile = stand_in_compile
G = torch.randn(8, 16)
first = original_muon.zeropower_via_newtonschulz5(G, 5)
second = original_muon.zeropower_via_newtonschulz5(G, 5)
assert compiled == ["zeropower_via_newtonschulz5"], compiled  # once, at the first call
assert first[0] == second[0] == "compiled" and torch.equal(first[1], second[1])
print("ok")
"""


def test_deepspeeds_muon_kernels_compile_at_their_first_call_with_a_stand_in_compiler_not_at_import():
    # The real compile takes 27 s on this CPU; by hand it gave the same bf16 tensor, bit for bit,
    # as DeepSpeed's own decorator. Here torch.compile is a stand-in that records its calls.
    result = subprocess.run([sys.executable, "-c", MUON_FIRST_CALL], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.splitlines()[-1:] == ["ok"], result.stdout + result.stderr


def test_qlora_bf16_trains_4bit_layers_and_saves_a_peft_adapter(make_job, tools, tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job = make_job("qlora", method="qlora", precision="bf16", epochs=1)
    result = tools.train(job, nproc=1)  # two nodes of Q-LoRA: tests/train/test_peer_snapshot.py
    assert result.returncode == 0, result.stdout
    assert "qlora: 14 linear layers in 4-bit NF4" in result.stdout
    for line in bitsandbytes_import_says().splitlines():  # a qlora job keeps what bitsandbytes says
        assert line in result.stdout
    final = job.parent / "output" / "final"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), final)
    saved = tools.adapter_weights(job.parent / "output")
    loaded = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert loaded and all(p.abs().sum() > 0 for p in loaded.values())  # lora_B starts at zero
    assert any(key.endswith("lora_B.weight") for key in saved)


QLORA_LOAD = """
import sys, torch
from jobgen.job.models import Training
from jobgen.train.modeling import load_model
model = load_model(Training(model=sys.argv[1], data="data.json", method="qlora"), "fp32", torch.device("cpu"))
print("mapped:", [line.split()[-1] for line in open("/proc/self/maps") if line.rstrip().endswith(".safetensors")])
print("4-bit:", sum(p.dtype == torch.uint8 for p in model.parameters()))
"""


def test_qlora_on_the_cpu_keeps_no_mapping_of_the_unquantized_weights_file(tiny):
    # The rank's memory holds the NF4 weights, not every page of the fp32 file they came from.
    result = subprocess.run([sys.executable, "-c", QLORA_LOAD, str(tiny / "model")], capture_output=True, text=True,
                            env=subprocess_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "4-bit: 14" in result.stdout
    assert "mapped: []" in result.stdout, result.stdout


def test_lora_zero3_length_grouped_runs_the_jobs_linear_schedule(make_job, tools, tiny):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    job = make_job(
        "lora3", zero_stage=3, group_by_length=True, lr_schedule="linear", warmup_steps=2,
        learning_rate=1e-3, epochs=1, logging_interval=2,
    )
    result = tools.train(job)
    assert result.returncode == 0, result.stdout
    lines = _metrics(job.parent)
    assert [l["step"] for l in lines] == [2, 4, 6]
    # lr after step s: warm-up s/2 up to step 2, then linear decay to 0 at step 6.
    for line in lines:
        s = line["step"]
        expected = 1e-3 * (s / 2 if s < 2 else (6 - s) / 4)
        assert math.isclose(line["lr"], expected, rel_tol=1e-9, abs_tol=1e-12), line
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), job.parent / "output" / "final")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.numel() > 0 and p.abs().sum() > 0 for p in lora_b)  # gathered from ZeRO-3 shards


def test_lora_bf16_adapters_are_bf16_and_saved_alone_under_zero2_and_zero3(make_job, tools, tiny):
    """ZeRO-3 used to keep peft's fp32 adapters while ZeRO-2 cast them to bf16; both now train and
    save the adapters in bf16, and ZeRO-3 saves the same adapter that ZeRO-2 does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved, counted = {}, {}
    for stage in (2, 3):
        job = make_job(f"lora-zero{stage}", zero_stage=stage, precision="bf16", epochs=1, max_steps=2)
        # ZeRO-3 on 2 ranks, where a rank's partitions hold no elements; ZeRO-2's cast needs one.
        result = tools.train(job, nproc=2 if stage == 3 else 1)
        assert result.returncode == 0, result.stdout
        assert "trainable parameters in bfloat16" in result.stdout, result.stdout
        # ZeRO-3's partitioned parameters hold no elements on a rank: the count is of the whole model
        # (it said 0 under ZeRO-3, seen on an H200).
        counted[stage] = int(re.search(r"(\d+) trainable parameters in", result.stdout).group(1))
        saved[stage] = tools.adapter_weights(job.parent / "output")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), job.parent / "output" / "final")
        assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert counted[3] == counted[2] == sum(t.numel() for t in saved[2].values()) > 0
    assert saved[3].keys() == saved[2].keys() and all("lora_" in key for key in saved[3])
    assert {str(t.dtype) for t in saved[3].values()} == {str(t.dtype) for t in saved[2].values()} == {"torch.bfloat16"}
    assert all(saved[3][k].shape == saved[2][k].shape for k in saved[2])  # gathered, not ZeRO-3 shards
