"""`jobgen render`: safe quoting, layering, site overrides, and what a login node imports."""

from __future__ import annotations

import json
import re
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobgen.job.dump import as_set_yaml
from jobgen.job.layers import resolve_job
from jobgen.job.models import Job
from jobgen.script.render import job_yaml, render
from jobgen.train.__main__ import load_job
from tests.helpers import cannot_run, jobgen, node_script_of, shell_findings

HOSTILE = [
    "$(touch PWNED)",
    "`touch PWNED`",
    "'; touch PWNED; echo '",
    '"; touch PWNED; echo "',
    "a\nJOBGEN_JOB_YAML\ntouch PWNED",
    "a\nJOBGEN_NODE_SCRIPT\ntouch PWNED",
    "${HOME} $PATH * ? [a]",
    "two words\ttab\\backslash",
]
SECRET = "s3cr3t $(touch PWNED) 'q'"


def write_job(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def cpu_job(**training) -> dict:
    return {
        "name": "t",
        "resources": {"nodes": 2, "gpus_per_node": 0},
        "launch": {"procs_per_node": 1},
        "training": {"model": "m", "data": "d", **training},
    }


FAKE_TORCHRUN = """#!/bin/bash
# Stands in for torchrun: records what the node script handed it, then plays a trainer that completed.
out="$JOBGEN_RUN_DIR/torchrun-node$NODE_RANK.json"
python3 - "$out" "$@" <<'PY'
import json, os, sys
json.dump({"argv": sys.argv[2:], "env": dict(os.environ)}, open(sys.argv[1], "w"))
PY
if [ "$NODE_RANK" = 0 ]; then
  echo '{"reason": "completed", "first_step": 0, "last_step": 3}' > "$JOBGEN_RUN_DIR/trainer-exit.json"
fi
"""


def test_hostile_values_reach_the_trainer_intact_with_fake_torchrun(tmp_path: Path) -> None:
    """Runs the rendered local script for real; only torchrun is replaced, to see what arrives."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # node.sh starts torchrun through jobgen-torchrun (torchrun without a traceback at a stop).
    (bin_dir / "jobgen-torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "jobgen-torchrun").chmod(0o755)
    variables = {f"V{i}": value for i, value in enumerate(HOSTILE)}
    job = cpu_job(model=HOSTILE[0], data=HOSTILE[2])
    job["name"] = HOSTILE[1]
    job["run_dir"] = "run dir $(touch PWNED)"
    job["environment"] = {"variables": variables, "secrets": ["MY_SECRET"]}
    config = write_job(tmp_path / "job.yaml", job)

    result = jobgen("render", "--scheduler", "local", str(config), "-o", str(tmp_path / "job.sh"))
    assert result.returncode == 0, result.stderr
    # The fake torchrun first; jobgen-train (which it never starts) must still be on PATH.
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {**os.environ, "PATH": path, "MY_SECRET": SECRET}
    run = subprocess.run(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    assert run.returncode == 0, run.stdout + run.stderr
    assert not list(tmp_path.rglob("PWNED")), "a value was executed by the shell"
    run_dir = tmp_path / "run dir $(touch PWNED)"
    for rank in (0, 1):
        seen = json.loads((run_dir / f"torchrun-node{rank}.json").read_text())
        for name, value in variables.items():
            assert seen["env"][name] == value
        assert seen["env"]["MY_SECRET"] == SECRET
        assert seen["env"]["NODE_RANK"] == str(rank)
        assert seen["env"]["NNODES"] == "2"
        assert seen["argv"][-2:] == ["--job", str(run_dir / "job.yaml")]
    trained = load_job(str(run_dir / "job.yaml"))  # as jobgen-train reads it, its defaults added back
    assert trained == resolve_job(config).job
    assert trained.training.model == HOSTILE[0] and trained.name == HOSTILE[1]
    assert SECRET not in (tmp_path / "job.sh").read_text(), "a secret's value was written into the script"
    assert not (run_dir / "node.env").exists(), "the file holding secrets outlived the job"


def test_a_setup_line_equal_to_a_heredoc_terminator_is_refused_rather_than_run_as_the_script(tmp_path: Path) -> None:
    # Setup lines are shell by intent and go into node.sh as written, so this one would end the
    # embedded node script early and run the rest of it in the batch shell.
    job = cpu_job()
    job["environment"] = {"setup": ["echo ok", "JOBGEN_NODE_SCRIPT", "touch PWNED"]}
    result = jobgen("render", "-s", "slurm", str(write_job(tmp_path / "j.yaml", job)))
    assert result.returncode == 2 and not result.stdout
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == ["jobgen: error: a value in the job contains the line 'JOBGEN_NODE_SCRIPT', which jobgen reserves"]


@settings(max_examples=50, deadline=None)
@given(value=st.sampled_from(["JOBGEN_JOB_YAML", "a\nJOBGEN_JOB_YAML\nb", "x" * 995 + " JOBGEN_JOB_YAML", "\nJOBGEN_JOB_YAML"])
       | st.lists(st.sampled_from(["JOBGEN_JOB_YAML", "\n", " ", "x", "'", '"']), max_size=12).map("".join))
def test_no_value_puts_the_job_yaml_terminator_on_a_line_of_its_own(value: str) -> None:
    # The job YAML needs its guard only for text jobgen does not quote: YAML indents every value.
    job = Job.model_validate({**cpu_job(), "run_dir": value, "environment": {"variables": {"X": value}}})
    assert "JOBGEN_JOB_YAML" not in job_yaml(job).splitlines()
    assert "JOBGEN_JOB_YAML" not in as_set_yaml(job).splitlines()  # what the script embeds


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)
values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",), exclude_characters="\x00"), max_size=40)
env_names = st.from_regex(r"[A-Z][A-Z0-9_]{0,10}", fullmatch=True).filter(lambda n: not n.startswith(("SLURM_", "PBS_")))


@st.composite
def random_jobs(draw) -> dict:
    gpus = draw(st.sampled_from([0, 1, 4, 8]))
    job = {
        "name": draw(names.filter(lambda s: all(ord(c) >= 32 for c in s))),
        "resources": {
            "nodes": draw(st.integers(1, 64)),
            "gpus_per_node": gpus,
            "time_limit": draw(st.sampled_from(["00:10:00", "04:00:00", "2-00:00:00"])),
            "exclusive": draw(st.booleans()),
        },
        "launch": {"master_port": draw(st.sampled_from(["auto", 29500])), "rendezvous": draw(st.sampled_from(["static", "c10d"]))},
        "environment": {"variables": draw(st.dictionaries(env_names.filter(lambda n: n not in {"NNODES", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}), values, max_size=4))},
        "training": {"model": draw(values.filter(bool)), "data": draw(values.filter(bool)), "method": draw(st.sampled_from(["full", "lora", "qlora"]))},
        "requeue": {"enabled": draw(st.booleans()), "signal": draw(st.sampled_from(["USR1", "USR2", "TERM"]))},
    }
    if gpus == 0:
        job["launch"]["procs_per_node"] = draw(st.integers(1, 4))
    return job


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(job=random_jobs())
def test_random_valid_jobs_render_scripts_that_pass_bash_and_shellcheck(job: dict, tmp_path_factory, shellcheck: str) -> None:
    folder = tmp_path_factory.mktemp("prop")
    config = write_job(folder / "job.yaml", job)
    resolved = resolve_job(config)
    files = []
    for scheduler in ("slurm", "pbs", "torque", "local"):
        script = render(resolved, scheduler)
        for kind, text in (("job", script), ("node", node_script_of(script))):
            path = folder / f"{scheduler}-{kind}.sh"
            path.write_text(text)
            files.append(path)
    assert shell_findings(*files) == ""


@pytest.mark.parametrize("scheduler,launcher", [("pbs", "pbs_tmrsh"), ("pbs", "ssh"), ("pbs", "mpiexec"), ("torque", "ssh"), ("torque", "mpiexec")])
def test_every_launcher_renders_scripts_that_pass_bash_and_shellcheck(tmp_path: Path, scheduler: str, launcher: str, shellcheck: str) -> None:
    # The scheduler's default launchers are rendered by tests/test_examples.py; these run for real
    # in tests/test_launchers.py.
    job = cpu_job()
    job["launch"].update(launcher=launcher, ssh_options=["-F", "/etc/my cluster/ssh_config $(touch PWNED)", "-p2222"])
    job["environment"] = {"modules": ["cuda/12.4", "gcc@12.2"]}
    script = render(resolve_job(write_job(tmp_path / "job.yaml", job)), scheduler)
    (tmp_path / "job.sh").write_text(script)
    (tmp_path / "node.sh").write_text(node_script_of(script))
    assert shell_findings(tmp_path / "job.sh", tmp_path / "node.sh") == ""
    if launcher == "ssh":
        assert "exec ssh -F '/etc/my cluster/ssh_config $(touch PWNED)' -p2222 -tt -o BatchMode=yes" in script


def test_layers_apply_in_order_defaults_site_job_set(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"defaults": {"resources": {"partition": "site-part", "account": "site-acct", "qos": "site-qos"}}}))
    job = cpu_job()
    job["resources"].update({"account": "job-acct", "qos": "job-qos"})
    config = write_job(tmp_path / "job.yaml", job)
    resolved = resolve_job(config, str(site), ("resources.qos=cli-qos",))
    res = resolved.job.resources
    assert (res.partition, res.account, res.qos, res.time_limit) == ("site-part", "job-acct", "cli-qos", "04:00:00")


def test_site_profile_by_name_and_its_template_override(tmp_path: Path) -> None:
    config = write_job(tmp_path / "job.yaml", cpu_job())
    result = jobgen("render", "-s", "slurm", "--site", "example-slurm-ib", str(config))
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=gpu" in result.stdout and "#SBATCH --mail-type=FAIL" in result.stdout
    assert "submit from /scratch" in result.stdout, "the site's template override was not used"
    assert "srun --nodes" in result.stdout, "the override lost the bundled template's body"


def test_site_path_environment_variable_finds_profiles(tmp_path: Path) -> None:
    (tmp_path / "mysite.yaml").write_text(yaml.safe_dump({"defaults": {"resources": {"partition": "from-env"}}}))
    config = write_job(tmp_path / "job.yaml", cpu_job())
    result = jobgen("render", "-s", "slurm", "--site", "mysite", str(config), env={"JOBGEN_SITE_PATH": str(tmp_path)})
    assert "#SBATCH --partition=from-env" in result.stdout, result.stderr


def test_output_file_is_written_0644_and_nothing_on_stdout(tmp_path: Path) -> None:
    config = write_job(tmp_path / "job.yaml", cpu_job())
    out = tmp_path / "job.sbatch"
    result = jobgen("render", "-s", "slurm", str(config), "-o", str(out))
    assert result.returncode == 0 and result.stdout == ""
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    assert out.read_text().startswith("#!/bin/bash\n#SBATCH --job-name=t\n")


def test_derived_values_are_in_the_header(tmp_path: Path) -> None:
    job = cpu_job(per_device_batch_size=4, gradient_accumulation=8)
    job["resources"]["nodes"] = 4
    job["launch"]["procs_per_node"] = 2
    script = render(resolve_job(write_job(tmp_path / "j.yaml", job)), "slurm")
    assert "4 node(s) x 2 process(es) = world size 8 (gloo)" in script
    assert "global batch 256 = 4 per device x 8 processes x 8 accumulation" in script


def test_render_imports_no_training_library_nor_plugin_scan(tmp_path: Path) -> None:
    config = write_job(tmp_path / "job.yaml", cpu_job())
    code = (
        "import sys; from jobgen.cli import main\n"
        f"try: main(['render', '-s', 'slurm', {str(config)!r}])\n"
        "except SystemExit: pass\n"
        # importlib.metadata: pydantic's plugin scan, which jobgen.cli.startup spares a command.
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'transformers', 'peft', 'submitit', 'importlib.metadata')\n"
        "               if m in sys.modules)\n"
        "print('HEAVY', heavy, file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "HEAVY []" in result.stderr, result.stderr


def test_schema_is_json_schema_of_the_job_file() -> None:
    result = jobgen("schema")
    schema = json.loads(result.stdout)
    # training or, for a program of the job's own, launch.command: neither is required alone
    assert schema["title"] == "Job" and "training" in schema["properties"] and "command" in schema["$defs"]["Launch"]["properties"]
    assert "gpus_per_node" in schema["$defs"]["Resources"]["properties"]
    timeout = schema["$defs"]["Launch"]["properties"]["collective_timeout_minutes"]
    assert (timeout["default"], timeout["minimum"], timeout["maximum"]) == (30, 1, 1440)
    assert timeout["description"].startswith("how long a jobgen-train rank waits in one collective")


@pytest.mark.parametrize("minutes", [0, 1441, 2.5])
def test_collective_timeout_is_whole_minutes_up_to_a_day(tmp_path: Path, minutes) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"launch": {"procs_per_node": 1, "collective_timeout_minutes": minutes},
                                      "training": {"model": "m", "data": "d"}}))
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 2 and f"'launch.collective_timeout_minutes' is {minutes}" in result.stderr


def master_ports(script: str, job_ids: list[str], ephemeral: tuple[int, int] | None = None) -> list[int]:
    """The automatic MASTER_PORT of each job id, by the script's own lines; `ephemeral`: the
    ephemeral port range of the network namespace they run in (a new one, as root)."""
    lines = script.split("\n")
    export = next(index for index, line in enumerate(lines) if line.startswith("export MASTER_PORT="))
    first = max(index for index in range(export) if lines[index].startswith("#")) + 1  # below its comment
    lines = "\n".join(lines[first:export + 1])
    program = f'set -eo pipefail\nport() {{\n{lines}\n}}\nfor JOBGEN_JOB_ID in "$@"; do port; echo "$MASTER_PORT"; done'
    argv = ["bash", "-c", program, "bash", *job_ids]
    if ephemeral:
        argv = ["unshare", "--net", "sh", "-c", 'echo "$1 $2" > /proc/sys/net/ipv4/ip_local_port_range && shift 2 && exec "$@"',
                "sh", *map(str, ephemeral), *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(port) for port in out.stdout.split()]


def local_script(tmp_path: Path) -> str:
    return render(resolve_job(write_job(tmp_path / "j.yaml", cpu_job())), "local")


def test_two_local_jobs_started_in_the_same_second_get_different_master_ports(tmp_path: Path) -> None:
    from jobgen.schedulers.local import local_job_id

    now = 1795544591
    ports = master_ports(local_script(tmp_path), [local_job_id(now, pid) for pid in (4242, 4243, 31337)])
    assert len(set(ports)) == 3 and all(20000 <= p < 32768 for p in ports), ports


def test_the_automatic_master_port_tells_array_tasks_and_job_ids_20000_apart_apart(tmp_path: Path) -> None:
    # The job id's digits modulo 20000 gave each of these pairs one port.
    pairs = [(f"{job}_0", f"{job}_10") for job in range(1111, 1211)] + [(str(job), str(job + 20000)) for job in range(400000, 400100)]
    ports = master_ports(local_script(tmp_path), [job_id for pair in pairs for job_id in pair])
    same = [pair for pair, first, second in zip(pairs, ports[::2], ports[1::2]) if first == second]
    assert ("1111_0", "1111_10") not in same
    # A hash into 12,768 ports: two ids collide about once in 12,768, 0.016 of these 200 pairs.
    assert len(same) <= 1, same


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    job_ids=st.lists(st.one_of(
        st.integers(1, 10**9).map(str),  # Slurm
        st.tuples(st.integers(1, 10**7), st.integers(0, 99999)).map(lambda t: f"{t[0]}_{t[1]}"),  # a Slurm array task
        st.tuples(st.integers(1, 10**7), st.sampled_from(["pbs01", "head.cluster.local"])).map(lambda t: f"{t[0]}.{t[1]}"),  # PBS
        st.tuples(st.integers(1, 10**7), st.integers(0, 999)).map(lambda t: f"{t[0]}[{t[1]}].server"),  # a PBS array subjob
    ), min_size=1, max_size=20),
    ephemeral=st.one_of(
        st.just((32768, 60999)),  # Linux's default
        st.tuples(st.integers(1024, 65535), st.integers(1024, 65535)).map(sorted).map(tuple),
    ),
)
def test_the_automatic_master_port_is_never_an_ephemeral_port_of_the_node(tmp_path: Path, job_ids: list[str], ephemeral: tuple[int, int]) -> None:
    if os.geteuid() != 0:
        cannot_run("setting a network namespace's ephemeral port range needs root")
    low, high = ephemeral
    outside = (low - 20000 >= 1024) or (65535 - high >= 1024)
    for port in master_ports(local_script(tmp_path), job_ids, ephemeral):
        assert 1024 <= port <= 65535
        if outside:  # else there is no room outside it, and the ports are 20000-32767
            assert not low <= port <= high, (port, ephemeral)


def test_names_in_other_scripts_keep_two_jobs_apart_and_say_how_they_are_written(tmp_path: Path) -> None:
    written = {}
    for name in ("训练-qwen", "微调-qwen", "微调", "modèle"):
        config = write_job(tmp_path / "job.yaml", {**cpu_job(), "name": name})
        result = jobgen("render", "-s", "slurm", str(config))
        assert result.returncode == 0, result.stderr
        [job_name] = re.findall(r"^#SBATCH --job-name=(.*)$", result.stdout, re.M)
        [run_dir] = re.findall(r"^jobgen_run_dir=(.*)$", result.stdout, re.M)
        assert run_dir == f"runs/{job_name}"
        assert f"jobgen: warning: name '{name}' is written '{job_name}' for the scheduler's job name and the run " \
               f"directory runs/{job_name}" in result.stderr
        written[name] = job_name
    assert re.fullmatch(r"qwen-[0-9a-f]{6}", written["训练-qwen"]) and re.fullmatch(r"qwen-[0-9a-f]{6}", written["微调-qwen"])
    assert written["训练-qwen"] != written["微调-qwen"]
    assert re.fullmatch(r"job-[0-9a-f]{6}", written["微调"]) and re.fullmatch(r"modele-[0-9a-f]{6}", written["modèle"])
    again = jobgen("render", "-s", "slurm", str(write_job(tmp_path / "job.yaml", {**cpu_job(), "name": "modèle"})))
    assert f"--job-name={written['modèle']}\n" in again.stdout  # the same name, the same run directory every time
    for command in (["validate"], ["submit", "-s", "slurm", "--dry-run"]):  # each says it too, in one line
        said = jobgen(*command, str(tmp_path / "job.yaml")).stderr
        assert f"jobgen: warning: name 'modèle' is written '{written['modèle']}' for the scheduler's" in said, command


def test_a_name_schedulers_take_is_written_as_it_is_and_not_mentioned(tmp_path: Path) -> None:
    result = jobgen("render", "-s", "pbs", str(write_job(tmp_path / "job.yaml", {**cpu_job(), "name": "llama3-8b_lora.v2"})))
    assert "#PBS -N llama3-8b_lora.v2\n" in result.stdout and "\njobgen_run_dir=runs/llama3-8b_lora.v2\n" in result.stdout
    assert "is written" not in result.stderr


def test_a_value_that_is_a_reserved_word_is_quoted(tmp_path: Path, shellcheck: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"environment": {"variables": {"AA": "then", "BB": "done"}}, "launch": {"procs_per_node": 1},
                                      "training": {"model": "m", "data": "d"}}))
    script = jobgen("render", "-s", "slurm", str(config)).stdout
    assert "export AA='then'" in script and "export BB='done'" in script
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run([shellcheck, "-S", "warning", str(tmp_path / "job.sh")], capture_output=True, text=True).stdout == ""
