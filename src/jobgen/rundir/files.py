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
SUBMISSIONS = "submissions.jsonl"  # one line per `jobgen submit`, and per continuation a job submits of itself
SUBMISSION_TEXT = "submission.txt"  # the script as it was handed to the scheduler
NEWEST_CHECKPOINT = "newest-checkpoint"  # the job's own program (launch.command): its newest complete checkpoint's path
# The job's own program with JobgenCallback (jobgen.train.hf): the Trainer's rank 0 writes
# trainer_state.json without waiting for the other ranks' rng_state_N.pth, so the callback marks
# each checkpoint with SEALED_MARK once every rank has saved, and says so in the run directory
# with OWN_CHECKPOINTS_SEALED, which holds the step it started from: a checkpoint of a later step
# without the mark is not complete. Those up to that step came before (a run begun under a jobgen
# that did not seal, then upgraded) and are judged as then.
OWN_CHECKPOINTS_SEALED = "own-checkpoints-sealed"
SEALED_MARK = "jobgen-sealed"
STOP_REQUESTED = "stop-requested"  # the batch script's request that every rank checkpoints and stops
TRAINER_EXIT = "trainer-exit.json"  # rank 0's report of what the run did (jobgen.train.exit_report)
LOGS = "logs"
LOCAL_PID = "local.pid"  # a local run's job id and the process running its script
CONTINUATION_SCRIPT = "job.pbs"  # the copy a PBS job submits as its own continuation
CONTINUATION_ERRORS = "qsub.err"  # what qsub said when it refused that continuation
HOSTFILE_PREFIX = "hosts."  # mpiexec's hostfile, one per job id
HEALTH = "health.json"  # the latest segment's health gate: per node what was found, what differed, the figures
HEALTH_HISTORY = "health.jsonl"  # one summary line per segment's gate (outcome, bus bandwidth), read by `jobgen status`
HEALTH_CACHE = "health-cache"  # per node: content hashes of the data file and model folder by (path, size, mtime)
HEARTBEATS = "heartbeat"  # per node: its ranks' step and phase, published by the node's hang supervisor
HANG = "hang.json"  # the hang supervisor's finding: which ranks and nodes stopped first, after how long
EXCLUDED_NODES = "excluded-nodes"  # nodes a requeue excluded after a failure attributed to them, one a line
# The job id, once per restart inside its allocation (resources.spare_nodes): a job the scheduler
# starts again counts its restarts from the scheduler's count plus these.
IN_ALLOCATION_RESTARTS = "in-allocation-restarts"
# One line per segment in a row that ended without a newer complete checkpoint ("STEP OUTCOME NODES..."):
# requeue.max_restarts_without_progress of them stop the job. Removed by a segment that commits one.
STALLED_SEGMENTS = "stalled-segments"
# One line per continuation at the time limit after a segment that saved a newer checkpoint
# ("JOBID RESTART STEP"), written by the batch script as it requeues: requeue.max_restarts does not
# count these. Removed at a new submission (restart 0).
UNCOUNTED_RESTARTS = "uncounted-restarts"
NODE_EXITS = "node-exits"  # a file per node (NODE_RANK) whose setup ended with exit_node_failed or exit_do_not_requeue: "STATUS NODE"
# Per segment (NODE_ENDS/JOBID-RESTART/), a record per node written as the node's part ends:
# "STATUS NODE PHASE", PHASE `setup` (its setup ended it) or `run` (jobgen-torchrun's own status).
# A node without one lost all its processes at once (killed, or the node went down): the batch
# script tells it from the others. The same record is written under NODE_END_LOOKS names
# (RANK.0, RANK.1, ...) and the batch script reads a name of its own at each look: a network file
# system that cached a miss of one name (NFS's lookupcache, FUSE's negative_timeout) would answer
# "missing" for it long after the node wrote, but has never been asked for the next one.
NODE_ENDS = "node-ends"
NODE_END_LOOKS = 6
SWEEP_RECORD = "sweep.json"  # in a sweep's folder: its points (values, run directories) and submissions
SLURM_CONTINUATION = "job.slurm-continuation.sh"  # the script a Slurm job resubmits itself with, away from a bad node
PREPARED = "prepared"  # tokenized data stores (jobgen.train.store), unless training.prepared_cache names another folder
# The experiment trackers' run ids (W&B, MLflow), made at a run's first start and reused by every
# segment, so that a requeued run continues one tracker run (jobgen.rundir.trackers).
TRACKER_IDS = "trackers.json"
MLFLOW_STORE = "mlruns"  # MLflow's file store when no tracking URI is given
MODEL_COMMIT = "model-commit.json"  # a hub model's commit, pinned for the run at its first start (jobgen.rundir.model_pin)
# In the job's training.output_dir (RUN_DIR/output by default), written by the trainer's rank 0:
METRICS_FILE = "metrics.jsonl"  # one record per optimizer step (jobgen.train.metrics)
STARTUP_FILE = "startup.jsonl"  # where each segment's time to its first new step went
FINAL_MODEL = "final"  # the final model (full weights) or adapter, and the tokenizer, once the run completes
BEST_MODEL = "best"  # training.keep_best: the same, of the checkpoint with the lowest eval loss
BEST_CHECKPOINT = "checkpoints/best.json"  # training.keep_best: names that checkpoint (jobgen.train.best)

# Exit statuses, read by the batch script (templates get them as files.exit_*); docs/exit-codes.md.
EXIT_USER_ERROR = 2  # the job or its inputs are wrong: not requeued
EXIT_NOT_FINITE = 3  # the loss is not finite: not requeued
EXIT_OUT_OF_MEMORY = 4  # out of memory: not requeued, the same job would run out again
EXIT_HEALTH_MISMATCH = 5  # the nodes differ (versions, data, jobgen): not requeued, a person must fix it
EXIT_NODE_FAILED = 75  # this node is bad (EX_TEMPFAIL): requeued without it; a site's check may use it
EXIT_HUNG = 76  # the hang supervisor ended the ranks: requeued without the nodes that stopped first
EXIT_RESTART_STORM = 77  # the batch script: segments in a row ended without a newer checkpoint; not requeued
EXIT_DO_NOT_REQUEUE = 79  # a user's setup line says "do not requeue", whatever else happened


def script(scheduler: str) -> str:
    return f"job.{scheduler}.sh"


def batch_log(job_id: str) -> str:
    return f"{LOGS}/{job_id}.out"


def node_log(job_id: str, node: int | str) -> str:
    return f"{LOGS}/{job_id}-node{node}.out"


RANKS_PER_FOLDER = 1000  # rank logs per folder: 4,096 nodes x 8 ranks make 33 folders, not one of 32,768 files


def rank_log(job_id: str, rank: int | str) -> str:
    """Rank R's log: logs/JOBID-ranks/0-999/JOBID-rankR.out, a folder per 1,000 ranks (by rank,
    not node: a reader knows the rank, and torchrun's rendezvous may give a node other ranks)."""
    first = int(rank) // RANKS_PER_FOLDER * RANKS_PER_FOLDER
    return f"{LOGS}/{job_id}-ranks/{first}-{first + RANKS_PER_FOLDER - 1}/{job_id}-rank{rank}.out"


def node_exit(job_id: str, restart: int | str, node: int | str) -> str:
    """Node K's exit status in a segment, written where the launcher does not pass it on (pbsdsh).
    Named by the segment: a node of the previous one, ended without waiting for it, may still
    write its status after the next segment has started on the same job."""
    return f"{LOGS}/{job_id}-node{node}.{restart}.exit"


def node_end_folder(job_id: str, restart: int | str) -> str:
    """The node-end records of segment (job_id, restart)."""
    return f"{NODE_ENDS}/{job_id}-{restart}"


def node_end(job_id: str, restart: int | str, rank: int | str, look: int | str) -> str:
    """Node `rank`'s end record in segment (job_id, restart), the name for look `look`."""
    return f"{node_end_folder(job_id, restart)}/{rank}.{look}"


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
    submissions = SUBMISSIONS
    stop_requested = STOP_REQUESTED
    newest_checkpoint = NEWEST_CHECKPOINT
    own_checkpoints_sealed = OWN_CHECKPOINTS_SEALED
    sealed_mark = SEALED_MARK
    tracker_ids = TRACKER_IDS
    trainer_exit = TRAINER_EXIT
    logs = LOGS
    continuation_script = CONTINUATION_SCRIPT
    continuation_errors = CONTINUATION_ERRORS
    hostfile_prefix = HOSTFILE_PREFIX
    health = HEALTH
    hang = HANG
    excluded_nodes = EXCLUDED_NODES
    in_allocation_restarts = IN_ALLOCATION_RESTARTS
    slurm_continuation = SLURM_CONTINUATION
    node_exits = NODE_EXITS
    node_ends = NODE_ENDS
    heartbeats = HEARTBEATS
    exit_user_error = EXIT_USER_ERROR
    exit_not_finite = EXIT_NOT_FINITE
    exit_out_of_memory = EXIT_OUT_OF_MEMORY
    exit_health_mismatch = EXIT_HEALTH_MISMATCH
    exit_node_failed = EXIT_NODE_FAILED
    exit_hung = EXIT_HUNG
    exit_do_not_requeue = EXIT_DO_NOT_REQUEUE
    exit_restart_storm = EXIT_RESTART_STORM
    stalled_segments = STALLED_SEGMENTS
    uncounted_restarts = UNCOUNTED_RESTARTS
    batch_log = staticmethod(batch_log)
    node_log = staticmethod(node_log)
    rank_log = staticmethod(rank_log)
    node_exit = staticmethod(node_exit)
    node_end = staticmethod(node_end)
    node_end_folder = staticmethod(node_end_folder)
    node_end_looks = NODE_END_LOOKS


TEMPLATE_FILES = _TemplateFiles()
