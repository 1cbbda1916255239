"""Small helpers the tests share: running the real CLI, the real shell checkers, and installing a
package as pip lays it out."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as a package (the test extra installs it there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))


def jobgen(*args: str, cwd: Path | None = None, env: dict | None = None, check: bool = False,
           timeout: float | None = None) -> subprocess.CompletedProcess:
    """The installed `jobgen` command, exactly as a user runs it: its exit status, its output and
    its error lines. `render` and `validate` run in this process (in_this_process)."""
    if args and args[0] in IN_THIS_PROCESS and not any(name.startswith("PYTHON") for name in env or {}):
        return in_this_process(list(args), cwd, env, check)
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jobgen.cli", *args], cwd=cwd, env=full_env, capture_output=True, text=True, check=check,
        timeout=timeout,
    )


# Commands that only read the job and print: a new Python for each of them imported jobgen again, a
# quarter of a CPU-second, and the tests run them a few hundred times. The others start processes,
# wait on them or handle signals, and an environment naming Python's own variables (PYTHONPATH: a
# plugin's package) needs a new interpreter: those run as a user runs them.
IN_THIS_PROCESS = ("render", "validate")


def in_this_process(args: list[str], cwd: Path | None, env: dict | None, check: bool) -> subprocess.CompletedProcess:
    """`jobgen ARGS` through click's runner, in cwd with env added to this process's environment
    for its length; an exception the command lets out is printed as Python would, exit status 1."""
    import gc
    import traceback

    from click.testing import CliRunner

    from jobgen.cli import main

    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        result = CliRunner().invoke(main, args, env=env, prog_name="jobgen")
    finally:
        os.chdir(here)
        gc.enable()  # the command turns the collector off for its short life (jobgen.cli.startup)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    done = subprocess.CompletedProcess([sys.executable, "-m", "jobgen.cli", *args], result.exit_code, result.stdout, stderr)
    if check:
        done.check_returncode()
    return done


# The tests' folder of things built once per run (conftest.py names the run and removes it).
RUN_CACHE = Path(tempfile.gettempdir()) / f"jobgen-test-run-{os.environ.get('JOBGEN_TEST_RUN', os.getpid())}"


def once_per_run(name: str, build: Callable[[Path], None]) -> Path:
    """RUN_CACHE/NAME, made by `build(folder)` the first time any of the run's pytest-xdist workers
    asks for it: for what is deterministic, costly and needed by several modules."""
    built = RUN_CACHE / name
    RUN_CACHE.mkdir(exist_ok=True)
    with open(RUN_CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist's workers share the run's folder
        if not built.exists():
            building = built.with_name(built.name + ".building")
            shutil.rmtree(building, ignore_errors=True)
            build(building)  # makes the folder
            building.rename(built)
    return built


def tiny_model(folder: Path, conversations: int = 64) -> Path:
    """`python -m jobgen.train.tiny FOLDER`: the tiny model, its tokenizer and data. The build is
    deterministic and costs seconds of CPU (its imports, mostly), and a dozen modules use it, so it
    is built once per run, in a process of its own as before, and copied."""
    built = once_per_run(f"tiny-{conversations}", lambda building: subprocess.run(
        [sys.executable, "-m", "jobgen.train.tiny", str(building), "--conversations", str(conversations)],
        check=True, capture_output=True))
    shutil.copytree(built, folder, dirs_exist_ok=True)
    return folder


def uninterrupted_adapter(training: dict, tiny: Path) -> dict:
    """The final adapter of a 2-node LoRA job with this `training` section (its model and data
    those of `tiny`, a tiny_model folder) run without interruption: two simulated nodes of this
    machine, `jobgen submit -s local`, the ranks, backend and data order of a cluster's two nodes.
    Trained once per test run for each training section, which is the cache's key: the modules of
    every scheduler compare their interrupted runs with it, and the bytes of the model and data
    (tiny_model folders of another size would otherwise share a cached run)."""
    training = {key: value for key, value in training.items() if key not in ("model", "data")}
    digest = hashlib.sha256(json.dumps(training, sort_keys=True).encode())
    for path in sorted([tiny / "data.json", *(tiny / "model").rglob("*")]):
        if path.is_file():
            digest.update(path.read_bytes())
    key = digest.hexdigest()[:12]

    def train(folder: Path) -> None:
        folder.mkdir()
        job = {"name": "reference", "resources": {"nodes": 2, "gpus_per_node": 0}, "launch": {"procs_per_node": 1},
               "training": {"model": str(tiny / "model"), "data": str(tiny / "data.json"), **training}}
        (folder / "job.yaml").write_text(json.dumps(job))  # YAML's superset
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        result = subprocess.run([sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"], cwd=folder, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
        metrics = (folder / "runs" / "reference" / "output" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == list(range(1, training["max_steps"] + 1))

    return adapter(once_per_run(f"reference-{key}", train) / "runs" / "reference")


def node_script_of(script: str) -> str:
    """The per-node script a batch script writes (node.sh: jobgen's node setup, then the job's own
    part), so it can be checked on its own."""
    parts = []
    for end in ("JOBGEN_NODE_SETUP", "JOBGEN_NODE_SCRIPT"):
        match = re.search(rf"<<'{end}'\n(.*?)^{end}$", script, re.S | re.M)
        assert match, f"no embedded node script part {end}"
        parts.append(match.group(1))
    return "".join(parts)


def shell_findings(*paths: Path) -> str:
    """`bash -n` and `shellcheck -S warning` findings for each file; empty when clean."""
    findings = []
    for path in paths:
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if syntax.returncode:
            findings.append(f"bash -n {path}: {syntax.stderr}")
    check = subprocess.run(["shellcheck", "-S", "warning", "-s", "bash", *map(str, paths)], capture_output=True, text=True)
    if check.returncode:
        findings.append(check.stdout + check.stderr)
    return "\n".join(findings)


def cannot_run(reason: str) -> None:
    """Skips a test that needs what this machine lacks; under CI=true that is a failure: CI must run it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run this test, but: {reason}", pytrace=False)
    pytest.skip(reason)


def install_as_pip_does(package: Path, site_packages: Path) -> None:
    """`package` (a folder with a pyproject.toml, built with hatch or setuptools) as `pip install`
    leaves it: its import packages, and a dist-info naming its entry points."""
    pyproject = tomllib.loads((package / "pyproject.toml").read_text())
    project, tool = pyproject["project"], pyproject.get("tool", {})
    names = tool.get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {}).get("packages") \
        or tool["setuptools"]["packages"]
    for name in names:
        shutil.copytree(package / name, site_packages / name)
    info = site_packages / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
        for group, entries in project["entry-points"].items()
    ))


def adapter(run_dir: Path) -> dict:
    """A run's final LoRA adapter, by tensor name."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / "output" / "final" / "adapter_model.safetensors"))


def assert_bitwise_equal(run_dir: Path, reference: dict) -> None:
    """The run's final adapter is the uninterrupted run's, bit for bit."""
    import torch

    weights = adapter(run_dir)
    assert weights.keys() == reference.keys()
    different = [name for name in weights if not torch.equal(weights[name], reference[name])]
    assert not different, f"{len(different)} adapter tensors differ from the uninterrupted run, e.g. {different[0]}"


def free_port() -> int:
    """A port of 127.0.0.1 free now, below the kernel's ephemeral range. A port the kernel hands
    out for bind(0) is one any outgoing connection may take next, before the test's job binds it
    (EADDRINUSE, seen in CI under load); jobgen's own ports stay below that range for the same
    reason (README, MASTER_PORT)."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    choose = random.SystemRandom()
    for _ in range(200):
        port = choose.randrange(20000, max(ephemeral_low, 20001))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port between 20000 and {ephemeral_low}")



def assert_at_most_one_step_lost(run_dir: Path, resumed_from: int, fault_at: float | None = None,
                                 reached: int | None = None) -> int:
    """A restart after a failure without warning resumed from the step `reached` (default: the
    last logged before `fault_at`, a time.time()) or the one before: the peer snapshot of a
    surviving node (training.snapshot_every, on by default for LoRA) written out as a checkpoint,
    unless a periodic checkpoint was that new already. Returns the step reached."""
    import json

    if reached is None:
        metrics = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
        reached = max((m["step"] for m in metrics if m["time"] <= fault_at), default=0)
    assert resumed_from >= reached - 1, f"reached step {reached}, resumed from {resumed_from}: more than one step lost"
    if resumed_from % 4:  # not a periodic checkpoint of the tests' save_interval (4): it came from memory
        said = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*") if p.is_file())
        assert f"snapshot of step {resumed_from} (" in said and "held in the memory of " in said, said[-3000:]
    return reached
