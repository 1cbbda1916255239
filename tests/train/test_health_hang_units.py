"""The health gate's report and cache, the hang bound, and the node supervisor on real processes;
no cluster needed (tests/test_slurm_health_hang.py runs both on one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from jobgen.rundir.files import rank_log
from jobgen.train import health
from jobgen.train.console import open_rank_log
from jobgen.train.heartbeat import (FLOOR_SECONDS, QUICK_FLOOR_SECONDS, REPORT_SECONDS, SAVE_SECONDS, STACK_SECONDS,
                                    STARTUP_SECONDS, WARM_PAUSES, Supervisor, describe_hang, hang_bound, kill_after, node_silent,
                                    process_state, rank_phases, segment_phase, still_seconds, stopped_first)


def test_a_node_off_the_majority_is_named_with_what_the_others_have() -> None:
    nodes = {name: {"torch": "2.6.0", "peft": "0.14.0"} for name in ("gpu01", "gpu02", "gpu17", "gpu20")}
    nodes["gpu17"]["torch"] = "2.5.1"
    nodes["gpu20"]["peft"] = None
    lines, differed = health.compare(nodes, "gpu01")
    assert lines == ["node gpu20: peft not installed, the other 3 nodes 0.14.0", "node gpu17: torch 2.5.1, the other 3 nodes 2.6.0"]
    assert differed == {"gpu01": [], "gpu02": [], "gpu17": ["torch"], "gpu20": ["peft"]}


def test_with_two_nodes_the_first_node_is_taken_as_right() -> None:
    lines, _ = health.compare({"node1": {"data sha256": "aaa"}, "node2": {"data sha256": "bbb"}}, "node1")
    assert lines == ["node node2: data sha256 bbb, the other node aaa"]


def test_the_data_hash_is_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_bytes(b"x" * 1000)
    first = health.HashCache(str(tmp_path / "run"), "node1")
    found = first.file_hash(str(data))
    first.save()
    assert first.misses == 1
    # Same size and mtime, other bytes: a restart trusts the cache and does not read the file again.
    stat = data.stat()
    data.write_bytes(b"y" * 1000)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = health.HashCache(str(tmp_path / "run"), "node1")
    assert again.file_hash(str(data)) == found and (again.hits, again.misses) == (1, 0)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: hashed again
    assert health.HashCache(str(tmp_path / "run"), "node1").file_hash(str(data))["sha256"] != found["sha256"]


def test_hashing_a_data_file_tells_the_heartbeat_how_far_it_got(tmp_path: Path, monkeypatch) -> None:
    """The first start on a large data set hashes it (the health gate's cache, and the store's
    name) for longer than the start-up's hang bound: the bytes read so far reach the rank's
    heartbeat as it goes, a change the hang supervisor counts as progress."""
    from jobgen.train import store

    data = tmp_path / "data.jsonl"
    data.write_bytes(b"x" * (40 * 2**20))
    monkeypatch.setattr(health, "PROGRESS_EVERY", 0.0)  # every chunk read is reported
    seen: list[int] = []
    health.HashCache(str(tmp_path / "run"), "node1", seen.append).file_hash(str(data))
    assert seen == [n * health.CHUNK for n in range(1, 6)]  # 8 MiB chunks of 40 MiB
    seen.clear()
    store._HashCache(str(tmp_path / "prepared"), seen.append).file_sha256(str(data), "training.data")
    assert seen == [16 * 2**20, 32 * 2**20, 40 * 2**20]  # its 16 MiB chunks
    seen.clear()
    store._HashCache(str(tmp_path / "prepared")).file_sha256(str(data), "training.data")  # no callback: no report
    assert seen == []


def test_the_bound_follows_the_step_times_above_a_floor_and_is_longer_at_start_and_save() -> None:
    assert hang_bound([], "training") == FLOOR_SECONDS
    assert hang_bound([2.0, 3.0], "training") == FLOOR_SECONDS
    assert hang_bound([20.0, 30.0, 25.0], "training") == 150.0  # five times the slowest recent step
    assert hang_bound([20.0, 30.0], "training", override=45) == 45
    assert hang_bound([20.0], "start-up") == STARTUP_SECONDS
    assert hang_bound([20.0], "saving") == SAVE_SECONDS
    assert hang_bound([20.0], "saving", save_seconds=[200.0]) == 600.0
    assert hang_bound([20.0], "saving", override=30, save_seconds=[2.0]) == 30  # set: saves are not slower
    assert hang_bound([20.0], "start-up", override=30) == STARTUP_SECONDS


def test_in_steady_training_the_floor_is_10_s_and_evaluation_and_reporting_keep_their_own() -> None:
    warm = [0.5] * WARM_PAUSES
    assert hang_bound(warm[1:], "training") == FLOOR_SECONDS  # the step times not known yet
    assert hang_bound(warm, "training") == QUICK_FLOOR_SECONDS == 10
    assert hang_bound([*warm, 3.0], "training") == 15.0
    assert hang_bound(warm, "evaluating") == FLOOR_SECONDS
    assert hang_bound(warm, "reporting") == REPORT_SECONDS  # rank 0 calling a slow tracker server
    assert hang_bound(warm, "reporting", override=20) == 20
    assert segment_phase({"training", "evaluating 3"}) == "evaluating"
    assert segment_phase({"evaluating 1"}) == "evaluating"  # before a resumed segment's first step
    assert segment_phase({"training", "reporting"}) == "reporting"
    # A checkpoint written in the background may slow the steps: they keep the floor meanwhile.
    assert segment_phase(rank_phases([{"phase": "training", "writing": True}, {"phase": "training"}])) == "writing"
    assert hang_bound(warm, "writing") == FLOOR_SECONDS
    # A node reports its ranks still after twice its usual step, so steady training publishes no more.
    assert still_seconds([]) == 2.0 and still_seconds([0.2] * 9) == 2.0 and still_seconds([4.0, 5.0, 30.0]) == 10.0


def test_the_ranks_that_stopped_first_are_the_frozen_ones_else_those_behind() -> None:
    ranks = [
        {"rank": 0, "node": "node1", "step": 5, "waiting": True, "alive": True, "state": "waiting"},
        {"rank": 1, "node": "node1", "step": 5, "waiting": True, "alive": True, "state": "waiting"},
        {"rank": 2, "node": "node2", "step": 4, "waiting": False, "alive": False, "state": "stopped"},
        {"rank": 3, "node": "node2", "step": 5, "waiting": False, "alive": False, "state": "stopped"},
    ]
    first = stopped_first(ranks)
    assert [r["rank"] for r in first] == [2, 3]
    assert describe_hang(63.2, 60, 5, first, 4) == (
        "no progress for 63 s (bound 60 s) after step 5; stopped first: node node2 (ranks 2, 3: stopped)")
    alive = [dict(r, alive=True, state="waiting") for r in ranks]
    assert [r["rank"] for r in stopped_first(alive)] == [2]  # behind: still at step 4
    same = [dict(r, step=5, waiting=True) for r in alive]
    assert "every rank alike" in describe_hang(70, 60, 5, stopped_first(same), 4)


RANK = textwrap.dedent("""
    import os, sys, time
    from jobgen.train.heartbeat import Heartbeat, install_stack_dump
    install_stack_dump()
    beat = Heartbeat(int(sys.argv[1]), sys.argv[2])
    for step in range(1, 4):
        beat.beat(step, "training", waiting=True)
        beat.beat(step, "training")
        time.sleep(0.2)
    beat.beat(4, "training", waiting=True)
    print("ready", flush=True)
    while True:
        time.sleep(0.5)  # "in the collective" of step 4
""")


def test_the_supervisor_names_the_stopped_rank_dumps_stacks_and_ends_the_ranks(tmp_path: Path) -> None:
    """Two real rank processes; one is stopped with SIGSTOP. The supervisor must name it, write
    hang.json, put both stacks into their rank logs and kill both, within the bound."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    env = {"JOBGEN_RUN_DIR": str(run_dir), "JOBGEN_JOB_ID": "77", "JOBGEN_RESTART_COUNT": "0", "NODE_RANK": "0",
           "NNODES": "1", "JOBGEN_HANG_SECONDS": "4"}
    saved = {k: os.environ.get(k) for k in [*env, "JOBGEN_HEARTBEAT_DIR"]}
    os.environ.update(env)
    try:
        supervisor = Supervisor.from_env()
        ranks = []
        for rank in (0, 1):
            log = os.fdopen(open_rank_log(str(run_dir), "77", rank), "a")  # as a rank's log is: appended to
            ranks.append(subprocess.Popen([sys.executable, "-c", RANK, str(rank), "node1"], stdout=subprocess.PIPE,
                                          stderr=log, text=True))
        for proc in ranks:
            assert proc.stdout.readline().strip() == "ready"
        supervisor.start()
        time.sleep(1.5)
        stopped = time.monotonic()
        ranks[1].send_signal(signal.SIGSTOP)
        codes = [proc.wait(timeout=30) for proc in ranks]
        took = time.monotonic() - stopped
        supervisor.close()
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    hang = json.loads((run_dir / "hang.json").read_text())
    assert hang["ranks"] == [1] and hang["nodes"] == "node1" and hang["bound_seconds"] == 4
    assert "stopped first: node node1 (rank 1: stopped)" in hang["message"]
    assert took < 4 + 10
    for rank in (0, 1):
        text = (run_dir / rank_log("77", rank)).read_text()
        assert "jobgen hang supervisor: rank" in text and 'File "<string>", line 13 in <module>' in text, text


PEER_RANK = RANK.replace("    time.sleep(0.5)  # \"in the collective\" of step 4", """    time.sleep(0.5)
    if process_state(int(sys.argv[3])) is None:  # as gloo does when the peer's connection closes
        sys.exit("Connection closed by peer")""").replace("import Heartbeat,", "import Heartbeat, process_state,")
assert "Connection closed by peer" in PEER_RANK and "process_state," in PEER_RANK  # RANK as this expects it


def test_a_node_that_finds_the_hang_late_still_takes_its_ranks_stacks_before_any_rank_is_killed(tmp_path: Path) -> None:
    """Node 0 decides (its rank is the stopped one); node 5 reads no summaries and finds hang.json
    up to 5 s later. Its rank fails at once when node 0's rank is killed, as a gloo collective
    does: seen on the Slurm cluster, a rank's log without its stack. Node 0 must wait for it, its
    stopped rank held where it was: continued for its stack dump, it would go on training."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    supervisors = {node: Supervisor(str(run_dir), "77", "0", node_rank=node, nnodes=6, override=4.0,
                                    local_dir=str(tmp_path / f"shm-{node}")) for node in (0, 5)}
    (run_dir / "heartbeat").mkdir()
    for node in (1, 2, 3, 4):  # healthy nodes, their ranks still in the collective: they have said so
        (run_dir / "heartbeat" / f"node-{node}.json").write_text(json.dumps({
            "job_id": "77", "restart": "0", "seq": 1, "stalled": True, "ranks": [
                {"rank": 10 + node, "node": f"node{node}", "step": 4, "phase": "training", "waiting": True,
                 "alive": True, "state": "waiting"}]}))
    ranks = {}
    for rank, node in ((0, 0), (1, 5)):
        os.mkdir(supervisors[node].local_dir)
        log = os.fdopen(open_rank_log(str(run_dir), "77", rank), "a")
        peer = str(ranks[0].pid) if rank == 1 else "1"
        ranks[rank] = subprocess.Popen([sys.executable, "-c", PEER_RANK, str(rank), f"node{node}", peer],
                                       stdout=subprocess.PIPE, stderr=log, text=True,
                                       env={**os.environ, "JOBGEN_HEARTBEAT_DIR": supervisors[node].local_dir})
        assert ranks[rank].stdout.readline().strip() == "ready"
    # Node 0 decides about 5 s after its start (the bound, 4 s, after its first read); node 5, started
    # 3.5 s before, looks for hang.json 1.5 s before that and next 3.5 s after: the late node.
    supervisors[5].start()
    time.sleep(3.5)
    supervisors[0].start()
    time.sleep(1.5)
    ranks[0].send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not (run_dir / "hang.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    # Continued for its stack, the stopped rank is held again until it is killed, 10 s after.
    time.sleep(STACK_SECONDS + 2)
    held = process_state(ranks[0].pid)
    codes = [ranks[rank].wait(timeout=60) for rank in (0, 1)]
    for supervisor in supervisors.values():
        supervisor.close()
    assert held == "T" and codes[0] == -signal.SIGKILL
    assert json.loads((run_dir / "hang.json").read_text())["ranks"] == [0]
    for rank in (0, 1):
        text = (run_dir / rank_log("77", rank)).read_text()
        assert "jobgen hang supervisor: rank" in text and 'File "<string>", line 1' in text, (rank, text)
    assert all(supervisor.hung for supervisor in supervisors.values())  # both nodes' torchrun exit as hung


def test_two_nodes_end_their_ranks_once_both_have_taken_their_stacks_not_at_the_latest_bound(tmp_path: Path) -> None:
    """Both nodes say in their summaries when they have taken their ranks' stacks; each kills its
    ranks once every node has, seconds before `kill_after` (each second there is one more of the
    restart), and every rank's stack is in its log."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "heartbeat").mkdir()
    supervisors = {node: Supervisor(str(run_dir), "77", "0", node_rank=node, nnodes=2, override=4.0,
                                    local_dir=str(tmp_path / f"shm-{node}")) for node in (0, 1)}
    ranks = {}
    for node in (0, 1):
        os.mkdir(supervisors[node].local_dir)
        log = os.fdopen(open_rank_log(str(run_dir), "77", node), "a")
        ranks[node] = subprocess.Popen([sys.executable, "-c", RANK, str(node), f"node{node}"], stdout=subprocess.PIPE,
                                       stderr=log, text=True, env={**os.environ, "JOBGEN_HEARTBEAT_DIR": supervisors[node].local_dir})
        assert ranks[node].stdout.readline().strip() == "ready"
    for supervisor in supervisors.values():
        supervisor.start()
    time.sleep(1.5)
    ranks[1].send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not (run_dir / "hang.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    found = time.monotonic()
    codes = [ranks[node].wait(timeout=60) for node in (0, 1)]
    ended = time.monotonic() - found
    summaries = [json.loads((run_dir / "heartbeat" / f"node-{node}.json").read_text()) for node in (0, 1)]
    for supervisor in supervisors.values():
        supervisor.close()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    assert all(summary["stacks_taken"] for summary in summaries) and any(summary["all_stacks_taken"] for summary in summaries)
    # Asked for their stacks at most a read (3 s) apart, 2 s for the stacks each, a poll of 0.5 s.
    assert ended < kill_after(2) - 1, ended
    for node in (0, 1):
        text = (run_dir / rank_log("77", node)).read_text()
        assert "jobgen hang supervisor: rank" in text and 'File "<string>", line 13 in <module>' in text, text


def test_a_node_whose_summary_stops_changing_is_silent_by_the_readers_own_clock(tmp_path: Path) -> None:
    """A whole node frozen: its own supervisor stops publishing, and the readers must name it.
    What counts is how long the reader has seen the same summary, by its own clock, not the time
    written inside (node 2's says it is fresh)."""
    shared = tmp_path / "heartbeat"
    shared.mkdir()

    def publish(node: int, seq: int) -> None:
        (shared / f"node-{node}.json").write_text(json.dumps({"job_id": "5", "restart": "0", "seq": seq,
                                                              "at": time.time(), "ranks": [
            {"rank": node, "node": f"gpu{node}", "step": 9, "waiting": False, "alive": True, "state": "waiting"}]}))

    reader_clock = [1000.0]
    supervisor = Supervisor(str(tmp_path), "5", "0", node_rank=0, nnodes=3, override=None, clock=lambda: reader_clock[0])
    mine = [{"rank": 0, "node": "gpu0", "step": 9, "waiting": True, "alive": True, "state": "waiting"}]
    publish(1, 1), publish(2, 1)
    assert all(r["state"] == "waiting" for r in supervisor.all_ranks(mine))
    reader_clock[0] += node_silent(3) + 1
    publish(1, 2)  # node 1 goes on publishing; node 2 does not
    first = stopped_first(supervisor.all_ranks(mine))
    assert [(r["rank"], r["state"]) for r in first] == [(2, "silent node")]


def test_a_summary_that_cannot_be_read_for_a_moment_is_the_one_last_read_and_then_silent(tmp_path: Path) -> None:
    """A network file system may fail a read while a summary is replaced (ESTALE, "no such file").
    Seen on the sshfs hosts: a node dropping out of one read and back counted as progress, and a
    hang of 60 s was detected after 160 to 280 s. The summary last read stands in; one unreadable
    for longer than node_silent keeps its sequence number, so its node turns silent."""
    shared = tmp_path / "heartbeat"
    shared.mkdir()
    summary = {"job_id": "5", "restart": "0", "seq": 1, "at": 0, "ranks": [
        {"rank": 1, "node": "gpu1", "step": 9, "waiting": True, "alive": True, "state": "waiting"}]}
    (shared / "node-1.json").write_text(json.dumps(summary))
    reader_clock = [1000.0]
    supervisor = Supervisor(str(tmp_path), "5", "0", node_rank=0, nnodes=2, override=None, clock=lambda: reader_clock[0])
    mine = [{"rank": 0, "node": "gpu0", "step": 9, "waiting": False, "alive": False, "state": "stopped"}]
    read = supervisor.all_ranks(mine)
    (shared / "node-1.json").unlink()  # the replacement's moment
    assert supervisor.all_ranks(mine) == read
    (shared / "node-1.json").write_text('{"job_id": "5", "rest')  # half a file
    assert supervisor.all_ranks(mine) == read
    reader_clock[0] += node_silent(2) + 1
    assert [r["state"] for r in supervisor.all_ranks(mine)] == ["stopped", "silent node"]


def test_a_supervisor_says_its_node_lives_before_its_ranks_start_then_publishes_their_summary(tmp_path: Path,
                                                                                                monkeypatch) -> None:
    """A node's ranks write their first file only after their imports and the model's load: until
    then its supervisor rewrites node-K.starting every PUBLISH_EVERY seconds (what the batch script
    of a job with spares reads, tests/test_pbs_scripts.py), and no summary; once a rank has written,
    the summary takes over and the start-up file is left as it was."""
    from jobgen.train import heartbeat

    monkeypatch.setattr(heartbeat, "PUBLISH_EVERY", 1.0)
    for name, value in {"JOBGEN_RUN_DIR": str(tmp_path), "JOBGEN_JOB_ID": "12", "JOBGEN_RESTART_COUNT": "0",
                        "NODE_RANK": "1", "NNODES": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(heartbeat.HANG_SECONDS_ENV, raising=False)
    supervisor = Supervisor.from_env()
    starting, summary = tmp_path / "heartbeat" / "node-1.starting", tmp_path / "heartbeat" / "node-1.json"

    def seen(path: Path, what: str, check=lambda text: True) -> str:
        deadline = time.monotonic() + 20
        while not (path.exists() and check(path.read_text())):
            assert time.monotonic() < deadline, what
            time.sleep(0.1)
        return path.read_text()

    supervisor.start()
    try:
        first = json.loads(seen(starting, "the supervisor wrote no start-up file"))
        assert (first["job_id"], first["restart"], first["node_rank"]) == ("12", "0", 1)
        seen(starting, "the start-up file was not rewritten", lambda text: json.loads(text)["seq"] > first["seq"])
        assert not summary.exists()
        local = Path(supervisor.local_dir)
        (local / "rank1.json").write_text(json.dumps({"rank": 1, "pid": os.getpid(), "node": "node1", "step": 0,
                                                      "phase": "start-up", "waiting": False, "at": time.monotonic()}))
        (local / "rank1.alive").touch()
        assert json.loads(seen(summary, "no summary once a rank had written"))["ranks"][0]["rank"] == 1
        last = starting.read_text()
        seen(summary, "the summary was not published again", lambda text: json.loads(text)["seq"] > json.loads(last)["seq"] + 1)
        assert starting.read_text() == last
    finally:
        supervisor.close()


SUPERVISOR = textwrap.dedent("""
    import json, os, subprocess, sys, time
    real_time = time.time
    time.time = lambda: real_time() + float(sys.argv[1])  # this node's wall clock, off by argv[1] seconds
    from jobgen.train import heartbeat
    from jobgen.train.console import open_rank_log
    # The module's constants as argv[3] says, e.g. seconds instead of tens so that a test takes seconds.
    patches = json.loads(sys.argv[3])
    if "read_every" in patches:
        heartbeat.read_every = lambda nnodes, every=patches.pop("read_every"): every
    for name, value in patches.items():
        setattr(heartbeat, name, value)
    supervisor = heartbeat.Supervisor.from_env()
    node = os.environ["NODE_RANK"]
    with os.fdopen(open_rank_log(os.environ["JOBGEN_RUN_DIR"], os.environ["JOBGEN_JOB_ID"], int(node)), "a") as log:
        rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], node, "node" + node, *sys.argv[4:]],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    assert rank.stdout.readline().strip() == "ready"
    supervisor.start()
    print(rank.pid, flush=True)
    rank.wait()
    supervisor.close()
""")


def test_a_node_whose_clock_is_60_s_behind_is_not_silent_monkeypatched_clock_as_namespaces_share_the_kernels(
        tmp_path: Path) -> None:
    """Three nodes, each a real supervisor process with a real rank. Node 1's wall clock is 60 s
    behind (time.time patched in its process: separate hosts on this machine would share the
    kernel's clock). Node 2 is really frozen (SIGSTOP, supervisor and rank). The hang found must
    name node 2 alone: node 1 is neither named nor excluded."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    nodes, ranks = [], []
    for node, skew in ((0, 0.0), (1, -60.0), (2, 0.0)):
        env = dict(os.environ, JOBGEN_RUN_DIR=str(run_dir), JOBGEN_JOB_ID="9", JOBGEN_RESTART_COUNT="0",
                   NODE_RANK=str(node), NNODES="3", JOBGEN_HANG_SECONDS="10")
        env.pop("JOBGEN_HEARTBEAT_DIR", None)
        # Publish, read and follow every second, silent after 4 s: the test takes seconds.
        patches = {"PUBLISH_EVERY": 1.0, "FOLLOW_EVERY": 1.0, "NODE_SILENT": 4.0, "read_every": 1.0}
        nodes.append(subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(skew), RANK, json.dumps(patches)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    try:
        ranks = [int(proc.stdout.readline()) for proc in nodes]
        deadline = time.monotonic() + 20
        while not all((run_dir / "heartbeat" / f"node-{k}.json").exists() for k in range(3)):
            assert time.monotonic() < deadline, "the supervisors published no summary"
            time.sleep(0.2)
        for pid in (nodes[2].pid, ranks[2]):
            os.kill(pid, signal.SIGSTOP)
        codes = [proc.wait(timeout=60) for proc in nodes[:2]]
    finally:
        for pid in (nodes[2].pid, ranks[2]):
            os.kill(pid, signal.SIGKILL)
        for proc in nodes:
            proc.kill()
            proc.wait()
    assert codes == [0, 0]
    hang = json.loads((run_dir / "hang.json").read_text())
    assert hang["nodes"] == "node2", hang["message"]  # what the batch script excludes on the requeue
    assert "stopped first: node node2 (rank 2: silent node)" in hang["message"]


# A rank that trains a step every 0.3 s for as long as its peers run, and waits in the step's
# collective, as a gloo or NCCL rank does, once one of them is stopped.
STEPPING_RANK = textwrap.dedent("""
    import os, sys, time
    from jobgen.train.heartbeat import Heartbeat, process_state
    beat = Heartbeat(int(sys.argv[1]), sys.argv[2])
    print("ready", flush=True)
    while not os.path.exists(sys.argv[3]):
        time.sleep(0.05)
    peers = [int(pid) for pid in open(sys.argv[3]).read().split() if int(pid) != os.getpid()]
    step = 0
    while True:
        time.sleep(0.3)
        step += 1
        beat.beat(step, "training", waiting=True)
        while any(process_state(pid) in (None, "T", "t") for pid in peers):
            time.sleep(0.1)
        beat.beat(step, "training")
""")


def three_nodes_training(run_dir: Path, patches: dict) -> tuple[list[subprocess.Popen], list[int]]:
    """Three real supervisors on the default bound, each with a real stepping rank; returns them
    and their ranks' pids once every rank trains."""
    (run_dir / "logs").mkdir(parents=True)
    peers = run_dir / "pids"
    nodes = []
    for node in range(3):
        env = dict(os.environ, JOBGEN_RUN_DIR=str(run_dir), JOBGEN_JOB_ID="12", JOBGEN_RESTART_COUNT="0",
                   NODE_RANK=str(node), NNODES="3")
        for key in ("JOBGEN_HEARTBEAT_DIR", "JOBGEN_HANG_SECONDS"):
            env.pop(key, None)
        nodes.append(subprocess.Popen([sys.executable, "-c", SUPERVISOR, "0", STEPPING_RANK, json.dumps(patches), str(peers)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    ranks = [int(proc.stdout.readline()) for proc in nodes]
    peers.write_text(" ".join(map(str, ranks)))
    return nodes, ranks


def test_a_stopped_rank_is_found_in_10_s_of_steady_training_and_a_node_that_says_nothing_waits_for_the_floor(
        tmp_path: Path) -> None:
    """The quick bound (10 s) holds once the step times are known and every node has reported its
    ranks still: a rank stopped while its node's supervisor runs is named in at most 15 s. A node
    frozen whole (its supervisor too, as a powered-off or cut-off node) has said nothing, and the
    others wait for the floor (60 s; 20 s here) and for it to turn silent (30 s; 16 s here), so
    that it is named and a scheduler that saw it down has its say first."""
    patches = {"FLOOR_SECONDS": 20.0, "NODE_SILENT": 15.0, "PUBLISH_EVERY": 5.0}
    runs = {"rank": tmp_path / "rank", "node": tmp_path / "node"}
    started = {name: three_nodes_training(run_dir, patches) for name, run_dir in runs.items()}
    try:
        time.sleep(16)  # more than WARM_PAUSES pauses in training, read a second apart: the bound is known
        stopped_at = time.time()
        os.kill(started["rank"][1][2], signal.SIGSTOP)
        for pid in (started["node"][0][2].pid, started["node"][1][2]):
            os.kill(pid, signal.SIGSTOP)
        codes = [proc.wait(timeout=90) for name in runs for proc in started[name][0][:2]]
    finally:
        for nodes, ranks in started.values():
            for pid in (nodes[2].pid, ranks[2]):
                with contextlib.suppress(ProcessLookupError):  # the stopped rank's supervisor killed it
                    os.kill(pid, signal.SIGKILL)
            for proc in nodes:
                proc.kill()
                proc.wait()
    assert codes == [0, 0, 0, 0]
    rank, node = (json.loads((run_dir / "hang.json").read_text()) for run_dir in runs.values())
    # The quick bound: 10 s, or 5 times the longest recent pause where the machine is loaded (13 s
    # seen under a whole test run), never the floor that a silent node holds the others to.
    assert (rank["nodes"], rank["phase"]) == ("node2", "training") and 10 <= rank["bound_seconds"] < 20, rank
    assert "stopped first: node node2 (rank 2: stopped)" in rank["message"], rank
    assert rank["at"] - stopped_at < 20, rank
    assert (node["nodes"], node["bound_seconds"]) == ("node2", 20), node
    assert "stopped first: node node2 (rank 2: silent node)" in node["message"], node
    assert node["at"] - stopped_at >= 20, node
    print(f"hang known {rank['at'] - stopped_at:.1f} s after a rank stopped (bound {rank['bound_seconds']} s), "
          f"{node['at'] - stopped_at:.1f} s after a node froze whole (floor 20 s here)")


def test_only_nodes_0_and_1_read_every_summary_and_nodes_2_and_3_take_over_when_both_are_silent(tmp_path: Path) -> None:
    """At 512 nodes every node reading every summary was 261,632 opens a second on the shared file
    system; now two nodes read them, and two stand by."""
    shared = tmp_path / "heartbeat"
    shared.mkdir()
    reader_clock = [0.0]

    def publish(node: int, seq: int) -> None:
        (shared / f"node-{node}.json").write_text(json.dumps({"job_id": "5", "restart": "0", "seq": seq, "ranks": [
            {"rank": node, "node": f"gpu{node}", "step": 9, "waiting": False, "alive": True, "state": "waiting"}]}))

    def supervisor(node: int) -> Supervisor:
        return Supervisor(str(tmp_path), "5", "0", node_rank=node, nnodes=512, override=None,
                          clock=lambda: reader_clock[0])

    publish(0, 1), publish(1, 1)
    nodes = {k: supervisor(k) for k in (0, 1, 2, 3, 4, 511)}
    assert [k for k, s in nodes.items() if s.aggregates()] == [0, 1]
    reader_clock[0] += node_silent(512) + 1
    publish(1, 2)  # node 0 is silent, node 1 reads on: nobody takes over
    assert [k for k, s in nodes.items() if s.aggregates()] == [0, 1]
    reader_clock[0] += node_silent(512) + 1
    assert [k for k, s in nodes.items() if s.aggregates()] == [0, 1, 2, 3]


def test_the_start_up_bound_holds_only_while_no_rank_has_trained() -> None:
    # A node powered off before its summary said "training" (seen on OpenPBS): the others train,
    # and its last word, "start-up", must not hold the job to the 15-minute start-up bound.
    assert segment_phase({"start-up"}) == "start-up"
    assert segment_phase({"start-up", "training"}) == "training"
    assert segment_phase({"training", "saving", "start-up"}) == "saving"
