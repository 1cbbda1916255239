"""The prepared store on a network file system whose locks hold only within one node's mount
(tests/cluster/shared_fs.py): two nodes prepare at once without deleting each other's work, one
job tokenizes once, a user of the group shares the cache."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import yaml

from jobgen.job.models import Training
from jobgen.train.store import COMPLETE, ensure_store
from jobgen.train.modeling import load_tokenizer
from tests.helpers import free_port
from tests.train.conftest import subprocess_env


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return load_tokenizer(str(tiny / "model"))


def test_a_lock_through_one_mount_does_not_stop_a_lock_through_the_other(shared_fs):
    """What the rest relies on: the file system gives no lock that spans nodes."""
    node_a, node_b = shared_fs.mounts
    (node_a / "KEY.lock").write_text("")
    with open(node_a / "KEY.lock", "r+") as held:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(node_b / "KEY.lock", "r+") as other:
            fcntl.lockf(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError: both "hold" it
    # Within one mount the lock does hold, as on one node.
    with open(node_a / "KEY.lock", "r+") as held, open(node_a / "KEY.lock", "r+") as same_node:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        probe = subprocess.run([sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'r+'); "
                                "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)", str(node_a / "KEY.lock")],
                               capture_output=True, text=True)
        assert probe.returncode != 0 and "BlockingIOError" in probe.stderr


@pytest.fixture(scope="module")
def big_data(tmp_path_factory):
    """Enough conversations that a preparation takes a few seconds, so that two overlap."""
    from jobgen.train.tiny import synthetic_conversations

    path = tmp_path_factory.mktemp("big") / "data.json"
    path.write_text(json.dumps(synthetic_conversations(12_000, seed=1)))
    return path


def _write_prepare_job(folder, tiny, data) -> None:
    (folder / "job.yaml").write_text(yaml.safe_dump({
        "name": "prep", "resources": {"nodes": 2, "gpus_per_node": 0}, "launch": {"procs_per_node": 2},
        "training": {"model": str(tiny / "model"), "data": str(data), "max_length": 256, "prepared_cache": "stores"},
    }))


def _prepare_command(folder) -> list[str]:
    return [sys.executable, "-m", "jobgen.cli", "prepare", str(folder / "job.yaml"), "--site", "none"]


def test_two_nodes_preparing_at_once_keep_each_others_work(shared_fs, tiny, tokenizer, big_data):
    """`jobgen prepare` on two nodes at once, each through its own mount: both locks are granted,
    and neither may take the other's temporary folder for a killed preparation's leftover."""
    node_a, node_b = shared_fs.mounts
    (shared_fs.served / "job").mkdir()
    # Written once, on the file server: a node writing it while the other read it through its own
    # mount gave that one an empty job file (CI, under load).
    _write_prepare_job(shared_fs.served / "job", tiny, big_data)
    procs = [subprocess.Popen(_prepare_command(mount / "job"), cwd=mount / "job", env=subprocess_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for mount in (node_a, node_b)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    for mount, output in zip((node_a, node_b), outputs):
        print(f"--- jobgen prepare through {mount}:\n{output}")  # whole, where a failure shows it
    assert [proc.returncode for proc in procs] == [0, 0]
    assert not any("Traceback" in out for out in outputs), outputs
    stores = shared_fs.served / "job" / "stores"
    folders = [p.name for p in stores.iterdir() if p.is_dir()]
    assert len(folders) == 1 and (stores / folders[0] / COMPLETE).exists(), folders  # no temporary folder left
    for mount in (node_a, node_b):
        training = Training(model=str(tiny / "model"), data=str(big_data), max_length=256,
                            prepared_cache=str(mount / "job" / "stores"))
        stored, outcome = ensure_store(training, str(mount / "job"), lambda: tokenizer, preparer=False)
        assert outcome in ("found", "waited") and len(stored) == 12_000


def _node(job, node_rank: int, port: int) -> subprocess.Popen:
    """One node of a two-node job: a torchrun agent reading the run directory through its own mount."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
        "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
        "-m", "jobgen.train", "--job", str(job),
    ]
    return subprocess.Popen(command, cwd=job.parent, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_a_job_on_two_nodes_tokenizes_once(shared_fs, tools, tiny, big_data):
    """Local rank 0 of each node would be a preparer, each believing it holds KEY.lock: the
    temporary folders the file server sees count the builds."""
    served = shared_fs.served / "run"
    tools.write_job(served, tiny, procs=1, data=str(big_data), max_steps=1, save_interval=100)
    port = free_port()
    nodes = [_node(mount / "run" / "job.yaml", rank, port) for rank, mount in enumerate(shared_fs.mounts)]
    builds: set[str] = set()
    try:
        while any(node.poll() is None for node in nodes):
            if (served / "prepared").is_dir():  # the server's own view: no cache between
                builds |= {p.name for p in (served / "prepared").iterdir() if p.name.startswith(".tmp-")}
            time.sleep(0.02)
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert len(builds) == 1, builds
    assert "prepared here" in outputs[0] and "tokenized 12000/12000 records" in outputs[0]


def test_a_store_finished_while_another_node_caches_it_as_absent_is_not_built_again(shared_fs, tiny, tokenizer):
    """Node B has looked for the store and caches "no such file"; node A prepares it; node B,
    within its cache's time, finds it and neither builds it again nor fails."""
    node_a, node_b = shared_fs.mounts
    from jobgen.train.store import inputs_for, store_key

    def training(mount):
        return Training(model=str(tiny / "model"), data=str(tiny / "data.json"), max_length=128,
                        prepared_cache=str(mount / "stores"))

    (shared_fs.served / "stores").mkdir()
    key = store_key(inputs_for(training(node_b), str(node_b / "stores")))
    assert not (node_b / "stores" / key).exists()  # node B's mount now remembers that
    made, outcome = ensure_store(training(node_a), str(node_a), lambda: tokenizer, preparer=True, processes=1)
    assert outcome == "prepared" and not (node_b / "stores" / key).exists()  # still cached as absent
    built: list[str] = []
    stored, outcome = ensure_store(training(node_b), str(node_b), lambda: built.append("tokenizer") or tokenizer,
                                   preparer=True, processes=1)
    assert built == [] and outcome == "waited" and len(stored) == len(made)
    assert sorted(p.name for p in (shared_fs.served / "stores").iterdir() if p.is_dir()) == [key]


def test_a_rename_onto_the_empty_folder_of_another_nodes_look_is_tried_again(shared_fs):
    """A preparer asks the file server whether the store is there by making the folder itself for
    a moment (store._exists_on_server: an exclusive mkdir decides on the server, where a stat may
    answer from a cache). A build finishing meanwhile on another node, whose rename meets that
    empty folder (EPERM through sftp), must neither fail nor take it for another's store: it
    tries again, and its store is in place."""
    from jobgen.train.store import _build_under_lock, _exists_on_server

    node_a, node_b = shared_fs.mounts
    (shared_fs.served / "looks").mkdir()
    keys = [f"KEY{n}" for n in range(5)]  # a few races, so that one meets a look almost surely

    def build(temp: str) -> None:
        os.mkdir(temp)
        with open(os.path.join(temp, COMPLETE), "w") as marker:
            marker.write("done\n")

    placed = []
    for key in keys:
        stop, looks = threading.Event(), [0]

        def look_from_node_a(key: str = key) -> None:
            while not stop.is_set():
                _exists_on_server(str(node_a / "looks" / key))
                looks[0] += 1

        looking = threading.Thread(target=look_from_node_a)
        looking.start()
        try:
            # Looking already, however slow the machine (a sleep of 0.1 s saw 5 looks in all on
            # a loaded one), so that the build below meets them.
            deadline = time.monotonic() + 30
            while looks[0] < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            placed.append(_build_under_lock(str(node_b / "looks" / key), build, str(node_b / "looks" / f"{key}.failed")))
        finally:
            stop.set()
            looking.join()
        assert looks[0] > 5  # the looks went on throughout: one at least after the build began
    assert placed == [True] * len(keys)
    assert all((shared_fs.served / "looks" / key / COMPLETE).exists() for key in keys)
    assert sorted(p.name for p in (shared_fs.served / "looks").iterdir()) == keys  # no temporary folder left
