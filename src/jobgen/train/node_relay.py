"""How a node's ranks wait for a data store together: one asks the shared file system, the node's
other ranks ask it.

While rank 0 prepares a store, every other rank waits for it (jobgen.train.store.prepare_once).
Were each to poll the shared folder, a node of 8 ranks would put 8 times one rank's load on the
file system's metadata server, for nothing the node's first rank does not learn alone. So the
node's local rank 0 (the leader) polls the shared folder as before and writes how the wait ended
into a file of the node's own temporary folder: "ok", or "failed" and the preparer's one-line
error. The node's other ranks (followers) read that file, on the node's local disk or memory.

The file lies in the node's folder for this segment that jobgen-torchrun makes and removes when
it ends (NODE_TMP_ENV), so nothing is left in a shared /tmp; under another launcher, in the
temporary folder. Its name holds the user, the job segment, the node and the store, so nodes that
share one temporary folder (a test's, or a site's shared /tmp), earlier segments and other jobs
never read each other's. It is written whole (a rename), and is a few bytes.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from typing import Callable, Optional

from jobgen.errors import UserError

OK = "ok"
FAILED = "failed"
NODE_TMP_ENV = "JOBGEN_NODE_TMP"  # this node's folder for this segment, made and removed by jobgen-torchrun


class NodeRelay:
    def __init__(self, path: str, leader: bool) -> None:
        self.path, self.leader = path, leader

    @classmethod
    def for_target(cls, target: str) -> Optional["NodeRelay"]:
        """The relay of this rank's node for `target`, inside a job started by torchrun (which
        sets LOCAL_RANK and GROUP_RANK); None elsewhere, where the process waits on its own."""
        job_id, local_rank, node = (os.environ.get(name) for name in ("JOBGEN_JOB_ID", "LOCAL_RANK", "GROUP_RANK"))
        if not job_id or local_rank is None or node is None:
            return None
        segment = f"{job_id}/{os.environ.get('JOBGEN_RESTART_COUNT', '0')}/{node}"
        digest = hashlib.sha256(f"{segment}\0{os.path.abspath(target)}".encode()).hexdigest()[:24]
        folder = os.environ.get(NODE_TMP_ENV) or tempfile.gettempdir()
        return cls(os.path.join(folder, f"jobgen-{os.getuid()}-store-wait-{digest}"), local_rank == "0")

    def publish(self, outcome: str, message: str = "") -> None:
        """The leader: how its wait ended, for the node's followers."""
        temp = f"{self.path}.{os.getpid()}.tmp"
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(f"{outcome}\n{message}")
        os.replace(temp, self.path)

    def wait(self, interval: Callable[[float], float], waiting: Optional[Callable[[float], None]] = None) -> None:
        """A follower: until the leader has published; raises the preparer's error as UserError.
        `interval(waited)` paces the looks, `waiting(waited)` is told once a minute."""
        since, said = time.monotonic(), 0.0
        while True:
            try:
                with open(self.path, encoding="utf-8") as handle:
                    outcome, _, message = handle.read().partition("\n")
            except FileNotFoundError:
                outcome = message = ""
            if outcome == OK:
                return
            if outcome == FAILED:
                raise UserError(message)
            waited = time.monotonic() - since
            if waiting and waited - said >= 60:
                said = waited
                waiting(waited)
            time.sleep(interval(waited))
