"""The package's parts import downwards only, and no module imports itself back through others.

The order is jobgen/__init__.py's: the shared modules, then job < schedulers < script < rundir <
train < cli. Every import counts, the lazy ones inside functions too (they are how a command keeps
its start-up light, not a way around the order)."""

from __future__ import annotations

import ast
from pathlib import Path

import jobgen

PACKAGE = Path(jobgen.__file__).parent
SHARED = {"jobgen", "jobgen.errors", "jobgen.files", "jobgen.resources", "jobgen.plugins", "jobgen.parent_death"}
# The run directory's file names: the run directory's own, and the vocabulary the schedulers, the
# templates and the trainer write it with; names only, importing nothing of jobgen.
NAMES = "jobgen.rundir.files"
PARTS = ["job", "schedulers", "script", "rundir", "train", "api", "cli"]
# `jobgen.Job` is the package's attribute, loaded from jobgen.api on first use (a module-level
# __getattr__): after `jobgen` itself is imported, so neither an upward import nor a cycle at import.
LAZY_API = ("jobgen", "jobgen.api")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_rank(module: str) -> int:
    if module in SHARED or module == NAMES:
        return -1
    return PARTS.index(module.split(".")[1])


def imports(path: Path, known: set[str]) -> set[str]:
    """Every jobgen module `path` imports, resolved to a module (not a name within one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("jobgen")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jobgen"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
    return found


def graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {module: imports(path, set(paths)) - {module} for module, path in paths.items()}
    edges[LAZY_API[0]].discard(LAZY_API[1])
    return edges


def test_the_package_loads_its_api_only_when_asked() -> None:
    import subprocess
    import sys

    code = "import sys, jobgen; print('jobgen.api' in sys.modules, jobgen.Job.__module__, 'jobgen.api' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "jobgen.api", "True"]


def test_every_part_imports_only_the_parts_below_it() -> None:
    upward = [
        f"{module} ({PARTS[part_rank(module)] if part_rank(module) >= 0 else 'shared'}) imports {target}"
        for module, targets in graph().items()
        for target in targets
        if part_rank(target) > part_rank(module)
    ]
    assert upward == []


def test_the_run_directory_names_import_nothing_of_jobgen() -> None:
    assert graph()[NAMES] == set()


def test_no_module_imports_itself_back_through_others() -> None:
    edges = graph()
    # A package's __init__ that imports its own submodules is how Python packages are built;
    # a submodule importing its package back is the cycle this looks for.
    cycles = []
    for start in edges:
        stack = [(start, [start])]
        seen = set()
        while stack:
            module, path = stack.pop()
            for target in edges.get(module, ()):
                if target == start:
                    cycles.append(" -> ".join([*path, start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert cycles == []


def test_every_part_says_what_it_owns_and_may_import() -> None:
    for part in PARTS:
        path = PACKAGE / part / "__init__.py" if (PACKAGE / part).is_dir() else PACKAGE / f"{part}.py"
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "import" in doc, f"jobgen.{part} has no docstring saying what it may import"
