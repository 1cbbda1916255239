"""jobgen.cli.startup: what a command skips at start-up, and that skipping it changes nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_pydantic_builds_and_validates_models_with_the_plugin_loader_stood_in() -> None:
    out = run_python(
        "import sys, gc\n"
        "from jobgen.cli.startup import skip_startup_costs\n"
        "skip_startup_costs()\n"
        "from pydantic import BaseModel, ValidationError\n"
        "class M(BaseModel):\n"
        "    n: int\n"
        "print(M(n='3').n)\n"
        "try: M(n='x')\n"
        "except ValidationError as e: print(e.errors()[0]['type'])\n"
        "print(type(sys.modules['pydantic.plugin._loader']).__name__, 'importlib.metadata' in sys.modules, gc.isenabled())\n"
    )
    assert out.split("\n")[:3] == ["3", "int_parsing", "_NoPydanticPlugins False False"]


def test_any_other_use_of_the_plugin_loader_gets_the_real_one() -> None:
    # A later pydantic might ask its loader for more than get_plugins: it must get the real thing.
    out = run_python(
        "import sys\n"
        "from jobgen.cli.startup import skip_startup_costs\n"
        "skip_startup_costs()\n"
        "from pydantic.plugin import _loader\n"
        "print(_loader.PYDANTIC_ENTRY_POINT_GROUP)\n"
        "import pydantic.plugin._loader as again\n"
        "print(type(again).__name__, again.get_plugins.__module__)\n"
    )
    assert out.split("\n")[:2] == ["pydantic", "module pydantic.plugin._loader"]


@pytest.mark.parametrize("command", [["schema"], ["--version"]])
def test_schema_and_version_still_work_with_the_startup_costs_skipped(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "jobgen.cli", *command], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
