"""jobgen's Torque jobs on a Torque complex whose nodes are separate hosts
(tests/cluster/torque_hosts.py): the job submitted on the server host, its nodes two other hosts
whose own name is 127.0.1.1 on themselves, each with a first interface that routes nowhere, the
run folder on a network file system that each host mounts on its own, and pbsdsh (through the
MoMs, with the tasks' bare environment) starting every node."""

from __future__ import annotations

import json
import time

import yaml

from tests.cluster.hosts import REAL_INTERFACE
from tests.test_pbs_scripts import probe_job


def test_jobgen_torque_ranks_on_separate_hosts_meet_at_the_mother_superiors_address(torque_on_hosts) -> None:
    cluster = torque_on_hosts
    job = {**probe_job(2, 2), "name": "probe"}
    job["environment"] = {**job["environment"], "setup": [f"source {cluster.venv}/bin/activate"]}
    folder = cluster.served / "probe"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    submitted = cluster.as_user(["jobgen", "submit", "-s", "torque", "job.yaml"], cwd=cluster.shared / "probe")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    job_id = submitted.stdout.split()[-1]
    run_dir = folder / "runs" / "probe"
    deadline = time.monotonic() + 240
    while "job_state = C" not in cluster.run("host1", ["qstat", "-f", job_id]).stdout:
        if time.monotonic() > deadline:
            logs = "".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").rglob("*")) if p.is_file())
            raise AssertionError(f"Torque job {job_id} not complete after 240 s:\n{logs}")
        time.sleep(1)
    records = [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank-*.json"))]
    assert len(records) == 4, sorted(p.name for p in run_dir.rglob("*"))
    first = records[0]["hostname"]  # the mother superior: node 0, the rendezvous
    second = ({"host2", "host3"} - {first}).pop()
    assert [(r["RANK"], r["NODE_RANK"], r["hostname"], r["MASTER_ADDR"], r["GLOO_SOCKET_IFNAME"], r["all_reduce_sum"])
            for r in records] == [("0", "0", first, first, REAL_INTERFACE, 10), ("1", "0", first, first, REAL_INTERFACE, 10),
                                  ("2", "1", second, first, REAL_INTERFACE, 10), ("3", "1", second, first, REAL_INTERFACE, 10)]
    # On node 0 its own name is Debian's 127.0.1.1; the other node reaches it at its own address.
    own = cluster.run(first, ["getent", "hosts", first]).stdout.split()[0]
    seen = cluster.run(second, ["getent", "hosts", first]).stdout.split()[0]
    assert own == "127.0.1.1" and seen == next(h.address for h in cluster.hosts if h.name == first)
