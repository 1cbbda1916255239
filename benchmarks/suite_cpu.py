"""Where the test suite's CPU goes: every process of a whole run, by command, and by unit and test.

    apt-get install -y acct; touch /tmp/pacct; accton /tmp/pacct
    TESTTIMES_OUT=/tmp/times.jsonl PYTEST_ADDOPTS="-p tests.testtimes" bash .ci/run
    accton off
    python benchmarks/suite_cpu.py /tmp/pacct [/tmp/times.jsonl] [--tests 30]

The suite is bound by CPU on a slow machine (scripts/test prints how busy the CPUs were), and
then only less work shortens it: this says which work. BSD process accounting (acct(5), version
3 records) counts every process that ended, the clusters' jobs and daemons included, however
short. With the times of tests/testtimes.py, a process is charged to the test its pytest worker
was running when it started (the worker among its ancestors), and a job's process (a scheduler
started it) is shared among the tests of that scheduler's units running then (SCHEDULER_UNITS):
a cluster test's figure is its share, not its own. Processes still running at the end (the PBS
servers' daemons) are not counted, and the machine's speed varies several-fold between machines:
compare only figures of one run with each other.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import struct
from dataclasses import dataclass

# struct acct_v3 (linux/acct.h), 64 bytes: flag, version, tty, exitcode, uid, gid, pid, ppid,
# btime (s), etime (float, ticks), then eight comp_t (utime, stime, ...) and the 16-byte command.
RECORD = struct.Struct("<ccHIIIIIIf8H16s")
TICKS = 100  # AHZ
# A job's processes descend from its scheduler's step daemon, which detaches (slurmstepd's parent is
# init): which cluster ran it cannot be read from the records, so its CPU is shared among the
# tests of that scheduler's units (tests/conftest.py's names) running when it started.
SCHEDULER_UNITS = {
    "slurmstepd": ("slurm", "slurm-side", "tests/test_slurm_separate_hosts.py"),
    "pbs_mom": ("pbs", "tests/test_openpbs_separate_hosts.py", "tests/test_torque_separate_hosts.py"),
}


@dataclass
class Process:
    pid: int
    ppid: int
    start: float
    seconds: float
    cpu: float
    command: str


def comp_t(value: int) -> int:
    """13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_accounting(path: str) -> list[Process]:
    data = open(path, "rb").read()
    processes = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1] != b"\x03":
            continue
        pid, ppid, btime, etime, utime, stime, command = fields[6], fields[7], fields[8], fields[9], fields[10], fields[11], fields[-1]
        processes.append(Process(pid, ppid, btime, etime / TICKS, (comp_t(utime) + comp_t(stime)) / TICKS,
                                 command.split(b"\0")[0].decode(errors="replace")))
    return processes


def by_command(processes: list[Process], rows: int) -> None:
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    for process in processes:
        cpu[process.command].append(process.cpu)
    total = sum(sum(values) for values in cpu.values())
    print(f"{len(processes)} processes, {total / 60:.1f} CPU-min\n\n| command | CPU-min | processes | median CPU-s |\n|---|---|---|---|")
    for command, values in sorted(cpu.items(), key=lambda item: -sum(item[1]))[:rows]:
        print(f"| `{command}` | {sum(values) / 60:.2f} | {len(values)} | {statistics.median(values):.2f} |")


class Tests:
    """The tests each pytest worker ran, from tests/testtimes.py's lines."""

    def __init__(self, path: str) -> None:
        started: dict[tuple[str, str], float] = {}
        self.spans: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
        for line in open(path):
            event = json.loads(line)
            if event["w"] == "-":
                continue
            key = (event["w"], event["id"])
            if event["ev"] == "start":
                started[key] = event["t"]
            elif key in started:
                self.spans[event["pid"]].append((started.pop(key), event["t"], event["id"]))
        for spans in self.spans.values():
            spans.sort()
        self.first = min(span[0] for spans in self.spans.values() for span in spans)

    def on(self, worker: int, when: float) -> str | None:
        spans = self.spans[worker]
        index = bisect.bisect_right(spans, (when + 1.5, float("inf"), "")) - 1  # starts are whole seconds
        if index >= 0 and spans[index][0] - 1.5 <= when <= spans[index][1] + 1.5:
            return spans[index][2]
        return None

    def running(self, when: float) -> list[str]:
        return [test for worker in self.spans if (test := self.on(worker, when))]


def unit(test: str) -> str:
    return test.rsplit("@", 1)[-1]  # pytest-xdist's group, which tests/conftest.py names


def charge(processes: list[Process], tests: Tests) -> dict[str, float]:
    by_pid: dict[int, list[Process]] = collections.defaultdict(list)
    for process in processes:
        by_pid[process.pid].append(process)

    def parent(process: Process) -> Process | None:  # pids are reused: the one alive at the child's start
        alive = [p for p in by_pid.get(process.ppid, []) if p.start <= process.start + 1 <= p.start + p.seconds + 2]
        return max(alive, key=lambda p: p.start, default=None)

    charged: dict[str, float] = collections.defaultdict(float)
    for process in processes:
        if process.pid in tests.spans:
            charged["(the pytest workers themselves)"] += process.cpu
            continue
        if process.cpu == 0:
            continue
        ancestor, daemon, test = process, None, None
        while (ancestor := parent(ancestor)) is not None:
            if ancestor.pid in tests.spans:
                test = tests.on(ancestor.pid, process.start)
                break
            if ancestor.command in SCHEDULER_UNITS:
                daemon = ancestor.command
        if test is not None:
            charged[test] += process.cpu
        elif process.command in ("cc1", "cc1plus", "as", "ld", "automake", "m4"):
            charged["(compilers: the PBS servers' builds, DeepSpeed's ops)"] += process.cpu
        elif process.start < tests.first:
            charged["(before the tests: set-up)"] += process.cpu
        else:
            # A scheduler's job; with no daemon among its ancestors, its parent outlived the
            # accounting (the PBS servers' MoMs keep running) and any scheduler's tests may own it.
            units = SCHEDULER_UNITS[daemon] if daemon else sum(SCHEDULER_UNITS.values(), ())
            shared = [t for t in tests.running(process.start) if unit(t) in units]
            for t in shared:
                charged[t] += process.cpu / len(shared)
            if not shared:
                charged["(between tests, or no test's)"] += process.cpu
    return charged


def by_unit(charged: dict[str, float], rows: int) -> None:
    units: dict[str, float] = collections.defaultdict(float)
    for test, cpu in charged.items():
        units[unit(test) if "@" in test else test] += cpu
    print("\n| unit | CPU-min |\n|---|---|")
    for name, cpu in sorted(units.items(), key=lambda item: -item[1]):
        if cpu >= 30:
            print(f"| {name or '(no CPU)'} | {cpu / 60:.2f} |")
    print("\n| test | CPU-s |\n|---|---|")
    for test, cpu in sorted(((t, c) for t, c in charged.items() if "@" in t), key=lambda item: -item[1])[:rows]:
        print(f"| {test.rsplit('@', 1)[0]} | {cpu:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("accounting", help="the file accton wrote")
    parser.add_argument("times", nargs="?", help="the file tests/testtimes.py wrote")
    parser.add_argument("--tests", type=int, default=30, help="how many of the costliest tests to list")
    args = parser.parse_args()
    processes = read_accounting(args.accounting)
    by_command(processes, 25)
    if args.times:
        by_unit(charge(processes, Tests(args.times)), args.tests)


if __name__ == "__main__":
    main()
