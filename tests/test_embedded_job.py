"""The job a script embeds is what the job sets (the values that differ from the defaults), and
jobgen-train rebuilds the very job that was rendered from it, or refuses to run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from jobgen.errors import UserError
from jobgen.job.dump import as_set_yaml, complete_yaml, digest
from jobgen.job.layers import resolve_job
from jobgen.job.models import Job
from jobgen.job.yamlfile import parse_yaml
from jobgen.train.__main__ import load_job
from tests.helpers import EXAMPLES, REPO, jobgen


def embedded_job(script: str) -> str:
    match = re.search(r"<<'JOBGEN_JOB_YAML'\n(.*?)^JOBGEN_JOB_YAML$", script, re.S | re.M)
    assert match, "no embedded job"
    return match.group(1)


def without_comments(text: str) -> dict:
    return yaml.safe_load(text)


@pytest.mark.parametrize("config", EXAMPLES, ids=[c.stem for c in EXAMPLES])
def test_the_script_embeds_only_what_the_job_sets_and_the_trainer_rebuilds_the_job_exactly(config: Path, tmp_path: Path) -> None:
    result = jobgen("render", "-s", "slurm", str(config.relative_to(REPO)), cwd=REPO)
    assert result.returncode == 0, result.stderr
    text = embedded_job(result.stdout)
    job = resolve_job(config).job
    assert without_comments(text) == job.model_dump(mode="json", exclude_defaults=True)
    written = tmp_path / "job.yaml"  # as the batch script writes it into the run directory
    written.write_text(text)
    assert load_job(str(written)) == job


def test_the_llama_example_embeds_its_own_values_not_the_defaults() -> None:
    config = REPO / "configs" / "examples" / "llama-lora-2node.yaml"
    text = embedded_job(jobgen("render", "-s", "slurm", str(config), cwd=REPO, check=True).stdout)
    values = without_comments(text)
    assert values["training"] == {
        "model": "meta-llama/Meta-Llama-3-8B", "data": "data/conversations.json", "per_device_batch_size": 4,
        "gradient_accumulation": 2, "warmup_steps": 50, "max_length": 4096, "save_interval": 100,
    }  # method: lora, zero_stage: 2, lr_schedule: cosine, ... are the defaults the job file repeats
    assert "requeue" not in values and "container" not in values
    assert len(text.splitlines()) < len(complete_yaml(resolve_job(config).job).splitlines()) / 2


def test_a_site_profiles_values_are_embedded_too(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"defaults": {"resources": {"partition": "gpu"}, "launch": {"network": "roce"}}}))
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"launch": {"procs_per_node": 1}, "training": {"model": "m", "data": "d"}}))
    result = jobgen("render", "-s", "slurm", "--site", str(site), "--set", "training.seed=7", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert without_comments(embedded_job(result.stdout)) == {
        "resources": {"partition": "gpu"}, "launch": {"procs_per_node": 1, "network": "roce"},
        "training": {"model": "m", "data": "d", "seed": 7},
    }


def rendered_file(tmp_path: Path, job: Job, text: str | None = None) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(as_set_yaml(job) if text is None else text)
    return path


JOB = Job.model_validate({"launch": {"procs_per_node": 2}, "training": {"model": "m", "data": "d", "max_steps": 10}})


def test_the_trainer_refuses_a_job_another_jobgens_defaults_would_change(tmp_path: Path) -> None:
    # Another jobgen whose default keep_checkpoints was 3: it wrote the same values (3 was its
    # default), but its complete job, and so its digest, had keep_checkpoints 3.
    theirs = JOB.model_copy(update={"training": JOB.training.model_copy(update={"keep_checkpoints": 3})})
    text = re.sub(r"jobgen \S+, sha256 [0-9a-f]{64}", f"jobgen 0.0.9, sha256 {digest(theirs)}", as_set_yaml(JOB))
    with pytest.raises(UserError) as refused:
        load_job(str(rendered_file(tmp_path, JOB, text)))
    assert str(refused.value) == (
        f"{tmp_path / 'job.yaml'}: jobgen 0.0.9 wrote this job with only the values that differ from its defaults, "
        "and jobgen 0.1.0 here fills in other defaults, so it would run a job other than the one rendered: run "
        "jobgen 0.0.9 here (environment.setup), or render and submit the job again with jobgen 0.1.0"
    )


def test_the_trainer_refuses_a_rendered_job_edited_since_unless_its_digest_line_goes(tmp_path: Path) -> None:
    edited = as_set_yaml(JOB).replace("max_steps: 10", "max_steps: 20")
    with pytest.raises(UserError, match="not the job jobgen rendered .* delete its '# complete job:' line"):
        load_job(str(rendered_file(tmp_path, JOB, edited)))
    as_now = "".join(line for line in edited.splitlines(keepends=True) if not line.startswith("# complete job:"))
    assert load_job(str(rendered_file(tmp_path, JOB, as_now))).training.max_steps == 20


# Each field with values that differ from its default and the default itself, so that a job may
# also write a default out (it is then left out of the embedded job, and rebuilt the same).
CHOICES: dict[str, list] = {
    "name": ["jobgen", "a job", "ünï €"],
    "run_dir": [None, "runs/x", "/abs path/x"],
    "resources.nodes": [1, 2, 64],
    "resources.gpus_per_node": [0, 4, 8],
    "resources.cpus_per_node": [None, 1, 64],
    "resources.memory_per_node": [None, "64G", "512M", "1T"],
    "resources.time_limit": ["04:00:00", "00:10:00", "1-12:00:00"],
    "resources.partition": [None, "gpu"],
    "resources.account": [None, "ml"],
    "resources.exclusive": [False, True],
    "resources.chunk_resources": [{}, {"ompthreads": 8, "bigmem": True, "host_type": "a100"}],
    "launch.master_port": ["auto", 29500],
    "launch.rendezvous": ["static", "c10d"],
    "launch.network": ["auto", "infiniband", "ethernet"],
    "launch.socket_ifname": [None, "ib0"],
    "launch.nccl_debug": [None, "WARN"],
    "launch.entrypoint": ["jobgen-train", "jobgen-probe"],
    "launch.launcher": [None, "srun", "ssh"],
    "launch.ssh_options": [[], ["-p", "2222"]],
    "launch.collective_timeout_minutes": [30, 1, 1440],
    "environment.modules": [[], ["cuda/12.4"]],
    "environment.setup": [[], ["source ~/venv/bin/activate"]],
    "environment.variables": [{}, {"HF_HOME": "/scratch", "EMPTY": ""}],
    "environment.secrets": [[], ["HF_TOKEN"]],
    "training.method": ["lora", "full", "qlora"],
    "training.zero_stage": [2, 3],
    "training.precision": ["bf16", "fp16", "fp32"],
    "training.per_device_batch_size": [1, 4],
    "training.learning_rate": [2e-4, 0.0002, 1e-5, 1],
    "training.lr_schedule": ["cosine", "constant"],
    "training.weight_decay": [0.0, 0, 0.1],
    "training.epochs": [1, 3],
    "training.max_steps": [None, 100],
    "training.save_interval": [200, 50],
    "training.async_save": [True, False],
    "training.step_seconds_estimate": [None, 1.5],
    "training.output_dir": ["output", "out/x"],
    "training.lora.r": [16, 8],
    "training.lora.dropout": [0.05, 0.0, 0.1],
    "training.lora.target_modules": [
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj"], []],
    "training.packing": [False, True],
    "training.seed": [42, 0],
    "training.deepspeed_config": [None, "ds.json"],
    "requeue.enabled": [True, False],
    "requeue.signal": ["USR1", "TERM"],
    "requeue.warning_seconds": [180, 30],
    "container.runtime": [None, "apptainer"],
    "container.mounts": [[], ["/scratch/data:/data:ro"]],
    "extra_directives": [[], ["#SBATCH --reservation=ft", "#PBS -m a"]],
}


@st.composite
def jobs(draw) -> Job:
    data: dict = {"training": {"model": "m", "data": "d"}}
    for dotted, choices in CHOICES.items():
        if draw(st.booleans()):
            *parents, key = dotted.split(".")
            target = data
            for part in parents:
                target = target.setdefault(part, {})
            target[key] = draw(st.sampled_from(choices))
    gpus = data.get("resources", {}).get("gpus_per_node", 0)
    data.setdefault("launch", {})["procs_per_node"] = draw(st.sampled_from([1, 2])) if gpus == 0 else draw(st.sampled_from([None, gpus]))
    if data["training"].get("method") == "qlora":
        data["training"]["zero_stage"] = 2
    if data.get("container", {}).get("runtime") and draw(st.booleans()):
        data["container"]["image"] = "/images/ft.sif"
    return Job.model_validate(data)


@settings(max_examples=300, deadline=None)
@given(job=jobs())
def test_any_job_is_rebuilt_exactly_from_what_it_sets(job: Job) -> None:
    text = as_set_yaml(job)
    assert Job.model_validate(parse_yaml(text)) == job
    assert without_comments(text) == job.model_dump(mode="json", exclude_defaults=True)  # not the complete job
    assert f"sha256 {digest(job)}" in text
