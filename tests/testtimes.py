"""Opt-in pytest plugin: one JSON line per test start and end, with the worker and its process id,
for benchmarks/suite_cpu.py to charge every process of a run to the test that caused it.

    TESTTIMES_OUT=times.jsonl PYTEST_ADDOPTS="-p tests.testtimes" bash .ci/run

Not loaded by default; it changes nothing a test sees."""

from __future__ import annotations

import json
import os
import time


def _write(event: str, nodeid: str) -> None:
    line = {"ev": event, "id": nodeid, "w": os.environ.get("PYTEST_XDIST_WORKER", "-"), "pid": os.getpid(), "t": time.time()}
    with open(os.environ.get("TESTTIMES_OUT", "testtimes.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    _write("start", nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _write("end", nodeid)
