"""Progress reports from the ranks, and the node's hang supervisor that reads them.

Ranks: each writes its step and phase ("start-up", "training", "saving") to a small file in a
node-local folder (JOBGEN_HEARTBEAT_DIR, in /dev/shm where there is one; set by jobgen-torchrun)
at every step, and to mark that it has computed a step and waits in the step's collective. No
collective is involved. A thread touches a second file every second: a rank that is stopped
(SIGSTOP, a frozen node) or stuck holding the interpreter stops touching it, while a rank that only
waits in a collective for others keeps touching it. That tells who stopped first.

Supervisor (one per node, in jobgen-torchrun): every second it reads its ranks' files (node-local)
and every PUBLISH_EVERY seconds publishes a summary to RUN_DIR/heartbeat/node-K.json on the shared
file system, and at once when a rank stops or ends and when its ranks stall or move on after a
stall (so a reader knows who stopped first within the quick bound). Only the supervisors of nodes
0 and 1 (AGGREGATORS) read every node's summary, every `read_every(nnodes)` seconds; the others
look for RUN_DIR/hang.json every FOLLOW_EVERY seconds, so the shared folder sees a number of
operations per second that grows with the nodes, not with their square
(benchmarks/control_plane.py counts them). When its own ranks (a step is a collective: they
stop when any rank does) and the others' phases have not changed for longer than the bound
(`hang_bound`), an aggregating supervisor writes RUN_DIR/hang.json (the first to
decide does), every supervisor dumps its local ranks' Python stacks into their rank logs (py-spy
where installed, else faulthandler on SIGQUIT), holds them (SIGSTOP), says so in its summary, and
kills them once every node has said so (`stacks_taken`), or at the latest `kill_after(nnodes)`
seconds after asking for them, once every other node can have found hang.json and taken its own.
jobgen-torchrun then exits with EXIT_HUNG; the batch script requeues. `detection_delay` says how
late that can be at N nodes.

No clock is compared with another node's: a node is silent when its summary's sequence number
has not changed for `node_silent(nnodes)` seconds of the reader's own monotonic clock. The
wall-clock time in a summary is for people.

Before its node's ranks write their first file (their imports, the model's load), a supervisor
has no summary to publish; it rewrites RUN_DIR/heartbeat/node-K.starting every PUBLISH_EVERY
seconds instead, from its start. Only the batch script of a job with spares reads it: a node the
scheduler shows down (wrongly: a MoM that missed its reports) whose supervisor still writes is not
taken for gone in its start-up. The supervisors' own readers go by the summaries alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from jobgen.rundir.files import HANG, HEARTBEATS, rank_log
from jobgen.train.reachability import Listener, Prober, probe_address

log = logging.getLogger("jobgen.train")

HEARTBEAT_DIR_ENV = "JOBGEN_HEARTBEAT_DIR"
HANG_SECONDS_ENV = "JOBGEN_HANG_SECONDS"
STACK_SIGNAL = signal.SIGQUIT
ALIVE_EVERY = 1.0
ALIVE_STALE = 10.0  # a rank whose alive file is older than this is stopped or stuck
PUBLISH_EVERY = 10.0  # a node's summary (not fsynced: a crash loses only a heartbeat)
FOLLOW_EVERY = 5.0  # a node that reads no summaries looks for hang.json this often
AGGREGATORS = 2  # nodes 0 and 1 read every summary: one frozen reader does not blind the job
NODE_SILENT = 30.0  # at least: a node whose summary has not changed this long is frozen or gone, its supervisor with it
STACK_SECONDS = 2.0  # for a signalled rank to write its stack
UNREACHABLE_PROBES = 2  # failed in a row (reachability.PROBE_EVERY apart): a node that does not answer on the network


def read_every(nnodes: int) -> float:
    """Seconds between an aggregating supervisor's reads of every summary: 3, longer past 1,200
    nodes, so that one reader opens at most 400 files a second."""
    return max(3.0, nnodes / 400)


def node_silent(nnodes: int) -> float:
    """Seconds, by the reader's clock, without a new summary after which a node is silent: twice
    the longest a healthy node's new summary can take to be seen."""
    return max(NODE_SILENT, 2 * (PUBLISH_EVERY + read_every(nnodes)))


def kill_after(nnodes: int) -> float:
    """Seconds from a supervisor's asking its ranks for their stacks to its killing them. One node
    waits for its ranks to write them. With others, until the last node to find hang.json (a
    follow interval and a loop's second later) has had its ranks write theirs: a rank killed here
    fails theirs in their collective at once under gloo, and their stacks would be lost. Up to
    AGGREGATORS nodes every node reads at the read interval, not the follow interval. Most ends
    are sooner: each node says in its summary when it has taken its stacks (`stacks_taken`)."""
    if nnodes == 1:
        return STACK_SECONDS
    follow = read_every(nnodes) if nnodes <= AGGREGATORS else max(FOLLOW_EVERY, read_every(nnodes))
    return follow + 1.0 + 2 * STACK_SECONDS


def detection_delay(nnodes: int) -> float:
    """The most seconds, beyond the bound, from a hang to every node knowing it: a deciding
    node's ranks read a second late, the others' summaries read late, and hang.json found late."""
    return 1.0 + read_every(nnodes) + FOLLOW_EVERY + 1.0

# The bound: with nothing else known, a step that takes this long is a hang.
FLOOR_SECONDS = 60.0  # before the pauses are known, in evaluation, and while a node has not reported
QUICK_FLOOR_SECONDS = 10.0  # in steady training, every node having reported its ranks still
WARM_PAUSES = 5  # pauses measured in training (a step each, or a second each of micro-batches) before the quick floor
STEP_FACTOR = 5.0  # times the longest of the recent pauses
STARTUP_SECONDS = 900.0  # start-up (imports, model load, first step): within the default 30 min timeout
SAVE_SECONDS = 300.0
SAVE_FACTOR = 3.0  # times the slowest save seen
REPORT_SECONDS = 120.0  # rank 0 writing metrics and calling the trackers (a slow MLflow server)
STILL_SECONDS = 2.0  # at least: a node whose ranks have not moved this long reports it at once
MICRO_EVERY = 0.25  # a rank's progress inside a step is written at most this often


def still_seconds(pauses: list[float]) -> float:
    """Seconds without a change in a node's ranks after which it publishes its summary at once,
    marked stalled: twice a usual pause, so that steady training adds no publishes."""
    recent = sorted(pauses[-20:])
    return max(STILL_SECONDS, 2 * recent[len(recent) // 2]) if recent else STILL_SECONDS


def install_stack_dump() -> None:
    """In a rank: on SIGQUIT, every thread's Python stack goes to stderr (the rank's log)."""
    import faulthandler

    try:
        faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError):
        pass


class Heartbeat:
    """A rank's progress file; does nothing outside jobgen-torchrun (no JOBGEN_HEARTBEAT_DIR)."""

    def __init__(self, rank: int, node: str) -> None:
        self.dir = os.environ.get(HEARTBEAT_DIR_ENV)
        self.rank, self.node = rank, node
        self.state: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "node": node, "step": 0, "phase": "start-up",
                                      "waiting": False}
        if self.dir:
            self._alive = os.path.join(self.dir, f"rank{rank}.alive")
            self._write()
            threading.Thread(target=self._touch, name="jobgen-heartbeat", daemon=True).start()

    def beat(self, step: int, phase: str, waiting: bool = False, writing: bool = False) -> None:
        """`writing`: a checkpoint is being written in the background (training.async_save), which
        may slow the steps down; their bound keeps its floor meanwhile."""
        if self.dir:
            self.state.update(step=step, phase=phase, waiting=waiting, writing=writing, micro=0)
            self._write()

    def micro(self, done: int) -> None:
        """Micro-batches done in the step: progress within a long step, so that the bound follows
        the longest pause between them, not the step's time. At most every MICRO_EVERY seconds."""
        if self.dir and time.monotonic() - self.state.get("at", 0.0) >= MICRO_EVERY:
            self.state["micro"] = done
            self._write()

    def progress(self, done: int) -> None:
        """Work done in a long phase without steps (preparing the data): the supervisor sees it move."""
        if self.dir:
            self.state["progress"] = done
            self._write()

    def _write(self) -> None:
        # When, by the node's monotonic clock (the supervisor's too): the pauses it measures are exact.
        self.state["at"] = time.monotonic()
        path = os.path.join(self.dir, f"rank{self.rank}.json")
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(self.state, handle)
            os.replace(tmp, path)
        except OSError:
            pass

    def _touch(self) -> None:
        while True:
            try:
                with open(self._alive, "a"):
                    os.utime(self._alive)
            except OSError:
                pass
            time.sleep(ALIVE_EVERY)


# ------------------------------------------------------------ the bound
def hang_bound(pauses: list[float], phase: str, override: Optional[float] = None,
               save_seconds: Optional[list[float]] = None) -> float:
    """Seconds without a change in any rank's step or phase after which the job is hung.

    Training: `requeue.hang_seconds` when set, else STEP_FACTOR times the longest of the last 20
    pauses in training (seconds between two changes in a node's ranks: steps, micro-batches, the
    wait in a step's collective), at least QUICK_FLOOR_SECONDS once WARM_PAUSES pauses are known
    and FLOOR_SECONDS before. Start-up (before the segment's first step): at least STARTUP_SECONDS,
    whatever is set (imports and a model load can take minutes). Saving: at least SAVE_FACTOR
    times the slowest save seen, and SAVE_SECONDS unless `requeue.hang_seconds` says otherwise
    (whoever sets it knows their saves). Evaluating, writing (a checkpoint written in the
    background) and reporting (rank 0's metrics and trackers) have their own floors,
    FLOOR_SECONDS, FLOOR_SECONDS and REPORT_SECONDS, unless it is set.

    The supervisor holds the quick floor to FLOOR_SECONDS while a node has not reported its ranks
    still (`Supervisor.everyone_reported`): a node powered off or cut off says nothing, and is named
    only once it is silent."""
    recent = pauses[-20:]
    floor = QUICK_FLOOR_SECONDS if len(pauses) >= WARM_PAUSES else FLOOR_SECONDS
    training = override if override else max(floor, STEP_FACTOR * max(recent, default=0.0))
    if phase == "start-up":
        return max(training, STARTUP_SECONDS)
    if phase == "saving":
        return max(training, 0.0 if override else SAVE_SECONDS, SAVE_FACTOR * max(save_seconds or [0.0]))
    if phase in ("evaluating", "writing", "reporting") and not override:
        return max(training, REPORT_SECONDS if phase == "reporting" else FLOOR_SECONDS)
    return training


def segment_phase(phases: set[str]) -> str:
    """The phase whose bound applies, from every rank's as last read (`rank_phases`): saving if
    any saves, then evaluating ("evaluating 3": its round), reporting and writing (training with
    a checkpoint written in the background); start-up only while no rank has trained. A first
    step is a collective of all ranks, so one rank training means every rank started; a node that
    still says "start-up" said so in a summary published before its first step, and a node lost
    just then would otherwise hold the job to the start-up bound (15 min) while the others wait
    on it."""
    for phase in ("saving", "evaluating", "reporting", "writing"):
        if any(p.split(" ")[0] == phase for p in phases):
            return phase
    return "start-up" if phases <= {"start-up"} else "training"


def rank_phases(ranks: list[dict[str, Any]]) -> set[str]:
    """The ranks' phases, and "writing" where a rank writes a checkpoint in the background."""
    return {r["phase"] for r in ranks} | ({"writing"} if any(r.get("writing") for r in ranks) else set())


def stopped_first(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks that stopped first: those not alive (stopped, gone, stuck) when some are; else
    those furthest behind (lowest step; computed but not yet waiting in the collective counts as
    behind one that waits); all of them when nothing tells them apart."""
    frozen = [r for r in ranks if not r.get("alive", True)]
    if frozen and len(frozen) < len(ranks):
        return frozen
    pool = frozen or ranks
    key = [(r.get("step", 0), bool(r.get("waiting"))) for r in pool]
    low = min(key, default=None)
    behind = [r for r, k in zip(pool, key) if k == low]
    return behind if len(behind) < len(pool) else pool


def describe_hang(seconds: float, bound: float, step: int, culprits: list[dict[str, Any]], world: int) -> str:
    """One line: "no step for 63 s (bound 60 s) after step 5; stopped first: node node2 (ranks 2, 3: stopped)"."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for rank in culprits:
        by_node.setdefault(rank.get("node", "?"), []).append(rank)
    parts = []
    for node, ranks in sorted(by_node.items()):
        states = sorted({r.get("state", "waiting") for r in ranks})
        numbers = ", ".join(str(r["rank"]) for r in sorted(ranks, key=lambda r: r["rank"]))
        parts.append(f"node {node} (rank{'s' if len(ranks) > 1 else ''} {numbers}: {'/'.join(states)})")
    who = "; ".join(parts) if len(culprits) < world else "every rank alike (" + "; ".join(parts) + ")"
    return f"no progress for {seconds:.0f} s (bound {bound:.0f} s) after step {step}; stopped first: {who}"


def describe_unreachable(seconds: float, step: int, ranks: list[dict[str, Any]]) -> str:
    """One line: "node cn002 (rank 1) does not answer on the network (powered off, or cut off); no progress for 11 s after step 9"."""
    nodes = sorted({r.get("node", "?") for r in ranks})
    numbers = ", ".join(str(r["rank"]) for r in sorted(ranks, key=lambda r: r["rank"]))
    who = f"node{'s' if len(nodes) > 1 else ''} {' '.join(nodes)} (rank{'s' if len(ranks) > 1 else ''} {numbers})"
    return (f"{who} {'do' if len(nodes) > 1 else 'does'} not answer on the network (powered off, or cut off); "
            f"no progress for {seconds:.0f} s after step {step}")


# ------------------------------------------------------------ supervisor
def process_state(pid: int) -> Optional[str]:
    """'R', 'S', 'T' (stopped), ... from /proc; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return None if state in ("Z", "X") else state
    except (OSError, IndexError):
        return None


@dataclass
class Supervisor:
    run_dir: str
    job_id: str
    restart: str
    node_rank: int
    nnodes: int
    override: Optional[float]
    local_dir: str = ""
    hung: Optional[dict] = None
    clock: Optional[Callable[[], float]] = None  # the reader's own clock; time.monotonic unless a test says
    _stop: threading.Event = field(default_factory=threading.Event)
    # node rank -> (the last sequence number seen in its summary, when it was first seen by `clock`)
    _seen: dict = field(default_factory=dict)
    _last_read: dict = field(default_factory=dict)  # node -> its summary as last read
    _seq: int = 0
    bound: Optional[float] = None  # the bound this node last applied (an aggregating one), for people
    longest_pause: Optional[float] = None  # of its ranks' recent pauses in training, for people
    listener: Optional[Listener] = None  # answers the other nodes' probes (reachability.py)
    prober: Optional[Prober] = None
    _asked_seq: dict = field(default_factory=dict)  # node rank -> (its sequence number, its failed probes when first seen)
    # After a hang: this node has taken its ranks' stacks; as an aggregator, has seen every node do so.
    _stacks_taken: bool = False
    _all_stacks_taken: bool = False

    @classmethod
    def from_env(cls) -> Optional["Supervisor"]:
        run_dir, job_id = os.environ.get("JOBGEN_RUN_DIR"), os.environ.get("JOBGEN_JOB_ID")
        if not run_dir or not job_id or not os.path.isdir(run_dir):
            return None
        raw = os.environ.get(HANG_SECONDS_ENV, "").strip()
        if raw == "off":
            return None
        override = float(raw) if raw.replace(".", "", 1).isdigit() else None
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        supervisor = cls(run_dir, job_id, os.environ.get("JOBGEN_RESTART_COUNT", "0"),
                         int(os.environ.get("NODE_RANK", "0") or 0), int(os.environ.get("NNODES", "1") or 1), override)
        supervisor.local_dir = tempfile.mkdtemp(prefix=f"jobgen-heartbeat-{job_id}-", dir=base)
        os.environ[HEARTBEAT_DIR_ENV] = supervisor.local_dir
        return supervisor

    @property
    def shared_dir(self) -> str:
        return os.path.join(self.run_dir, HEARTBEATS)

    def start(self) -> "Supervisor":
        if self.nnodes > 1 and os.environ.get("MASTER_ADDR"):
            self.listener = Listener.toward(os.environ["MASTER_ADDR"], os.environ.get("JOBGEN_NODES", "").split())
            self.prober = Prober(self.now)
        threading.Thread(target=self._run, name="jobgen-hang-supervisor", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()
        for part in (self.listener, self.prober):
            if part is not None:
                part.close()
        shutil.rmtree(self.local_dir, ignore_errors=True)

    # -- reading
    def local_ranks(self) -> list[dict[str, Any]]:
        ranks = []
        now = time.time()
        for name in sorted(os.listdir(self.local_dir)):
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(self.local_dir, name), encoding="utf-8") as handle:
                    rank = json.load(handle)
                alive_at = os.path.getmtime(os.path.join(self.local_dir, name[:-5] + ".alive"))
            except (OSError, ValueError):
                continue
            state = process_state(rank["pid"])
            rank["alive_age"] = round(now - alive_at, 1)
            rank["state"] = {None: "gone", "T": "stopped", "t": "stopped"}.get(state, "stuck" if rank["alive_age"] > ALIVE_STALE else "waiting")
            rank["alive"] = rank["state"] == "waiting"
            ranks.append(rank)
        return ranks

    def now(self) -> float:
        return (self.clock or time.monotonic)()

    def publish(self, ranks: list[dict[str, Any]], stalled: bool = False) -> None:
        """`stalled`: this node's ranks have not moved for `still_seconds`, so an aggregating
        reader may decide on the quick bound (`everyone_reported`)."""
        self._write_shared("json", stalled=stalled, bound=self.bound, longest_pause=self.longest_pause, ranks=ranks,
                           probe=list(self.listener.address) if self.listener else None,
                           stacks_taken=self._stacks_taken, all_stacks_taken=self._all_stacks_taken)

    def say_starting(self) -> None:
        """node-K.starting: this node lives, its ranks not yet started (the module's docstring)."""
        self._write_shared("starting")

    def _write_shared(self, suffix: str, **fields: Any) -> None:
        """RUN_DIR/heartbeat/node-K.SUFFIX, replaced whole, numbered: the number is what readers time,
        "at" is for people (the nodes' clocks differ)."""
        from jobgen.files import replace_atomically

        self._seq += 1
        record = {"job_id": self.job_id, "restart": self.restart, "node_rank": self.node_rank, "seq": self._seq,
                  "at": time.time(), **fields}
        try:
            replace_atomically(os.path.join(self.shared_dir, f"node-{self.node_rank}.{suffix}"), json.dumps(record))
        except OSError:
            pass  # a full or flaky file system: the next write tries again

    def node_summary(self, k: int) -> Optional[dict[str, Any]]:
        """Node K's summary of this segment, its ranks marked "silent node" when its sequence
        number has not changed for `node_silent` seconds of this reader's clock; None if none.

        A read that fails (a network file system may answer ESTALE or "no such file" while the
        summary is replaced) gives the summary last read: a node that went missing from one read
        and came back would count as progress, and put the hang's detection off while it recurs.
        A summary unreadable for long keeps its old sequence number, so its node turns silent."""
        try:
            with open(os.path.join(self.shared_dir, f"node-{k}.json"), encoding="utf-8") as handle:
                node = json.load(handle)
        except (OSError, ValueError):
            node = self._last_read.get(k)
            if node is None:
                return None
            node = dict(node)
        if node.get("job_id") != self.job_id or str(node.get("restart")) != self.restart:
            return None
        self._last_read[k] = dict(node)
        now, seq = self.now(), node.get("seq", node.get("at"))
        last = self._seen.get(k)
        if last is None or last[0] != seq:
            self._seen[k] = last = (seq, now)
        if now - last[1] > node_silent(self.nnodes):  # its supervisor too is stopped, or the node is gone
            node["ranks"] = [dict(rank, alive=False, state="silent node") for rank in node["ranks"]]
        return node

    def everyone_reported(self) -> bool:
        """Whether every other node's summary, as last read, says its ranks are still or not all
        alive. A node publishes at once when its ranks stall and again when they move on, so such
        a summary is what its ranks are doing now, and who stopped first can be told without
        waiting for a node to turn silent. A node that has said nothing of the kind (powered off,
        cut off, frozen whole) holds the bound until it is silent."""
        return not self.unreported()

    def unreported(self) -> list[int]:
        """The other nodes whose summary, as last read, says neither that their ranks are still
        nor that some are not alive (`everyone_reported`)."""
        silent = []
        for k in range(self.nnodes):
            if k == self.node_rank:
                continue
            node = self._last_read.get(k)
            if node is None or not (node.get("stalled") or not all(rank.get("alive", True) for rank in node["ranks"])):
                silent.append(k)
        return silent

    def unreachable(self, asking: bool) -> list[int]:
        """The nodes that do not answer on the network (powered off, or cut off) while the job
        waits. Asked only while `asking` (the job still for longer than its usual pause: a job
        that trains probes nothing but each node once), of every other node, whatever its last
        summary said (a node that reported its ranks still may have gone down since). A node
        counts once it has failed UNREACHABLE_PROBES probes in a row since its last new summary was
        seen (or since it was first asked about)."""
        if self.prober is None:
            return []
        known = {}
        for k in range(self.nnodes):
            address = probe_address(self._last_read.get(k) or {}) if k != self.node_rank else None
            if address:
                known[k] = address
        self.prober.learn(known)  # does each answer at all (`Prober`)
        asked = known if asking else {}
        self.prober.ask(asked)
        # Each node's summary as last seen, with its failed probes then: a summary seen since is an
        # answer, and the count starts again from it. Not for good: the summary a node published
        # just before it went down may be read a read interval later, after its probes began to fail.
        counts, lost = {}, []
        for k in asked:
            failed = self.prober.unreachable(k)
            count, seq = failed[1] if failed else 0, self._seen.get(k, (None,))[0]
            seen_seq, before = self._asked_seq.get(k, (seq, 0))
            if seen_seq != seq or count < before:  # a new summary, or a probe answered since
                before = count
            counts[k] = (seq, before)
            if count - before >= UNREACHABLE_PROBES:
                lost.append(k)
        self._asked_seq = counts
        return lost

    def all_ranks(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ranks = list(mine)
        for k in range(self.nnodes):
            node = self.node_summary(k) if k != self.node_rank else None
            if node:
                ranks += node["ranks"]
        return ranks

    def aggregates(self) -> bool:
        """Whether this node reads every summary: nodes 0 and 1 do; nodes 2 and 3 stand by, and
        take over when both of those are silent."""
        if self.node_rank < AGGREGATORS:
            return True
        if self.node_rank >= 2 * AGGREGATORS:
            return False
        readers = [self.node_summary(k) for k in range(min(AGGREGATORS, self.nnodes))]
        return all(node is not None and node["ranks"] and node["ranks"][0]["state"] == "silent node" for node in readers)

    def decided(self) -> Optional[dict]:
        try:
            with open(os.path.join(self.run_dir, HANG), encoding="utf-8") as handle:
                found = json.load(handle)
        except (OSError, ValueError):
            return None
        return found if found.get("job_id") == self.job_id and str(found.get("restart")) == self.restart else None

    # -- the loop
    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # noqa: BLE001 - the supervisor must never take the node down
            log.warning("jobgen hang supervisor stopped: %s", exc)

    def _watch(self) -> None:
        os.makedirs(self.shared_dir, exist_ok=True)
        last_key, last_change, changed = None, None, []
        still_key, still_since = None, 0.0  # this node's ranks: since when they have not moved
        moved_at, pause_phases = None, set()  # their last change by their own clock, the phases since
        pauses: list[float] = []  # seconds between two changes in training: what the bound follows
        save_seconds: list[float] = []
        saving_since = None
        published = followed = read = -float("inf")
        published_states, published_still = None, False
        aggregating, others = self.node_rank < AGGREGATORS, []
        starting_said = -float("inf")
        while not self._stop.wait(1.0):
            mine = self.local_ranks()
            now = self.now()
            if not mine:
                if now - starting_said >= PUBLISH_EVERY:
                    self.say_starting()
                    starting_said = now
                continue
            local = tuple(sorted((r["rank"], r["step"], r["phase"], r["waiting"], r.get("progress"), r.get("micro"))
                                 for r in mine))
            pause_phases.add(segment_phase(rank_phases(mine)))
            if local != still_key:
                still_key, still_since = local, now
                # The ranks' own times of their last change: exact, where reads are a second apart.
                at = max(r.get("at", now) for r in mine)
                if moved_at is not None and pause_phases <= {"training"}:
                    pauses.append(at - moved_at)
                    del pauses[:-20]  # the bound follows the last 20
                    self.longest_pause = round(max(pauses), 2)
                moved_at, pause_phases = at, set()
            step = max(r["step"] for r in mine)
            # Only where a short bound can apply: a start-up's pauses publish nothing extra.
            stalled = ((bool(self.override) or len(pauses) >= WARM_PAUSES)
                       and now - still_since >= still_seconds(pauses))
            states = tuple(r["state"] for r in mine)
            # Every PUBLISH_EVERY seconds, and at once when a rank stops, dies or freezes, when the
            # ranks have been still for longer than a usual step and when they move on after it:
            # a reader can tell who stopped first within the quick bound. Steady training
            # publishes no more than before.
            if now - published >= PUBLISH_EVERY or states != published_states or stalled != published_still:
                self.publish(mine, stalled)
                published, published_states, published_still = now, states, stalled
            if any(r["state"] == "gone" for r in mine):
                # A rank ended: torchrun takes it from here. If the job was found hung, another
                # node may have ended its ranks first; the stacks of those still here are taken.
                found = self.decided()
                if found:
                    self._end(found, [r for r in mine if r["state"] != "gone"])
                return
            # An aggregator whose ranks are still looks every second: the other may have decided,
            # and each second here is one more before the restart. One file, two nodes.
            follow_every = (1.0 if stalled else read_every(self.nnodes)) if aggregating else FOLLOW_EVERY
            if now - followed >= follow_every:
                followed = now
                found = self.decided()
                if found:
                    self._end(found, mine)
                    return
                aggregating = self.aggregates()
            if not aggregating:
                continue
            if now - read >= read_every(self.nnodes):  # between reads, the others' ranks as last read
                others, read = self.all_ranks([]), now
            ranks = mine + others
            # Progress is this node's ranks, read fresh every second: a step is a collective, so they
            # stop when any rank does. Of the others only a phase or a count of work done before the
            # first step (the data tokenized) counts; their steps arrive up to a publish late, and a
            # late one would put the detection off.
            key = local + tuple(sorted((r["rank"], None, r["phase"], None, r.get("progress")) for r in others))
            if key != last_key:
                # What changed last, for the finding: a hang detected late says which rank kept moving.
                changed = sorted(set(key) - set(last_key or ()), key=lambda entry: entry[0])
                last_key, last_change = key, now
            phases = rank_phases(ranks)
            phase = segment_phase(phases)
            if "saving" in phases and saving_since is None:
                saving_since = now
            elif "saving" not in phases and saving_since is not None:
                save_seconds.append(now - saving_since)
                saving_since = None
            bound = hang_bound(pauses, phase, self.override, save_seconds)
            if now - last_change > bound and not self.everyone_reported():
                # Someone has said nothing since: wait until it is silent, so that it is named.
                bound = max(bound, node_silent(self.nnodes) if self.override else FLOOR_SECONDS)
            self.bound = round(bound, 1)
            # A node that does not answer on the network cannot be waited for, whatever the phase's
            # bound: it is named once the job has waited the quick floor (or requeue.hang_seconds).
            lost = self.unreachable(now - last_change >= still_seconds(pauses))
            if lost and now - last_change >= max(QUICK_FLOOR_SECONDS, self.override or 0.0):
                bound = max(QUICK_FLOOR_SECONDS, self.override or 0.0)
                culprits = [dict(r, state="unreachable") for k in lost for r in self._last_read[k]["ranks"]]
                message = describe_unreachable(now - last_change, step, culprits)
                extra = {"cause": "unreachable", "node_ranks": lost}
            elif now - last_change > bound:
                culprits = stopped_first(ranks)
                message = describe_hang(now - last_change, bound, step, culprits, len(ranks))
                extra = {}
            else:
                continue
            world = len(ranks)
            finding = {
                "job_id": self.job_id, "restart": self.restart, "detected_by_node": self.node_rank,
                "at": time.time(), "seconds_without_progress": round(now - last_change, 1), "bound_seconds": round(bound, 1),
                "phase": phase, "step": step, "ranks": sorted(r["rank"] for r in culprits),
                "nodes": " ".join(sorted({r["node"] for r in culprits})) if len(culprits) < world else "",
                "message": message, **extra,
                "pauses_recent": [round(s, 2) for s in pauses[-5:]],
                "last_change": [dict(zip(("rank", "step", "phase", "waiting", "progress"), entry)) for entry in changed],
            }
            self._claim(finding)
            self._end(self.decided() or finding, mine)
            return

    def _claim(self, finding: dict) -> None:
        """The first supervisor to decide writes hang.json; a later one's finding is dropped."""
        path = os.path.join(self.run_dir, HANG)
        tmp = f"{path}.{self.node_rank}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(finding, handle, indent=2)
            handle.write("\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            if self.decided() is None:  # a stale one from an earlier segment
                os.replace(tmp, path)
                return
        os.unlink(tmp)

    def _end(self, finding: dict, mine: list[dict[str, Any]]) -> None:
        self.hung = finding
        sys.stderr.write(f"jobgen-torchrun: node {self.node_rank}: hung: {finding['message']}; dumping the ranks' stacks "
                         "and ending them\n")
        sys.stderr.flush()
        for rank in mine:
            self._dump_stack(rank)
        # _stop is set when torchrun has seen the ranks end: nothing left to wait for.
        self._stop.wait(STACK_SECONDS)
        # Held where they are until killed: a stopped rank, continued for its stack, would train on
        # (seen: a job found hung in a save finished in the wait), and an ended one would fail the
        # collectives of other nodes' ranks before they are asked for their stacks.
        for rank in mine:
            try:
                os.kill(rank["pid"], signal.SIGSTOP)
            except ProcessLookupError:
                pass
        self._stacks_taken = True
        self.publish(mine, stalled=True)
        # A node that does not answer: the others' stacks would show only their wait for it (and
        # their ranks end at once too), while every second spent here is one more of the restart.
        if finding.get("cause") != "unreachable":
            self._wait_for_stacks(mine, self.now() + kill_after(self.nnodes) - STACK_SECONDS)
        for rank in mine:
            try:
                os.kill(rank["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _wait_for_stacks(self, mine: list[dict[str, Any]], deadline: float) -> None:
        """Until every node has taken its ranks' stacks, or the deadline. Nodes 0 and 1 read every
        summary for it and say in theirs once all have (`all_stacks_taken`); the others read only
        those two, so the shared folder sees at most 400 reads a second per reader, as in `_watch`.
        A node already silent (frozen whole, its supervisor with it) is not waited for; one that
        froze since, or never published, holds the wait to the deadline."""
        every = max(0.5, self.nnodes / 400)
        while not self._stop.wait(every) and self.now() < deadline:
            if self.node_rank < AGGREGATORS:
                others = [self.node_summary(k) for k in range(self.nnodes) if k != self.node_rank]
                if all(node and (node.get("stacks_taken") or all(r["state"] == "silent node" for r in node["ranks"]))
                       for node in others):
                    self._all_stacks_taken = True
                    self.publish(mine, stalled=True)
                    return
            elif any((self.node_summary(k) or {}).get("all_stacks_taken") for k in range(AGGREGATORS)):
                return

    def _dump_stack(self, rank: dict[str, Any]) -> None:
        path = os.path.join(self.run_dir, rank_log(self.job_id, rank["rank"]))
        note = (f"\njobgen hang supervisor: rank {rank['rank']} on {rank['node']} is {rank['state']} at step "
                f"{rank['step']} ({rank['phase']}); its stack:\n")
        try:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(note)
        except OSError:
            pass
        spy = shutil.which("py-spy")
        if spy:
            try:
                out = subprocess.run([spy, "dump", "--pid", str(rank["pid"])], capture_output=True, text=True, timeout=20)
                if out.returncode == 0:
                    with open(path, "a", encoding="utf-8") as handle:
                        handle.write(out.stdout)
                    return
            except (OSError, subprocess.SubprocessError):
                pass
        try:  # faulthandler in the rank writes it; a stopped rank runs its handler once continued
            os.kill(rank["pid"], STACK_SIGNAL)
            if rank["state"] == "stopped":
                os.kill(rank["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
