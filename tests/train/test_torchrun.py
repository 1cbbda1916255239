"""jobgen-torchrun gives the ranks TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to checkpoint after a
stop signal (node.sh sets it to requeue.warning_seconds), then SIGKILLs the ones still saving."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

RANK = str(Path(__file__).with_name("slow_checkpoint_rank.py"))


def wait_for_files(*paths: Path, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert proc is None or proc.poll() is None, f"torchrun ended early:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"{[p.name for p in paths]} not there after {timeout} s"
        time.sleep(0.1)


@pytest.mark.parametrize("signals", [1, 50], ids=["one-stop-signal", "more-during-the-grace"])
def test_ranks_get_the_shutdown_timeout_to_checkpoint_then_are_killed(tmp_path: Path, tools, signals: int) -> None:
    # Rank 0 saves in 2 s, within the 4 s granted; rank 1 would take 60 s and is cut at 4 s,
    # not at torch's default of 30 s: the grace period is the job's, both ways. More SIGTERMs
    # during the grace (a launcher ending tasks jobgen already asked to stop, as pbsdsh does) change
    # nothing. Before, each raised again inside torchrun's shutdown: a traceback from its logging
    # (seen in CI on OpenPBS) and, at 50 signals 20 ms apart, torchrun still running after 40 s.
    env = tools.subprocess_env(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="4", SAVE_SECONDS_0="2", SAVE_SECONDS_1="60")
    command = [sys.executable, "-m", "jobgen.train.torchrun", "--standalone", "--nproc-per-node=2", RANK, str(tmp_path)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_files(tmp_path / "ready-0", tmp_path / "ready-1", proc=proc)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for _ in range(signals - 1):
            time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=40)[0]
    finally:
        proc.kill()
    after_stop = time.monotonic() - stopped
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert (tmp_path / "saved-0").exists(), output
    assert not (tmp_path / "saved-1").exists(), output
    assert 4 <= after_stop < 20, f"torchrun ended {after_stop:.1f} s after SIGTERM:\n{output}"
    assert "jobgen-torchrun: SIGTERM: the ranks were told to stop and have exited" in output
    assert "Traceback" not in output


def test_before_torch_2_12_the_wrapper_sets_the_timeout_torch_ignores(tmp_path: Path, monkeypatch) -> None:
    # torch 2.2 to 2.11 stop the ranks with PContext.close(signal) and its fixed default of 30 s;
    # this calls it that way, on this torch's real process context, after the wrapper's fix.
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from torch.distributed.elastic.multiprocessing.api import PContext

    from jobgen.train.torchrun import honour_shutdown_timeout

    monkeypatch.setattr(PContext, "close", PContext.close)  # put back after the test
    honour_shutdown_timeout(3)
    ranks = start_processes(
        "ranks", sys.executable, args={0: (RANK, str(tmp_path)), 1: (RANK, str(tmp_path))},
        envs={rank: {"LOCAL_RANK": str(rank), "SAVE_SECONDS_0": "1", "SAVE_SECONDS_1": "60"} for rank in (0, 1)},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    wait_for_files(tmp_path / "ready-0", tmp_path / "ready-1")
    stopped = time.monotonic()
    ranks.close(signal.SIGTERM)
    after_stop = time.monotonic() - stopped
    assert (tmp_path / "saved-0").exists()
    assert not (tmp_path / "saved-1").exists()
    assert 3 <= after_stop < 20, f"close() returned {after_stop:.1f} s after SIGTERM"


@pytest.mark.parametrize("value", ["soon", "-5", "1.5"])
def test_a_timeout_that_is_not_whole_seconds_is_refused_in_one_line(value: str, monkeypatch) -> None:
    from jobgen.train.torchrun import shutdown_timeout_from_env

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", value)
    with pytest.raises(SystemExit, match="expected a whole number of seconds"):
        shutdown_timeout_from_env()


def test_this_torch_reads_the_timeout_itself() -> None:
    # pyproject allows torch >= 2.2; torch reads the variable itself from 2.12 on.
    import torch

    from jobgen.train.torchrun import torch_reads_shutdown_timeout

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert torch_reads_shutdown_timeout() == ((major, minor) >= (2, 12))


def test_a_failed_rank_is_one_line_not_torchruns_traceback(tmp_path: Path, tools) -> None:
    # What a user's mistake looks like on a node: the rank prints its one-line error and exits 2;
    # torchrun itself would add a ChildFailedError traceback of its own code under it.
    rank = tmp_path / "rank.py"
    rank.write_text("import sys\nsys.stderr.write('jobgen-train: error: training.data: a bad record\\n')\nsys.exit(2)\n")
    command = [sys.executable, "-m", "jobgen.train.torchrun", "--standalone", "--nproc-per-node=1", str(rank)]
    out = subprocess.run(command, env=tools.subprocess_env(), capture_output=True, text=True, timeout=120)
    output = out.stdout + out.stderr
    assert out.returncode == 1, output
    assert "jobgen-train: error: training.data: a bad record" in output
    assert "jobgen-torchrun: rank 0 (local rank 0, pid " in output and ") exited with status 2; its own error is above" in output
    assert "Traceback" not in output and "ChildFailedError" not in output, output


SLOW_AGENT = """
import sys, time
import torch.distributed.elastic.utils.store as store_util

# What a loaded node or a slow network does: this node's torchrun arrives at the exit barrier
# first but asks for its result 3 s later, after node 0 has arrived last.
arrive = store_util._barrier_nonblocking

def arrive_then_stall(**kwargs):
    key = arrive(**kwargs)
    time.sleep(3)
    return key

store_util._barrier_nonblocking = arrive_then_stall
from jobgen.train.torchrun import main
sys.argv[0] = "jobgen-torchrun"
main()
"""


def test_a_node_slow_at_the_exit_barrier_finds_the_store_still_there_delay_injected(tmp_path: Path, tools) -> None:
    # Three nodes' torchruns on one host, static rendezvous as node.sh starts them. Node 0 (the
    # store's) finishes 2 s after the others, so it arrives at the barrier last; torch's own
    # barrier then lets it leave before node 1 asks, and node 1 logs "Error waiting on exit
    # barrier" with a traceback, in a run that succeeded (pytorch/pytorch#69520). Node 2 arrives
    # on time: it must not be left polling a store that is gone.
    rank = tmp_path / "rank.py"
    rank.write_text("import os, time\ntime.sleep(2 if os.environ['GROUP_RANK'] == '0' else 0)\n")
    agent = tmp_path / "slow_agent.py"
    agent.write_text(SLOW_AGENT)
    common = ["--nnodes=3", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
              "--monitor-interval=0.1", str(rank)]
    env = tools.subprocess_env()
    nodes = [subprocess.Popen([sys.executable, "-m", "jobgen.train.torchrun", "--node-rank=0", *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, str(agent), "--node-rank=1", *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
             subprocess.Popen([sys.executable, "-m", "jobgen.train.torchrun", "--node-rank=2", *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output
        assert "Error waiting on exit barrier" not in output and "Traceback" not in output, output
        assert "Failed to recv" not in output, output


def test_a_stop_signal_is_recorded_as_the_nodes_end_the_moment_it_arrives(tmp_path: Path, monkeypatch) -> None:
    """A launcher may kill a node it ended (PBS's kill_delay) before its ranks have exited: the
    signal itself is the node's recorded end (128+N), before torchrun's own handler runs."""
    from torch.distributed.elastic.multiprocessing import api

    from jobgen.train import torchrun

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # undone after the test
    monkeypatch.setenv("JOBGEN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("JOBGEN_NODE_NAME", "node7")
    monkeypatch.setenv("JOBGEN_JOB_ID", "4711")
    monkeypatch.setenv("JOBGEN_RESTART_COUNT", "2")
    torchrun.record_at_a_stop_signal()
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    # This segment's record, under a name for each of the batch script's looks.
    records = {p.name: p.read_text() for p in (tmp_path / "node-ends" / "4711-2").iterdir()}
    assert records == {f"1.{look}": "143 node7 run\n" for look in range(6)}


def test_the_ranks_share_a_node_folder_that_is_gone_when_they_have_exited(tmp_path: Path, tools) -> None:
    """Where a node's ranks wait for a data store together (jobgen.train.node_relay): a folder
    under the node's TMPDIR, the same for both ranks, removed by jobgen-torchrun at the end, so a
    shared /tmp keeps nothing of the job: not that folder, nor torchrun's own torchelastic_*
    folder of logs, which torchrun alone leaves (seen: 2,216 of them in this machine's /tmp)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    rank = tmp_path / "rank.py"
    rank.write_text("import os, pathlib\n"
                    "folder = pathlib.Path(os.environ['JOBGEN_NODE_TMP'])\n"
                    "(folder / ('rank-' + os.environ['LOCAL_RANK'])).write_text('')\n"
                    "(pathlib.Path(os.sys.argv[1]) / ('folder-' + os.environ['LOCAL_RANK'])).write_text(str(folder))\n")
    env = tools.subprocess_env(TMPDIR=str(temporary))
    done = subprocess.run([sys.executable, "-m", "jobgen.train.torchrun", "--standalone", "--nproc-per-node=2", str(rank),
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    folders = {(tmp_path / f"folder-{local}").read_text() for local in (0, 1)}
    assert len(folders) == 1 and Path(folders.pop()).parent == temporary, folders
    assert list(temporary.iterdir()) == []


class Failed:
    """What ended_by_the_stop reads of torchrun's ChildFailedError: each failed rank's exit code."""

    def __init__(self, *exitcodes: int) -> None:
        self.failures = {rank: type("Failure", (), {"exitcode": code})() for rank, code in enumerate(exitcodes)}


@pytest.mark.parametrize("stop, exitcodes, stopped", [
    (signal.SIGTERM, [-signal.SIGTERM], True),   # stopped before its handler was in place, or in its exit
    (signal.SIGUSR1, [-signal.SIGUSR1, -signal.SIGTERM], True),  # torchrun ended the node's other rank
    (signal.SIGTERM, [-signal.SIGKILL], True),   # the grace spent
    (signal.SIGTERM, [-signal.SIGTERM, 1], False),  # a rank that failed by itself
    (signal.SIGTERM, [-signal.SIGSEGV], False),
    (0, [-signal.SIGTERM], False),  # no stop was asked: a rank killed by a signal failed
])
def test_ranks_ended_by_a_signal_of_the_stop_are_a_stop_and_any_other_end_a_failure(stop, exitcodes, stopped) -> None:
    from jobgen.train.torchrun import ended_by_the_stop

    assert ended_by_the_stop(Failed(*exitcodes), stop) is stopped


def test_a_second_stop_signal_is_ignored_while_ranks_live_and_ends_the_node_once_none_does(monkeypatch) -> None:
    from torch.distributed.elastic.multiprocessing import api

    from jobgen.train import torchrun

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)  # undone after the test
    monkeypatch.setattr(torchrun, "NODE_STOP", torchrun.NodeStop())
    monkeypatch.delenv("JOBGEN_RUN_DIR", raising=False)
    torchrun.record_at_a_stop_signal()
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert torchrun.NODE_STOP.signum == signal.SIGTERM
    monkeypatch.setattr(torchrun, "child_pids", lambda: [4242])  # a rank still saving
    api._terminate_process_handler(signal.SIGTERM, None)  # nothing: its grace stands
    monkeypatch.setattr(torchrun, "child_pids", lambda: [])
    with pytest.raises(SystemExit) as leaving:
        api._terminate_process_handler(signal.SIGINT, None)
    assert leaving.value.code == 128 + signal.SIGTERM


def test_after_a_stop_a_node_does_not_wait_300_s_at_the_exit_barrier_for_a_node_that_failed(tmp_path: Path, tools) -> None:
    # Two nodes' torchruns on one host, after the batch script's stop request: node 0's rank saved
    # and exited 0; node 1's failed (or was ended by the stop) and its torchrun left without the
    # exit barrier. torch's barrier would keep node 0, and the job, 300 s.
    (tmp_path / "stop-requested").touch()
    rank = tmp_path / "rank.py"
    rank.write_text("import os, sys, time\ntime.sleep(1)\nsys.exit(0 if os.environ['GROUP_RANK'] == '0' else 1)\n")
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
              "--monitor-interval=0.1", str(rank)]
    env = tools.subprocess_env(JOBGEN_RUN_DIR=str(tmp_path))
    started = time.monotonic()
    nodes = [subprocess.Popen([sys.executable, "-m", "jobgen.train.torchrun", f"--node-rank={node}", *common], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    took = time.monotonic() - started
    assert nodes[0].returncode == 0 and nodes[1].returncode == 1, outputs
    assert took < 120, f"node 0 ended {took:.0f} s after it started:\n{outputs[0]}"
