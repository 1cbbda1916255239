"""`jobgen export`: a real LoRA run's final adapter (tests/local_run.py: the tiny model, stopped with
Ctrl-C and resumed to its end) merged into its base with peft, and what a bad target says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import jobgen

PROMPT = [{"role": "user", "content": "What does a scheduler do with a preempted job?"}]

# Runs where peft cannot be imported: the merged folder must load with transformers alone.
LOGITS_WITHOUT_PEFT = """
import sys
sys.modules["peft"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, out = sys.argv[1:]
tokenizer = AutoTokenizer.from_pretrained(folder)
ids = tokenizer.apply_chat_template({prompt!r}, add_generation_prompt=True, return_tensors="pt", return_dict=True)
with torch.no_grad():
    torch.save(AutoModelForCausalLM.from_pretrained(folder).eval()(**ids).logits, out)
"""


def test_a_lora_run_merged_gives_the_peft_models_logits_and_loads_without_peft(stopped_and_resumed_run, tmp_path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = stopped_and_resumed_run.run_dir
    base = run.parent.parent / "tiny" / "model"  # training.model is tiny/model, relative to where it was submitted
    out = tmp_path / "merged"
    # From another folder: the base is found where the run was submitted, not here.
    exported = jobgen("export", str(run), "--merge", "-o", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert exported.stderr.splitlines()[-1] == f"jobgen: exported {base} with the adapter merged in: {out}"
    assert "accelerator" not in exported.stdout + exported.stderr  # DeepSpeed's import line is not for the user
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert not (out / "adapter_config.json").exists()
    # Made to be shared: every file and folder as the user's umask makes them (was -rw------- once).
    mask = os.umask(0)
    os.umask(mask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in [out, *out.rglob("*")]}
    assert modes == {name: (0o777 if (out / name).is_dir() or name == out.name else 0o666) & ~mask for name in modes}, modes

    script = tmp_path / "logits.py"
    script.write_text(LOGITS_WITHOUT_PEFT.format(prompt=PROMPT))
    loaded = subprocess.run([sys.executable, str(script), str(out), str(tmp_path / "merged.pt")], capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    merged_logits = torch.load(tmp_path / "merged.pt")

    tokenizer = AutoTokenizer.from_pretrained(run / "output" / "final")
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        base_model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        base_logits = base_model.eval()(**ids).logits
        peft_logits = PeftModel.from_pretrained(base_model, run / "output" / "final").eval()(**ids).logits
    assert not torch.allclose(peft_logits, base_logits, atol=1e-4), "the adapter changes nothing: the test shows nothing"
    assert torch.allclose(merged_logits, peft_logits, atol=1e-5, rtol=1e-4), (merged_logits - peft_logits).abs().max()


def test_an_export_without_merge_is_the_adapter_with_its_base_where_this_machine_finds_it(stopped_and_resumed_run, tmp_path) -> None:
    import json

    run = stopped_and_resumed_run.run_dir
    out = tmp_path / "adapter"
    exported = jobgen("export", str(run / "output"), "-o", str(out), cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(run.parent.parent / "tiny" / "model")
    again = jobgen("export", str(run / "output"), "-o", str(out), cwd=tmp_path)
    assert again.returncode == 2 and again.stderr == f"jobgen: error: {out} exists: give --force to replace it, or -o another folder\n"


@pytest.mark.parametrize("layout, message", [
    ({}, "{target}: not a run directory (job.yaml), an output folder (final/) or a model folder (adapter_config.json "
         "or config.json); give runs/NAME or runs/NAME/output/final"),
    ({"job.yaml": "name: x\n"}, "{target}/output/final: no final model yet: the run has not completed (`jobgen status "
                                "{target}` says where it stands); a checkpoint is not exported"),
])
def test_a_target_without_a_final_model_is_one_line(layout: dict, message: str, tmp_path: Path) -> None:
    target = tmp_path / "runs" / "x"
    target.mkdir(parents=True)
    for name, text in layout.items():
        (target / name).write_text(text)
    result = jobgen("export", str(target), "--merge")
    assert (result.returncode, result.stderr) == (2, f"jobgen: error: {message.format(target=target)}\n")


def test_without_the_training_side_export_says_what_to_install(tmp_path: Path) -> None:
    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    code = "import sys; sys.modules['peft'] = None; from jobgen.cli import main; sys.argv[0] = 'jobgen'; main()"
    result = subprocess.run([sys.executable, "-c", code, "export", str(final), "--merge"], capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (
        2, "jobgen: error: jobgen export needs the training side (peft is not installed): install torch for your "
           "machine, then pip install 'jobgen[train]'\n")
