"""`jobgen init`: a newcomer's first job file, from flags (CI: never a prompt), from answers on a
terminal, or from a recipe (configs/recipes/), and `jobgen validate` passes on what it writes."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, jobgen, tiny_model

RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
CONVERSATION = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    # Enough records for the recipes' global batches (up to 256): fewer is a warning of validate's.
    (tmp_path / "data" / "chat.jsonl").write_text(CONVERSATION * 256)
    return tmp_path


def init(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`jobgen init` as CI runs it: no terminal, nothing on stdin (a prompt would fail, not wait)."""
    return subprocess.run([sys.executable, "-m", "jobgen.cli", "init", *args], cwd=cwd, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_with_every_flag_and_no_terminal_it_writes_a_job_that_validates(folder: Path) -> None:
    tiny_model(folder / "tiny")
    made = init("--model", "tiny/model", "--data", "data/chat.jsonl", "--method", "lora", "--nodes", "2",
                "--gpus-per-node", "0", "--scheduler", "slurm", "-o", "job.yaml", cwd=folder)
    assert made.returncode == 0, made.stderr
    assert made.stderr == "jobgen: wrote job.yaml; next: jobgen validate --scheduler slurm job.yaml\n"
    text = (folder / "job.yaml").read_text()
    assert text.startswith("# Written by `jobgen init`.")
    assert "  method: lora" in text and "# full | lora | qlora" in text  # each line says why it is there
    job = yaml.safe_load(text)
    assert job["resources"] == {"nodes": 2, "gpus_per_node": 0, "time_limit": "08:00:00"}
    assert job["launch"] == {"procs_per_node": 1} and job["training"]["precision"] == "fp32"
    checked = jobgen("validate", "-s", "slurm", "job.yaml", cwd=folder)
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr == ""  # a global batch of 64: no warning
    assert checked.stdout.startswith("job.yaml: ok: 2 node(s) x 1 process(es) = world size 2 (gloo); global batch 64;")


def test_without_a_terminal_a_missing_answer_is_one_line_not_a_prompt(folder: Path) -> None:
    made = init("--model", "Qwen/Qwen2.5-7B-Instruct", cwd=folder)
    assert (made.returncode, made.stdout) == (2, "")
    assert made.stderr == ("jobgen: error: --data is needed: stdin is not a terminal, so jobgen init asks nothing "
                           "(give --data, or --recipe NAME; --list-recipes shows them)\n")
    assert not (folder / "job.yaml").exists()


def test_answers_from_a_pipe_are_taken_one_a_line_in_the_questions_order(folder: Path) -> None:
    # model, data, method (empty: lora), nodes, GPUs per node, scheduler, partition, account, time limit
    answers = "tiny/model\ndata/chat.jsonl\n\n2\n0\nslurm\ngpu\nproj42\n1-00:00:00\n"
    made = subprocess.run([sys.executable, "-m", "jobgen.cli", "init"], cwd=folder, input=answers,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stderr.startswith("jobgen: wrote job.yaml; next: jobgen validate --scheduler slurm job.yaml\n"), made.stderr
    job = yaml.safe_load((folder / "job.yaml").read_text())
    assert job["name"] == "tiny-lora" and job["training"]["method"] == "lora"
    assert job["resources"] == {"nodes": 2, "gpus_per_node": 0, "partition": "gpu", "account": "proj42",
                                "time_limit": "1-00:00:00"}
    # A bad answer names its question's option; a pipe that ends early leaves the rest to defaults.
    bad = subprocess.run([sys.executable, "-m", "jobgen.cli", "init", "-o", "other.yaml"], cwd=folder,
                         input="tiny/model\ndata/chat.jsonl\ndora\n", capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("jobgen: error: --method: the answer 'dora' read from stdin: "), bad.stderr
    short = subprocess.run([sys.executable, "-m", "jobgen.cli", "init", "-o", "short.yaml", "-s", "pbs"], cwd=folder,
                           input="tiny/model\ndata/chat.jsonl\n", capture_output=True, text=True, timeout=120)
    assert short.returncode == 0, short.stderr
    assert yaml.safe_load((folder / "short.yaml").read_text())["resources"]["time_limit"] == "08:00:00"


def test_an_existing_file_is_replaced_only_with_force(folder: Path) -> None:
    (folder / "job.yaml").write_text("name: mine\n")
    args = ("--recipe", "qwen2.5-7b-lora", "--data", "data/chat.jsonl", "-s", "slurm")
    refused = init(*args, cwd=folder)
    assert (refused.returncode, refused.stderr) == (
        2, "jobgen: error: job.yaml exists: give --force to replace it, or -o to write another file\n")
    assert (folder / "job.yaml").read_text() == "name: mine\n"
    assert init(*args, "--force", cwd=folder).returncode == 0
    assert yaml.safe_load((folder / "job.yaml").read_text())["training"]["model"] == "Qwen/Qwen2.5-7B-Instruct"


def test_on_a_terminal_it_asks_for_what_no_flag_gives(folder: Path) -> None:
    tiny_model(folder / "tiny")
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "jobgen.cli", "init", "--nodes", "1"], cwd=folder,
                               stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    # model, data, method, GPUs per node (0), scheduler, queue, account, time limit; the nodes came as a flag
    answers = iter(["tiny/model", "data/chat.jsonl", "qlora", "0", "pbs", "workq", "", "12:00:00"])
    seen = b""
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        seen += chunk
        if chunk.rstrip().endswith(b":"):
            os.write(leader, next(answers).encode() + b"\n")
    process.wait(timeout=30)
    os.close(leader)
    shown = seen.decode(errors="replace")
    assert process.returncode == 0, shown
    for question in ("Model (hub name or local folder)", "Training data", "Method", "GPUs per node (0: CPUs) [8]", "Scheduler",
                     "Partition or queue", "Account to charge", "Time limit of each segment ([D-]HH:MM:SS) [08:00:00]"):
        assert question in shown
    assert "Nodes" not in shown
    job = yaml.safe_load((folder / "job.yaml").read_text())
    # Named after the folder that names the model (tiny), not the generic one inside it (model).
    assert job["name"] == "tiny-qlora" and job["training"]["method"] == "qlora"
    assert job["resources"] == {"nodes": 1, "gpus_per_node": 0, "partition": "workq", "time_limit": "12:00:00"}
    assert job["training"]["lora"] == {"r": 64, "alpha": 16, "dropout": 0.1}
    assert jobgen("validate", "-s", "pbs", "job.yaml", cwd=folder).returncode == 0


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_every_recipe_validates_and_starts_a_job_file(recipe: Path, folder: Path) -> None:
    data = yaml.safe_load(recipe.read_text())["training"]["data"]
    (folder / data).parent.mkdir(parents=True, exist_ok=True)
    (folder / data).write_text(CONVERSATION * 256)  # a recipe's global batch or more: no warning of too little data
    checked = jobgen("validate", "-s", "slurm", "--site", "none", str(recipe), cwd=folder)
    assert checked.returncode == 0, checked.stderr
    # The hub cannot be reached from the tests (HF_ENDPOINT): only that is warned of.
    assert [line for line in checked.stderr.splitlines() if "is not in the cache the nodes use" not in line] == []
    made = init("--recipe", recipe.stem, "--nodes", "2", "-s", "slurm", "-o", "from-recipe.yaml", cwd=folder)
    assert made.returncode == 0, made.stderr
    written = yaml.safe_load((folder / "from-recipe.yaml").read_text())
    original = yaml.safe_load(recipe.read_text())
    assert written["name"] == original["name"] and written["resources"]["nodes"] == 2
    assert {k: v for k, v in written["training"].items() if k != "gradient_accumulation"} == \
        {k: v for k, v in original["training"].items() if k != "gradient_accumulation"}
    again = jobgen("validate", "-s", "slurm", "--site", "none", "from-recipe.yaml", cwd=folder)
    assert again.returncode == 0, again.stderr


def test_an_unknown_recipe_names_the_closest(folder: Path) -> None:
    made = init("--recipe", "qwen2.5-lora", "--data", "x.jsonl", cwd=folder)
    assert made.returncode == 2
    assert made.stderr.startswith("jobgen: error: --recipe 'qwen2.5-lora' is not a recipe (did you mean 'qwen2.5-7b-lora'?); known: ")
