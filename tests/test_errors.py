"""Bad input: one clear line per problem naming the field, exit status 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import jobgen

BASE = "launch: {procs_per_node: 1}\ntraining: {model: m, data: d}\n"

CASES = {
    "unknown key suggests the closest": (
        "resources: {gpu_per_node: 4}\n" + BASE,
        "unknown key 'resources.gpu_per_node' (did you mean 'gpus_per_node'?)",
    ),
    "another tool's name for a field suggests the field, not the closest spelling": (
        "launch: {procs_per_node: 1}\ntraining: {model: m, data: d, lr: 2.0e-4, lora: {lora_alpha: 16}}\n",
        "unknown key 'training.lr' (did you mean 'learning_rate'?)",
    ),
    "the Hugging Face Trainer's name for Liger": (
        "launch: {procs_per_node: 1}\ntraining: {model: m, data: d, use_liger_kernel: true}\n",
        "unknown key 'training.use_liger_kernel' (did you mean 'liger_kernel'?)",
    ),
    "another tool's name one level down": (
        "launch: {procs_per_node: 1}\ntraining: {model: m, data: d, lora: {lora_alpha: 16}}\n",
        "unknown key 'training.lora.lora_alpha' (did you mean 'alpha'?)",
    ),
    "wrong choice suggests the closest": (
        "launch: {procs_per_node: 1}\ntraining: {model: m, data: d, method: qlor}\n",
        "'training.method' is 'qlor': Input should be 'full', 'lora' or 'qlora' (did you mean 'qlora'?)",
    ),
    "time limit format": ("resources: {time_limit: 3h}\n" + BASE, "'resources.time_limit' is '3h': expected [D-]HH:MM:SS"),
    "unquoted time limit, read by YAML as seconds": (
        "resources: {time_limit: 24:00:00}\n" + BASE,  # as a user types it
        "'resources.time_limit' is 86400: expected [D-]HH:MM:SS in quotes, e.g. time_limit: \"24:00:00\"; "
        "unquoted, YAML 1.1 reads 24:00:00 as the number 86400 (base 60)",
    ),
    "time limit as a number": (
        "resources: {time_limit: 90}\n" + BASE,
        "'resources.time_limit' is 90: expected [D-]HH:MM:SS in quotes, e.g. time_limit: \"01:30:00\"",
    ),
    "missing required field": ("launch: {procs_per_node: 1}\ntraining: {model: m}\n", "'training.data' is required"),
    "cpu job without process count": ("training: {model: m, data: d}\n", "launch.procs_per_node is required when resources.gpus_per_node is 0"),
    "procs differ from gpus": (
        "resources: {gpus_per_node: 8}\nlaunch: {procs_per_node: 4}\ntraining: {model: m, data: d}\n",
        "launch.procs_per_node (4) must equal resources.gpus_per_node (8)",
    ),
    "variable name that is not a shell name": (
        "environment: {variables: {'1BAD': x}}\n" + BASE,
        "'1BAD' is not a shell variable name",
    ),
    "variable jobgen owns": ("environment: {variables: {MASTER_ADDR: x}}\n" + BASE, "'MASTER_ADDR' is set by the scheduler or by jobgen"),
    "partition with a space": ("resources: {partition: 'gpu long'}\n" + BASE, "'resources.partition' is 'gpu long'"),
    "invalid yaml": ("training: [1\n", "invalid YAML at line 2"),
    "not a mapping": ("- a\n- b\n", "expected a mapping of keys"),
    "ssh option that is not an option": (
        "launch: {procs_per_node: 1, ssh_options: [myhost]}\ntraining: {model: m, data: d}\n",
        "'launch.ssh_options' is ['myhost']: 'myhost' is not an ssh option; give options only",
    ),
    "ssh option that would detach the node": (
        "launch: {procs_per_node: 1, ssh_options: [-p, '2222', -T]}\ntraining: {model: m, data: d}\n",
        "ssh option -T is refused: the ssh launcher runs the node script in the foreground, on a terminal (-tt)",
    ),
    "ssh option without its value": (
        "launch: {procs_per_node: 1, ssh_options: [-i]}\ntraining: {model: m, data: d}\n",
        "ssh option -i needs a value after it",
    ),
    "a key given twice: the second would silently win": (
        "launch: {procs_per_node: 1}\ntraining:\n  model: m\n  data: d\n  epochs: 12\n  epochs: 3\n",
        "job.yaml: key 'training.epochs' is given twice, at line 5 and line 6; YAML would keep only the second: keep one",
    ),
    "a section given twice: the second would drop every value of the first": (
        "training:\n  model: m\n  data: d\nlaunch: {procs_per_node: 1}\ntraining:\n  epochs: 3\n",
        "key 'training' is given twice, at line 1 and line 5",
    ),
    "a key given twice deeper down": (
        BASE + "environment:\n  variables:\n    HF_HOME: /a\n    HF_HOME: /b\n",
        "key 'environment.variables.HF_HOME' is given twice, at line 5 and line 6",
    ),
    "qlora with zero 3": (
        "launch: {procs_per_node: 1}\ntraining: {model: m, data: d, method: qlora, zero_stage: 3}\n",
        "qlora does not work with training.zero_stage 3",
    ),
}


@pytest.mark.parametrize("text,message", CASES.values(), ids=CASES.keys())
def test_invalid_job_fails_with_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(text)
    for command in (["validate", str(config)], ["render", "-s", "slurm", str(config)]):
        result = jobgen(*command)
        assert result.returncode == 2
        assert message in result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
        assert all(line.startswith("jobgen: ") for line in result.stderr.splitlines())


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "resources.nodes=three"], "'resources.nodes' is 'three'"),
        (["--set", "nodes"], "expected dotted.key=value"),
        (["--site", "nosuch"], "site profile 'nosuch' not found"),
        (["--set", "launch.launcher=pbsdsh"], "'launch.launcher' is 'pbsdsh', which slurm cannot use; accepted: srun"),
    ],
)
def test_bad_command_line_values_fail_clearly(tmp_path: Path, args: list[str], message: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(BASE)
    result = jobgen("render", "-s", "slurm", str(config), *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_bad_value_given_with_set_is_blamed_on_the_set_not_the_file(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("resources: {nodes: 2}\n" + BASE)
    result = jobgen("validate", str(config), "--set", "resources.nodes=three", "--set", "training.lr=1e-4")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "jobgen: error: --set 'resources.nodes=three': 'resources.nodes' is 'three': expected a node count (4) or, "
        "on Slurm, a range MIN-MAX (\"2-4\")",
        "jobgen: error: --set 'training.lr=1e-4': unknown key 'training.lr' (did you mean 'learning_rate'?); known keys "
        "here: " + result.stderr.split("known keys here: ")[1].splitlines()[0],
    ]
    config.write_text("resources: {nodes: three}\n" + BASE)  # the file's own mistake still names the file
    assert f"jobgen: error: {config}: 'resources.nodes' is 'three'" in jobgen("validate", str(config)).stderr


def test_a_time_given_with_set_is_the_time_not_its_base_60_number(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(BASE)
    result = jobgen("render", "-s", "slurm", str(config), "--set", "resources.time_limit=24:00:00")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --time=1-00:00:00" in result.stdout


def test_a_value_given_to_set_with_a_key_twice_is_refused_naming_set(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(BASE)
    result = jobgen("render", "-s", "slurm", str(config), "--set", "training.lora={r: 8, r: 16}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "jobgen: error: --set 'training.lora={r: 8, r: 16}': key 'r' is given twice; YAML would keep only the second: keep one"
    )


def test_a_merged_key_may_be_overridden(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(BASE.replace("training: {model: m, data: d}", "training:\n  model: m\n  data: d\n  lora:\n    <<: {r: 8, alpha: 16}\n    r: 4\n"))
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 0, result.stderr


def test_a_folder_given_as_the_job_is_one_line_naming_its_yaml_files(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(BASE)
    for command in ("validate", "render", "submit", "prepare", "data"):
        result = jobgen(command, str(tmp_path))
        assert result.returncode == 2 and result.stdout == "", command
        assert result.stderr == f"jobgen: error: {tmp_path}: is a folder, not a YAML file; give the file (job.yaml here)\n"


def test_missing_file_and_unknown_scheduler() -> None:
    assert "no such file" in jobgen("validate", "nope.yaml").stderr
    result = jobgen("render", "-s", "lsf", "nope.yaml")
    assert result.returncode == 2 and "'lsf' is not one of" in result.stderr


def test_warnings_do_not_fail_the_render(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "resources: {nodes: 2, gpus_per_node: 8, time_limit: '01:00:00'}\n"
        "training: {model: m, data: d, zero_stage: 3, save_interval: 1000, step_seconds_estimate: 10}\n"
    )
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 0
    assert "warning: training.zero_stage 3 across nodes" in result.stderr
    assert "warning: training.save_interval 1000 steps x 10 s" in result.stderr
    assert "warning: global batch 16" in result.stderr


@pytest.mark.parametrize("args, line", [
    (["submit", "--bogus", "job.yaml"], "jobgen: error: No such option '--bogus' (see jobgen submit --help)"),
    (["render", "-s", "nope", "job.yaml"], "jobgen: error: Invalid value for '--scheduler' / '-s': 'nope' is not one of "
                                           "'slurm', 'pbs', 'torque', 'local' (installed plug-ins included) (see jobgen render --help)"),
    (["stauts"], "jobgen: error: No such command 'stauts'. Did you mean 'status'? (see jobgen --help)"),
])
def test_a_command_line_click_refuses_is_one_line_naming_the_help_to_read(args: list[str], line: str) -> None:
    result = jobgen(*args)
    assert result.returncode == 2 and result.stderr == line + "\n", result.stderr

