"""`python -m jobgen.train.rank_output PROGRAM [ARGS...]`: one rank of the job's own program
(launch.command), its output in its rank log as well as in the node's log, then PROGRAM in its
place (exec: the same process, so torchrun's signals and exit status are the program's own).

jobgen-train routes its ranks' output itself (jobgen.train.console); a program of the user's
own cannot, so jobgen-torchrun starts each rank through this. Every rank's stdout and stderr go
through `tee` to RUN_DIR/logs/JOBID-ranks/.../JOBID-rankR.out (jobgen.rundir.files.rank_log,
what `jobgen logs RUN --rank R` reads) and on to the node's log, which keeps every rank's lines as
before: jobgen cannot tell a program's warnings from its noise.
"""

from __future__ import annotations

import os
import subprocess
import sys

from jobgen.train.console import _ignore_stop_signals, open_rank_log, rank_log_path


def tee_to_rank_log(run_dir: str, job_id: str, rank: int) -> None:
    """fds 1 and 2 into `tee -a RANK_LOG`, whose own output is the node's log (fd 2 until now)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.close(open_rank_log(run_dir, job_id, rank))  # its folder, for tee
    # tee ignores the stop signals a scheduler sends the whole job: the stop is worth logging. It
    # ends when the program's last copy of the pipe closes, after the program's last line.
    node_log = os.dup(2)
    tee = subprocess.Popen(["tee", "-a", rank_log_path(run_dir, job_id, rank)], stdin=subprocess.PIPE,
                           stdout=node_log, preexec_fn=_ignore_stop_signals)
    os.close(node_log)  # tee has it; the program writes through the pipe
    pipe = tee.stdin.fileno()  # type: ignore[union-attr]
    os.dup2(pipe, 1)
    os.dup2(pipe, 2)
    tee.stdin.close()  # type: ignore[union-attr]


def main() -> None:
    words = sys.argv[1:]
    if not words:
        sys.exit("usage: python -m jobgen.train.rank_output PROGRAM [ARGS...]")
    run_dir, job_id, rank = os.environ.get("JOBGEN_RUN_DIR"), os.environ.get("JOBGEN_JOB_ID"), os.environ.get("RANK", "")
    if run_dir and job_id and rank.isdigit():  # outside a jobgen job (by hand): the program alone
        try:
            tee_to_rank_log(run_dir, job_id, int(rank))
        except OSError as error:  # the rank still runs, its lines in the node log alone
            sys.stderr.write(f"jobgen: rank {rank}: no rank log ({error}); its output is in the node's log only\n")
    try:
        os.execvp(words[0], words)
    except OSError as error:
        sys.stderr.write(f"jobgen: rank {rank}: launch.command: cannot run {words[0]!r}: {error.strerror}\n")
        sys.exit(127)


if __name__ == "__main__":
    main()
