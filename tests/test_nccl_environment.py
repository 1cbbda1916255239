"""The environment a job exports on its nodes: values as the guides write them (numbers, booleans),
one setting per variable, each network preset's NCCL variables and why, and names NCCL never reads."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from jobgen.job.nccl import NETWORK_PRESETS, NOT_NCCL
from tests.helpers import REPO, jobgen


def job_file(tmp_path: Path, launch: dict | None = None, variables: dict | None = None) -> Path:
    """A two-node job with a model folder and data that validate accepts."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "data.json").write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]')
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "nccl",
        "resources": {"nodes": 2, "gpus_per_node": 4},
        "launch": launch or {},
        "environment": {"variables": variables or {}},
        "training": {"model": str(tmp_path / "model"), "data": str(tmp_path / "data.json"), "per_device_batch_size": 8},
    }))
    return path


def exports(script: str) -> list[str]:
    """The job's exported NAME=VALUE lines, each with the comment line above it, if any."""
    lines = script.split("\njobgen_node_script() {")[0].splitlines()  # the environment, above what each node runs
    found = []
    for index, line in enumerate(lines):
        if re.match(r"export [A-Z0-9_]+=", line):
            if lines[index - 1].startswith("# "):
                found.append(lines[index - 1])
            found.append(line)
    return found


def render(config: Path) -> str:
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_numbers_and_booleans_are_exported_as_the_shell_and_nccl_read_them(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(  # as the guides write them: unquoted
        "resources: {nodes: 2, gpus_per_node: 4}\n"
        "environment:\n  variables:\n    NCCL_IB_TIMEOUT: 22\n    NCCL_P2P_DISABLE: true\n"
        "    TOKENIZERS_PARALLELISM: false\n    LOSS_SCALE: 0.5\n    NAME_AS_WORD: 'true'\n"
        "training: {model: m, data: d}\n"
    )
    result = jobgen("render", "-s", "slurm", str(config))
    assert result.returncode == 0, result.stderr
    assert [line for line in exports(result.stdout) if not line.startswith("#")] == [
        "export NCCL_IB_TIMEOUT=22",
        "export NCCL_P2P_DISABLE=1",
        "export TOKENIZERS_PARALLELISM=0",
        "export LOSS_SCALE=0.5",
        "export NAME_AS_WORD=true",
    ]


def test_a_value_that_is_not_text_a_number_or_a_boolean_is_one_line(tmp_path: Path) -> None:
    config = job_file(tmp_path, variables={"NCCL_IB_HCA": ["mlx5_0", "mlx5_1"]})
    result = jobgen("validate", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "NCCL_IB_HCA: ['mlx5_0', 'mlx5_1'] is not a value for a variable; give text, a number or true/false" in result.stderr


def test_roce_sets_the_gid_index_infiniband_does_not_and_each_export_says_why(tmp_path: Path) -> None:
    assert exports(render(job_file(tmp_path, {"network": "infiniband"}))) == [
        "# launch.network infiniband: NCCL's InfiniBand transport (RDMA), not TCP sockets",
        "export NCCL_IB_DISABLE=0",
    ]
    assert exports(render(job_file(tmp_path, {"network": "roce", "socket_ifname": "eth0"}))) == [
        "# launch.network roce: NCCL's IB verbs transport over RoCE (RDMA), not TCP sockets",
        "export NCCL_IB_DISABLE=0",
        "# launch.network roce: RoCE v2 over IPv4 (NCCL before 2.21 takes 0, RoCE v1, not routed); "
        "where show_gids differs, set environment.variables.NCCL_IB_GID_INDEX",
        "export NCCL_IB_GID_INDEX=3",
        "# launch.socket_ifname: the interface NCCL's bootstrap and socket transport use",
        "export NCCL_SOCKET_IFNAME=eth0",
        "# launch.socket_ifname: the interface gloo's sockets use (CPU jobs, async_save's process groups)",
        "export GLOO_SOCKET_IFNAME=eth0",
    ]
    assert exports(render(job_file(tmp_path, {"network": "ethernet"}))) == [
        "# launch.network ethernet: TCP sockets only: probing for IB devices where there are none hangs or warns",
        "export NCCL_IB_DISABLE=1",
    ]


def test_socket_ifname_is_gloos_interface_too_on_cpus_and_gpus(tmp_path: Path) -> None:
    for gpus in (0, 4):
        config = job_file(tmp_path, {"socket_ifname": "=eth1", **({} if gpus else {"procs_per_node": 2})})
        job = yaml.safe_load(config.read_text())
        job["resources"]["gpus_per_node"] = gpus
        config.write_text(yaml.safe_dump(job))
        names = [line for line in exports(render(config)) if "SOCKET_IFNAME=" in line]
        # NCCL's '=' (exactly this name) is not gloo's syntax: gloo gets the name alone.
        assert names == (["export NCCL_SOCKET_IFNAME==eth1"] if gpus else []) + ["export GLOO_SOCKET_IFNAME=eth1"]
    # '^' (every interface but these) has no gloo form: each node finds gloo's itself.
    script = render(job_file(tmp_path, {"socket_ifname": "^docker0"}))
    assert [line for line in exports(script) if "SOCKET_IFNAME=" in line] == ["export NCCL_SOCKET_IFNAME='^docker0'"]
    config = job_file(tmp_path, {"socket_ifname": "ib0"}, {"GLOO_SOCKET_IFNAME": "eth0"})
    result = jobgen("validate", str(config))
    assert result.returncode == 2
    assert "environment.variables.GLOO_SOCKET_IFNAME is 'eth0' but launch.socket_ifname sets GLOO_SOCKET_IFNAME to 'ib0'" in result.stderr


def test_a_sites_gid_index_replaces_the_roce_default_in_one_export(tmp_path: Path) -> None:
    script = render(job_file(tmp_path, {"network": "roce"}, {"NCCL_IB_GID_INDEX": 5}))
    assert [line for line in exports(script) if "GID_INDEX=" in line] == ["export NCCL_IB_GID_INDEX=5"]


def test_one_variable_set_twice_differently_is_refused_naming_both_fields(tmp_path: Path) -> None:
    for launch, variables, message in [
        ({"socket_ifname": "ib0"}, {"NCCL_SOCKET_IFNAME": "eth0"},
         "environment.variables.NCCL_SOCKET_IFNAME is 'eth0' but launch.socket_ifname sets NCCL_SOCKET_IFNAME "
         "to 'ib0': set launch.socket_ifname: eth0 instead"),
        ({"nccl_debug": "INFO"}, {"NCCL_DEBUG": "WARN"}, "but launch.nccl_debug sets NCCL_DEBUG to 'INFO'"),
        ({"network": "infiniband"}, {"NCCL_IB_DISABLE": 1},
         "environment.variables.NCCL_IB_DISABLE is '1' but launch.network infiniband sets NCCL_IB_DISABLE to '0': "
         "remove it, or choose the launch.network that sets it so"),
    ]:
        config = job_file(tmp_path, launch, variables)
        for command in (["validate"], ["render", "-s", "slurm"]):
            result = jobgen(*command, str(config))
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            [line] = result.stderr.splitlines()
            assert line.startswith("jobgen: error: ") and message in line, line


def test_one_variable_set_twice_alike_is_exported_once(tmp_path: Path) -> None:
    script = render(job_file(tmp_path, {"socket_ifname": "ib0"}, {"NCCL_SOCKET_IFNAME": "ib0"}))
    assert [line for line in exports(script) if "NCCL_SOCKET_IFNAME=" in line] == ["export NCCL_SOCKET_IFNAME=ib0"]


def test_a_variable_nccl_does_not_read_is_a_warning_saying_what_to_set(tmp_path: Path) -> None:
    config = job_file(tmp_path, variables={"NCCL_TIMEOUT": 1800, "NCCL_SOCKET_IFACE": "eth0"})
    for command in (["validate"], ["render", "-s", "slurm"]):
        result = jobgen(*command, str(config))
        assert result.returncode == 0, result.stderr
        assert "jobgen: warning: environment.variables.NCCL_TIMEOUT is not a variable NCCL reads: NCCL has no " \
               "timeout variable: a collective's timeout is the process group's; set launch.collective_timeout_minutes" \
               in result.stderr
        assert "environment.variables.NCCL_SOCKET_IFACE is not a variable NCCL reads: set launch.socket_ifname " \
               "(NCCL_SOCKET_IFNAME)" in result.stderr


def test_docs_name_every_preset_variable_and_every_name_nccl_does_not_read() -> None:
    text = (REPO / "docs" / "nccl.md").read_text()
    for network, variables in NETWORK_PRESETS.items():
        assert f"`{network}`" in text
        for name, variable in variables.items():
            assert f"`{name}={variable.value}`" in text, name
    for name in NOT_NCCL:
        assert f"`{name}`" in text, name
