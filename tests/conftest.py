import os
import shutil
import uuid
from collections import defaultdict

import pytest

# No test reaches the real Hugging Face Hub (validate asks it of a hub model the cache lacks): a
# closed port refuses at once; a test that needs a hub serves tests.hub_stand_in and points here.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
# Every training the tests start shares the machine's few CPUs with a dozen other processes, and
# torch's OpenMP threads spin while they wait for each other: a 2-node LoRA run of the tiny model
# took 16 CPU-seconds with one thread per rank against 19 to 28 with the default, and gave bitwise
# the same adapter (its matrices are too small for a second thread to change a sum's order). Jobs
# the tests submit inherit it, except those of the PBS servers, which start a job's environment
# afresh: there the default stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The run's name, for what tests.helpers builds once per run; pytest-xdist's workers inherit it.
os.environ.setdefault("JOBGEN_TEST_RUN", uuid.uuid4().hex[:12])

pytest_plugins = ["tests.cluster.fixtures", "tests.cluster.hosts", "tests.cluster.pbs_servers", "tests.cluster.shared_fs",
                  "tests.cluster.openpbs_hosts", "tests.cluster.slurm_hosts", "tests.cluster.torque_hosts",
                  "tests.local_run"]


@pytest.fixture(scope="session")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        pytest.fail("shellcheck is not installed: apt-get install -y shellcheck (scripts/setup-tests does it)")
    return path


# scripts/test runs the tests side by side (pytest-xdist, --dist loadgroup) in units that wait on
# different things: the tests of the Slurm cluster's partitions that preempt (`debug`), one after
# another (their jobs would queue behind each other's), those of its other nodes (`side`, `bind`),
# those of the PBS servers, and the CPU-bound rest a module at a time, so that a module's own
# fixtures are made once; the modules sharing a costly session fixture go together. The two
# longest cluster units come first and start at once, then the Slurm cluster of separate hosts
# (its own slurmctld, a module of minutes); the `side` nodes' unit runs where a worker
# takes it among the rest (a fourth worker at once only made every unit slower on 2 CPUs, and
# timing-bound tests flaky). A test's first fixture in this order names its unit. Tried and left
# (2026-11-30, BENCHMARKS.md): at most two waiting units at once, beside the CPU-bound rest. The six
# waiting units are two thirds of the workers' seconds (4,500 of 6,500), so two at a time made them
# the run's longest path: 37.1 min, two workers idle for the last 4 and 10 of them.
UNIT_BY_FIXTURE = {"slurm_side_cluster": "slurm-side", "slurm_cluster": "slurm", "openpbs": "pbs", "torque": "pbs"}
MODULES_BY_FIXTURE = {"stopped_and_resumed_run": "local-run"}
FIRST = ("slurm", "pbs", "tests/test_slurm_separate_hosts.py", "tests/test_torque_separate_hosts.py")


# First: pytest-xdist's own hook reads the marks to name each test's unit.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    module_unit = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        shared = [MODULES_BY_FIXTURE[name] for name in item.fixturenames if name in MODULES_BY_FIXTURE]
        if shared or module not in module_unit:
            module_unit[module] = shared[0] if shared else module
    for item in items:
        cluster = [unit for name, unit in UNIT_BY_FIXTURE.items() if name in item.fixturenames]
        item.add_marker(pytest.mark.xdist_group(cluster[0] if cluster else module_unit[item.nodeid.split("::")[0]]))
    items.sort(key=lambda item: FIRST.index(_unit(item)) if _unit(item) in FIRST else len(FIRST))


def _unit(item) -> str:
    return item.get_closest_marker("xdist_group").args[0]


def pytest_configure(config) -> None:
    """Cluster tests run side by side would take each other's nodes: refuse a pytest whose test
    ids pytest-xdist cannot group (see pyproject.toml's test extra)."""
    if config.getoption("dist", "no") == "loadgroup" and tuple(int(p) for p in pytest.__version__.split(".")[:2]) >= (9, 2):
        raise pytest.UsageError(f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup cannot group tests on it; "
                                "install the test extra's pytest (scripts/setup does)")


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller: every worker is done with the run's folder
        from tests.helpers import RUN_CACHE

        shutil.rmtree(RUN_CACHE, ignore_errors=True)


def pytest_terminal_summary(terminalreporter) -> None:
    """The seconds each unit took (setup, call and teardown of its tests, one after another on its
    worker): the longest unit is the floor of the whole run's time, the one to split or speed up."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    workers: dict[str, list[float]] = defaultdict(lambda: [float("inf"), 0.0, 0.0])  # first start, last stop, seconds
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid, duration = getattr(report, "nodeid", ""), getattr(report, "duration", None)
            if "@" not in nodeid or duration is None or getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            unit = totals[nodeid.rsplit("@", 1)[1]]
            unit[0] += duration
            unit[1] += report.when == "call"
            worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)  # pytest-xdist's
            if worker and hasattr(report, "start"):
                span = workers[worker]
                span[0], span[1], span[2] = min(span[0], report.start), max(span[1], report.stop), span[2] + duration
    if totals and not getattr(terminalreporter, "_jobgen_units_shown", False):
        terminalreporter._jobgen_units_shown = True  # the hook runs twice under pytest-xdist
        terminalreporter.write_sep("=", "seconds by unit (the longest first)")
        for unit, (seconds, tests) in sorted(totals.items(), key=lambda item: -item[1][0])[:8]:
            terminalreporter.write_line(f"{seconds:8.0f} s  {tests:4d} tests  {unit}")
        # A worker that ran out of tests long before the others: the units are unevenly spread, and
        # reordering them (FIRST) would shorten the run; all ending together: only less work would.
        if workers:
            began = min(span[0] for span in workers.values())
            terminalreporter.write_line("workers: " + "; ".join(
                f"{worker} busy {seconds:.0f} s, done {(stop - began) / 60:.1f} min in"
                for worker, (_, stop, seconds) in sorted(workers.items())))
