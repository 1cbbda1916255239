"""`jobgen-torchrun`: torchrun, minus the traceback when the job is stopped by a signal, and with
the ranks' grace period after that signal honoured on every torch jobgen allows.

A scheduler that preempts or cancels a job (PBS, Slurm) sends SIGTERM to every process of the
job. torchrun forwards it to the ranks, waits for them, SIGKILLs those still running, and then
raises its SignalException out of main, which prints a Python traceback into the node's log for
what is a normal stop. A rank that fails (a user's bad data, a missing file) ends in a
ChildFailedError out of main: another traceback, of torchrun's own code, under the rank's own
one-line error. This runs torchrun's own main and turns each into one line (exit status 1 for a
failed rank, as torchrun's uncaught exception gave); what the ranks did is in
RUN_DIR/trainer-exit.json, which the batch script reads.

Inside a jobgen job it also runs the node's hang supervisor (jobgen.train.heartbeat): when the
job's steps stop advancing past the bound, it dumps the ranks' stacks, ends them and this exits
with EXIT_HUNG (RUN_DIR/hang.json says which ranks and nodes stopped first).

On Slurm, a job that survives a node's failure (--no-kill) may lose its batch host: the first
surviving node then requeues it (jobgen.train.lost_batch_host).

For the job's own program (launch.command; node.sh then sets JOBGEN_STOP_SIGNAL), which does not
read the batch script's stop file, this sends that signal to the ranks when the file appears (at
the time limit's warning, a cancel, a preemption on PBS): `StopFileForwarder`; and it exports
the kept run ids of the trackers it reports to (launch.report_to): `export_tracker_environment`.

At the end of a run every node's torchrun meets the others at torch's exit barrier, on the store
that node 0's torchrun serves. When node 0 arrives last it leaves at once and takes the store with
it, while a node that arrived earlier may not yet have asked for the barrier's result: that node
logs a traceback ("Error waiting on exit barrier", pytorch/pytorch#69520) into a job that did
finish. `outlive_the_exit_barrier` makes every node say it has left before the store's node goes.

The ranks of a node share a temporary folder of its own for the segment (JOBGEN_NODE_TMP: where a
node's ranks wait for a data store together, jobgen.train.node_relay), where torchrun's own
temporary files go too; this removes it when they have exited, so a shared /tmp keeps nothing of
the job (torchrun alone leaves a torchelastic_* folder per run).

A stop is the stop whatever moment it meets the ranks (`NODE_STOP`): a rank ended by the stop's own
signal (stopped before its program had its handler in place, or while its interpreter ended,
when Python has put the default action back), by torchrun's SIGTERM to a node's other ranks after
one ended, or by SIGKILL at the end of the grace, makes this node's end the stop's (128+N), not a
failure; once the ranks have stopped, the exit barrier waits seconds, not torch's 300, for nodes
that will not come; and a second stop signal once no rank is left ends this process at once.

How long torchrun waits is TORCH_ELASTIC_SHUTDOWN_TIMEOUT (node.sh sets it to
requeue.warning_seconds, the time the ranks have to write their checkpoint). torch reads it from
2.12 on; torch 2.2 to 2.11 wait a fixed 30 s, so there this sets the same wait itself.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Optional

# At the top, not inside record_node_end: it runs in a signal handler too, where an import may
# meet one the main thread has half done (under OpenPBS's preemption the record once raised there).
from jobgen.files import replace_atomically
from jobgen.rundir.files import NODE_END_LOOKS, STOP_REQUESTED, node_end, node_end_folder

SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
# How long the exit barrier waits for the other nodes once the ranks were asked to stop: they left
# their last collective together, and a node that is not there within this failed or was ended.
STOPPED_EXIT_BARRIER_SECONDS = 20
STOPPED_DEPARTURE_SECONDS = 5  # and for their count out after it (seconds when every node came)


class NodeStop:
    """This node's stop as jobgen-torchrun knows it: the signal that asked the ranks to stop (the
    first one this process received, or the one the stop-file forwarder sent them), 0 for none;
    and the batch script's stop file, for jobgen-train, which reads that file itself."""

    def __init__(self) -> None:
        self.signum = 0
        self.stop_file: Optional[str] = None

    def asked(self, signum: int) -> None:
        if not self.signum:
            self.signum = int(signum)

    @property
    def requested(self) -> bool:
        return bool(self.signum) or bool(self.stop_file and os.path.exists(self.stop_file))


NODE_STOP = NodeStop()
REPORT_TO_ENV = "JOBGEN_REPORT_TO"  # launch.report_to, comma-separated, set by node.sh


def torch_reads_shutdown_timeout() -> bool:
    """True from torch 2.12 on, where torchrun itself reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    (torch.distributed.launcher.api.LaunchConfig gained `shutdown_timeout` then)."""
    from torch.distributed.launcher.api import LaunchConfig

    return any(field.name == "shutdown_timeout" for field in dataclasses.fields(LaunchConfig))


def shutdown_timeout_from_env() -> int | None:
    """The grace period TORCH_ELASTIC_SHUTDOWN_TIMEOUT asks for, or None when it is unset."""
    value = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        sys.exit(f"jobgen-torchrun: {SHUTDOWN_TIMEOUT_ENV}={value!r}: expected a whole number of seconds")
    return int(value)


def honour_shutdown_timeout(seconds: int) -> None:
    """On torch < 2.12, make torchrun wait `seconds` (not its fixed 30) for the ranks to exit after
    it forwards a stop signal, before it SIGKILLs them.

    Those releases' agent stops the ranks with `PContext.close(death_sig)` and leaves `timeout`
    at its default of 30 (torch/distributed/elastic/agent/server/local_elastic_agent.py,
    `_shutdown`); `close(death_sig, timeout)` itself is the same from 2.2 to 2.11. Only the default
    changes here: a caller that passes a timeout keeps it.
    """
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_after_grace(self, death_sig=None, timeout=seconds):
        return close(self, death_sig, timeout)

    PContext.close = close_after_grace


DEPARTED_KEY = "jobgen/exit-barrier-departed"


def outlive_the_exit_barrier(seconds: float = 30.0) -> None:
    """After torch's exit barrier, each node's torchrun counts itself out on the store and waits
    (up to `seconds`) until every node has: the node that serves the store then leaves last.

    Only the barrier's end changes; its own logging of a node that never came (a real failure)
    stays torch's. SimpleElasticAgent._exit_barrier(self) is the same from torch 2.2 on.
    """
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    barrier = SimpleElasticAgent._exit_barrier

    def barrier_then_count_out(self):
        stopping = NODE_STOP.requested
        if stopping:
            self._exit_barrier_timeout = min(self._exit_barrier_timeout, STOPPED_EXIT_BARRIER_SECONDS)
        barrier(self)
        wait_for_every_departure(self._store, self._worker_group.group_world_size,
                                 min(seconds, STOPPED_DEPARTURE_SECONDS) if stopping else seconds)

    SimpleElasticAgent._exit_barrier = barrier_then_count_out


def wait_for_every_departure(store, nodes: int, seconds: float, linger: float = 2.0) -> None:
    """Count this node out and wait until `nodes` have counted out, polling with back-off (at
    hundreds of nodes the store serves them all); then stay `linger` s, longer than a poll's pause,
    so that a node still polling gets its answer from the store's node, whichever node that is."""
    if nodes < 2:
        return
    deadline, pause = time.monotonic() + seconds, 0.05
    try:
        departed = store.add(DEPARTED_KEY, 1)
        while departed < nodes and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
            departed = store.add(DEPARTED_KEY, 0)
    except Exception:  # noqa: BLE001 - the store's node left first: every node had passed the barrier
        return
    if departed >= nodes:
        time.sleep(linger)


STOP_SIGNAL_ENV = "JOBGEN_STOP_SIGNAL"


class StopFileForwarder:
    """Sends JOBGEN_STOP_SIGNAL to this process's children (torchrun's ranks) once, when
    RUN_DIR/stop-requested appears: how a stop request reaches a program that reads no file.

    The ranks then have the grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, requeue.warning_seconds) to
    save and exit, as torchrun gives them after a signal of its own; those still running are then
    killed. A rank that the stop met with its handler in place, in a collective with a peer that
    the same stop killed (its handler not yet in place), would otherwise wait out gloo's 30
    minutes, and a local job's Ctrl-C with it."""

    def __init__(self, stop_file: str, signum: int, every: float = 0.5, grace: float = 30.0) -> None:
        self.stop_file, self.signum, self.every, self.grace = stop_file, signum, every, grace
        self._stop = threading.Event()

    @classmethod
    def from_env(cls, grace: Optional[int]) -> "StopFileForwarder | None":
        """From JOBGEN_STOP_SIGNAL and JOBGEN_RUN_DIR; `grace`: TORCH_ELASTIC_SHUTDOWN_TIMEOUT's (None: 30 s)."""
        name, run_dir = os.environ.get(STOP_SIGNAL_ENV, "").strip(), os.environ.get("JOBGEN_RUN_DIR")
        if not name or not run_dir:
            return None
        try:
            signum = signal.Signals["SIG" + name.removeprefix("SIG")]
        except KeyError:
            sys.exit(f"jobgen-torchrun: {STOP_SIGNAL_ENV}={name!r}: expected a signal name such as TERM or USR1")
        return cls(os.path.join(run_dir, STOP_REQUESTED), signum, grace=30.0 if grace is None else grace)

    def start(self) -> "StopFileForwarder":
        threading.Thread(target=self._run, name="jobgen-stop-forwarder", daemon=True).start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if os.path.exists(self.stop_file):
                break
        else:
            return
        NODE_STOP.asked(self.signum)
        for pid in child_pids():
            try:
                os.kill(pid, self.signum)
            except ProcessLookupError:
                pass  # ended meanwhile
        sys.stderr.write(f"jobgen-torchrun: stop requested: sent {self.signum.name} to the ranks\n")
        if self._stop.wait(self.grace):
            return  # torchrun has returned: every rank has exited
        left = child_pids()
        if left:
            sys.stderr.write(f"jobgen-torchrun: {len(left)} rank(s) still running {self.grace:g} s after the stop "
                             f"({SHUTDOWN_TIMEOUT_ENV}, requeue.warning_seconds): killing them\n")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def with_rank_logs(argv: list[str]) -> list[str]:
    """The job's own program (a forwarder is made for it alone) started through
    jobgen.train.rank_output, which gives each rank its rank log as jobgen-train's have, then
    runs the program in its place. Only with --no-python (node.sh's): otherwise torchrun runs
    the script with Python itself, and argv stays as it is."""
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(argv[1:])
    except SystemExit:  # torchrun itself says what is wrong with its arguments
        return argv
    if not parsed.no_python:
        return argv
    program = len(argv) - len(parsed.training_script_args) - 1  # REMAINDER: the words after it are its own
    return [*argv[:program], sys.executable, "-m", "jobgen.train.rank_output", *argv[program:]]


def child_pids() -> list[int]:
    """This process's children, from every thread's (Linux /proc)."""
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as children:
                pids += [int(pid) for pid in children.read().split()]
        except OSError:
            continue
    return pids


def failed_rank_line(failed) -> str:
    """One line for torchrun's ChildFailedError: the first rank that failed, and how."""
    rank, first = failed.get_first_failure()
    how = f"was killed by {first.signal_name()}" if first.exitcode < 0 else f"exited with status {first.exitcode}"
    others = len(failed.failures) - 1
    more = f"; {others} more rank(s) of this node failed after it" if others else ""
    return (f"jobgen-torchrun: rank {rank} (local rank {first.local_rank}, pid {first.pid}) {how}{more}; "
            "its own error is above and in its rank log")


def ended_by_the_stop(failed, stop_signum: int) -> bool:
    """Whether every rank that did not exit 0 was ended by a signal of a stop asked for before:
    the stop's own (a rank stopped before its program had its handler in place, or in its exit,
    after Python put the default action back), SIGTERM (torchrun ends a node's other ranks once
    one has ended) or SIGKILL (the grace spent). Such a node stopped; it did not fail."""
    stop_deaths = {-int(stop_signum), -int(signal.SIGTERM), -int(signal.SIGKILL)}
    return bool(stop_signum) and all(failure.exitcode in stop_deaths for failure in failed.failures.values())


def exit_if_hung(supervisor) -> None:
    """Exit with EXIT_HUNG, saying why, when the hang supervisor ended the ranks."""
    from jobgen.rundir.files import EXIT_HUNG

    if supervisor is not None and supervisor.hung:
        sys.stderr.write(f"jobgen-torchrun: the job hung: {supervisor.hung['message']}\n")
        sys.exit(EXIT_HUNG)


def export_tracker_environment() -> None:
    """The job's own program (launch.report_to, as JOBGEN_REPORT_TO): the trackers' kept run ids and
    settings into the environment the ranks inherit (jobgen.train.trackers). Here, not in the batch
    script, as this is where the program's Python and its tracker packages are, on every node."""
    trackers = [name for name in os.environ.get(REPORT_TO_ENV, "").split(",") if name]
    if not trackers:
        return
    from jobgen.errors import UserError
    from jobgen.rundir.files import EXIT_USER_ERROR
    from jobgen.train.trackers import own_program_environment

    try:
        # NODE_RANK: the node setup exports it (the same value node.sh gives torchrun's --node-rank).
        keeper = os.environ.get("NODE_RANK", "0") == "0"
        os.environ.update(own_program_environment(trackers, os.environ["JOBGEN_RUN_DIR"], keeper))
    except UserError as error:
        sys.stderr.write(f"jobgen-torchrun: error: {error}\n")
        sys.exit(EXIT_USER_ERROR)


def record_node_end(status: int) -> None:
    """This segment's record of this node's end, "STATUS NODE run", for the batch script, under
    each of its names (jobgen.rundir.files.NODE_ENDS). A node that leaves none lost all its
    processes at once (killed, or gone down) while the other nodes' ranks failed for want of it;
    outside a jobgen job, nothing."""
    run_dir, rank = os.environ.get("JOBGEN_RUN_DIR"), os.environ.get("NODE_RANK", "")
    job_id, restart = os.environ.get("JOBGEN_JOB_ID"), os.environ.get("JOBGEN_RESTART_COUNT", "0")
    if not run_dir or not job_id or not rank.isdigit():
        return
    name = os.environ.get("JOBGEN_NODE_NAME") or socket.gethostname()
    try:
        os.makedirs(os.path.join(run_dir, node_end_folder(job_id, restart)), exist_ok=True)
        for look in range(NODE_END_LOOKS):
            replace_atomically(os.path.join(run_dir, node_end(job_id, restart, rank, look)), f"{status} {name} run\n")
    except OSError as error:
        sys.stderr.write(f"jobgen-torchrun: could not record this node's end ({error})\n")


def record_at_a_stop_signal() -> None:
    """A stop signal (SIGTERM, SIGHUP, ...) is recorded as this node's end (128+N) the moment it
    arrives, not only once the ranks have exited: a launcher that ends a node may kill it before
    then (PBS's kill_delay after pbsdsh ends a task, Slurm's KillWait), and a node that leaves no
    record is taken for one that went down. torchrun's handler is a module function that the
    ranks' process context installs by its name (torch 2.2 on): this one records, then runs it.

    Only the first stop signal is acted on while ranks live. torchrun's handler raises, and its
    agent then ends the ranks, giving them the shutdown timeout to checkpoint; a second signal (the
    launcher ending each task after jobgen asked the node to stop, as pbsdsh does) would raise again
    inside that shutdown, cutting the ranks' grace short and printing a traceback for a stop that was
    asked for. Once no rank is left, a second one ends this process (128+N of the first)."""
    from torch.distributed.elastic.multiprocessing import api

    handler = api._terminate_process_handler
    stopping = []

    def record_then_stop(signum, frame):
        if stopping:
            # Past the ranks' grace there is nothing to protect: with no rank left (this process
            # waits at the exit barrier, or is ending), a second stop signal ends it now.
            if not child_pids():
                raise SystemExit(128 + stopping[0])
            return
        stopping.append(signum)
        NODE_STOP.asked(signum)
        try:
            record_node_end(128 + signum)
        except Exception as error:  # noqa: BLE001 - the stop itself must go on whatever the record does
            sys.stderr.write(f"jobgen-torchrun: could not record this node's end ({error!r})\n")
        handler(signum, frame)

    api._terminate_process_handler = record_then_stop


def exit_status(leaving: SystemExit) -> int:
    """The status a SystemExit ends the process with, as Python computes it."""
    return leaving.code if isinstance(leaving.code, int) else (0 if leaving.code is None else 1)


def node_temporary_folder() -> Optional[str]:
    """A folder of this node's temporary folder for the ranks of this segment
    (jobgen.train.node_relay.NODE_TMP_ENV), which main removes when they have all exited. torchrun's
    own temporary files go there too (this process only: the ranks keep TMPDIR): it makes a
    torchelastic_* folder of logs per run and leaves it behind."""
    from jobgen.train.node_relay import NODE_TMP_ENV

    try:
        folder = tempfile.mkdtemp(prefix=f"jobgen-{os.getuid()}-node-")
    except OSError as error:  # the ranks then wait in the temporary folder itself, as before
        sys.stderr.write(f"jobgen-torchrun: no folder of its own in the temporary folder ({error})\n")
        return None
    os.environ[NODE_TMP_ENV] = folder
    tempfile.tempdir = folder
    return folder


def main() -> None:
    status = 1
    folder = node_temporary_folder()
    try:
        run()
        status = 0
    except SystemExit as leaving:
        status = exit_status(leaving)
        raise
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
        record_node_end(status)
        # Before this node's task ends: a batch host gone with its script leaves nobody else to act.
        from jobgen.train.lost_batch_host import requeue_if_the_batch_host_is_gone

        requeue_if_the_batch_host_is_gone(status)


def run() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from jobgen.train.heartbeat import Supervisor

    if os.environ.get("JOBGEN_RUN_DIR"):
        NODE_STOP.stop_file = os.path.join(os.environ["JOBGEN_RUN_DIR"], STOP_REQUESTED)
    grace = shutdown_timeout_from_env()
    if grace is not None and not torch_reads_shutdown_timeout():
        honour_shutdown_timeout(grace)
    outlive_the_exit_barrier()
    record_at_a_stop_signal()
    export_tracker_environment()
    supervisor = Supervisor.from_env()  # before the ranks start: they inherit its folder
    if supervisor is not None:
        supervisor.start()
    forwarder = StopFileForwarder.from_env(grace)
    if forwarder is not None:
        forwarder.start()
        sys.argv = with_rank_logs(sys.argv)
    try:
        torchrun_main()
    except SignalException as stop:
        exit_if_hung(supervisor)
        name = getattr(stop.sigval, "name", str(stop.sigval))
        sys.stderr.write(f"jobgen-torchrun: {name}: the ranks were told to stop and have exited\n")
        sys.exit(128 + int(stop.sigval))
    except ChildFailedError as failed:
        exit_if_hung(supervisor)  # the ranks it ended: torchrun reports them failed
        if ended_by_the_stop(failed, NODE_STOP.signum):
            name = signal.Signals(NODE_STOP.signum).name
            sys.stderr.write(f"jobgen-torchrun: {name}: the ranks were told to stop and have exited "
                             f"({len(failed.failures)} of them by a signal, not by their program's own exit)\n")
            sys.exit(128 + NODE_STOP.signum)
        sys.stderr.write(failed_rank_line(failed) + "\n")
        sys.exit(1)
    except BaseException:
        exit_if_hung(supervisor)  # the ranks it ended: torchrun reports them failed
        raise
    finally:
        if forwarder is not None:
            forwarder.close()
        if supervisor is not None:
            supervisor.close()


if __name__ == "__main__":
    main()
