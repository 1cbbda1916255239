"""The names of the files in a run directory, spelled here once.

The batch script writes most of them and the trainer and `jobgen status` read them, so Python
imports these constants and the templates get them as the `files` variable (see `TEMPLATE_FILES`):
a file renamed here is renamed everywhere. Names only, relative to the run directory; no imports
beyond the standard library, since the trainer on every rank imports this too.
"""

from __future__ import annotations

import re
from typing import Optional

JOB_FILE = "job.yaml"  # the resolved job, as the trainer reads it
NODE_SCRIPT = "node.sh"  # what each node runs, with its NODE_RANK as $1
# Environment for nodes that a launcher starts bare (pbsdsh, ssh); holds secrets, removed at the end.
NODE_ENV = "node.env"
SEGMENTS = "segments.jsonl"  # one start and one end line per segment, written by the batch script
SUBMISSIONS = "submissions.jsonl"  # one line per `jobgen submit`
SUBMISSION_TEXT = "submission.txt"  # the script as it was handed to the scheduler
STOP_REQUESTED = "stop-requested"  # the batch script's request that every rank checkpoints and stops
TRAINER_EXIT = "trainer-exit.json"  # rank 0's report of what the run did (jobgen.train.exit_report)
LOGS = "logs"
LOCAL_PID = "local.pid"  # a local run's job id and the process running its script
CONTINUATION_SCRIPT = "job.pbs"  # the copy a PBS job submits as its own continuation
CONTINUATION_ERRORS = "qsub.err"  # what qsub said when it refused that continuation
HOSTFILE_PREFIX = "hosts."  # mpiexec's hostfile, one per job id
# In the job's training.output_dir (RUN_DIR/output by default), written by the trainer's rank 0:
METRICS_FILE = "metrics.jsonl"  # one record per optimizer step (jobgen.train.metrics)
STARTUP_FILE = "startup.jsonl"  # where each segment's time to its first new step went
FINAL_MODEL = "final"  # the final model (full weights) or adapter, and the tokenizer, once the run completes


def script(scheduler: str) -> str:
    return f"job.{scheduler}.sh"


def batch_log(job_id: str) -> str:
    return f"{LOGS}/{job_id}.out"


def node_log(job_id: str, node: int | str) -> str:
    return f"{LOGS}/{job_id}-node{node}.out"


def rank_log(job_id: str, rank: int | str) -> str:
    return f"{LOGS}/{job_id}-rank{rank}.out"


def node_exit(job_id: str, node: int | str) -> str:
    """Node K's exit status, written where the launcher does not pass it on (pbsdsh)."""
    return f"{LOGS}/{job_id}-node{node}.exit"


def batch_log_job_id(file_name: str) -> Optional[str]:
    """The job id of a file in logs/ named as `batch_log` names it; None for any other file."""
    if not file_name.endswith(".out") or re.search(r"-(node|rank)\d+\.out$", file_name):
        return None
    return file_name[: -len(".out")]


class _TemplateFiles:
    """What templates see as `files`: the names above, and the log names as functions that a
    template calls with shell words, e.g. `{{ files.node_log("$JOBGEN_JOB_ID", "$NODE_RANK")|raw }}`."""

    job = JOB_FILE
    node_script = NODE_SCRIPT
    node_env = NODE_ENV
    segments = SEGMENTS
    stop_requested = STOP_REQUESTED
    trainer_exit = TRAINER_EXIT
    logs = LOGS
    continuation_script = CONTINUATION_SCRIPT
    continuation_errors = CONTINUATION_ERRORS
    hostfile_prefix = HOSTFILE_PREFIX
    batch_log = staticmethod(batch_log)
    node_log = staticmethod(node_log)
    rank_log = staticmethod(rank_log)
    node_exit = staticmethod(node_exit)


TEMPLATE_FILES = _TemplateFiles()
