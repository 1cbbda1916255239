"""Command line of `jobgen-train` (also `python -m jobgen.train`); see the package docstring."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Optional

from jobgen.train.console import finish_output, route_output
from jobgen.errors import UserError
from jobgen.train.lifeline import die_with_torchrun
from jobgen.train.exit_report import ExitReport, NotFinite, write_exit_report
from jobgen.rundir.files import (EXIT_HEALTH_MISMATCH, EXIT_NODE_FAILED, EXIT_NOT_FINITE, EXIT_OUT_OF_MEMORY,
                                 EXIT_USER_ERROR)
from jobgen.train.health import HealthCheckFailed
from jobgen.train.heartbeat import install_stack_dump
from jobgen.train.stop import STOP_FILE, StopRequest

PROG = "jobgen-train"


def _parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="Run the fine-tune described by a resolved job file.")
    parser.add_argument("--job", required=True, help="resolved job file (RUN_DIR/job.yaml)")
    parser.add_argument("--run-dir", help="run directory (default: the directory holding the job file)")
    return parser.parse_args(argv)


def load_job(path: str):
    """The validated Job in `path`, read as `jobgen validate` reads it, with this jobgen's defaults;
    UserError otherwise, or if the job rendered into the script was another (jobgen.job.dump)."""
    from pathlib import Path

    from jobgen.job.dump import check_rebuilt
    from jobgen.job.layers import resolve_job
    from jobgen.errors import JobgenError

    try:
        job = resolve_job(Path(path)).job
        check_rebuilt(job, Path(path).read_text(encoding="utf-8"), path)
        return job
    except JobgenError as error:
        raise UserError(str(error).replace("\n", "; ")) from None


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def main(argv: Optional[list[str]] = None) -> None:
    args = _parse_args(argv)
    die_with_torchrun()
    rank = int(os.environ.get("RANK", "0") or 0)
    run_dir = os.path.abspath(args.run_dir or os.path.dirname(os.path.abspath(args.job)))
    handlers = [logging.StreamHandler(sys.stderr)]
    node_log = None
    if os.environ.get("JOBGEN_JOB_ID") and os.path.isdir(run_dir):  # inside a jobgen job
        node_log = route_output(run_dir, os.environ["JOBGEN_JOB_ID"], rank)
        if rank != 0:
            handlers.append(logging.StreamHandler(node_log))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"[{PROG} rank {rank}] %(levelname)s %(message)s",
        handlers=handlers,
    )
    install_stack_dump()  # the hang supervisor's signal: every thread's stack into this rank's log
    # Installed before anything slow, so an early signal is not lost.
    stop = StopRequest(stop_file=os.path.join(run_dir, STOP_FILE)).install()
    report = ExitReport()
    code = 1
    trainer = None
    try:
        from jobgen.train.distributed import RankInfo
        from jobgen.train.prepare import prepare
        from jobgen.train.trainer import Trainer

        info = RankInfo.from_env()
        job = load_job(args.job)
        prepared = prepare(job, run_dir, info.world_size, info.local_rank)
        trainer = Trainer(prepared, info, stop, report)
        trainer.run()
        code = 0
    except UserError as exc:
        # One write, so the lines of ranks sharing a terminal or pipe do not interleave.
        os.write(2, f"{PROG}: error: {exc}\n".encode())
        report.reason, report.message, code = "failed", str(exc), EXIT_USER_ERROR
        report.failure = "user_error"
    except HealthCheckFailed as exc:
        os.write(2, "".join(f"{PROG}: health check: {line}\n" for line in exc.lines).encode())
        report.reason, report.message = "failed", str(exc)
        report.failure, report.nodes = ("node_health" if exc.node_attributed else "health_mismatch"), " ".join(exc.nodes)
        code = EXIT_NODE_FAILED if exc.node_attributed else EXIT_HEALTH_MISMATCH
    except NotFinite as exc:
        os.write(2, f"{PROG}: error: {exc}\n".encode())
        report.reason, report.message, report.failure, code = "failed", str(exc), "not_finite", EXIT_NOT_FINITE
    except BaseException as exc:  # noqa: BLE001 - any crash must still leave trainer-exit.json
        traceback.print_exc()
        report.reason, report.message, code = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0], 1
        report.failure = "crash"
        if is_out_of_memory(exc):
            report.failure, code = "out_of_memory", EXIT_OUT_OF_MEMORY
            report.message = f"out of memory: {report.message} (lower training.per_device_batch_size or max_length, or raise zero_stage)"
        if node_log is not None and rank != 0:  # its traceback is in the rank's own log only
            node_log.write(f"{PROG} rank {rank}: error: {report.message}\n")
    finally:
        report.signal = report.signal or stop.signal_name
        # The outcome is known: report it before the process group's teardown, which a
        # preemption's SIGKILL may cut short (PBS leaves 10 s by default).
        if rank == 0 and os.path.isdir(run_dir):
            write_exit_report(run_dir, report)
        # Only after an end every rank agreed on. After a crash, another rank may be inside a
        # collective this one never joins, and NCCL's destroy_process_group can then block until
        # the process group's timeout; exiting is what tells the other ranks.
        if getattr(trainer, "dist", None) is not None and code in (0, EXIT_USER_ERROR, EXIT_HEALTH_MISMATCH, EXIT_NODE_FAILED):
            trainer.dist.close()
    # Everything is written and the process group is gone. Interpreter finalization can still
    # abort (SIGABRT) in gloo's worker threads, seen on a non-zero rank at the end of a complete
    # run, and torchrun then holds the other nodes in its exit barrier for 300 s: skip it.
    logging.shutdown()
    finish_output()
    os._exit(code)


if __name__ == "__main__":
    main()
