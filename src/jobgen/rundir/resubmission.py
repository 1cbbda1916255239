"""What a run directory already rules out for the next `jobgen submit` of jobgen-train into it,
decided at submit instead of after the queue and the nodes' start:

- a run that completed, submitted again as it was: it would train nothing, its nodes started for a
  segment that counts as an interruption of the run (its goodput falls);
- a run of another length (training.max_steps, or epochs without it) over a checkpoint of this one
  on a decaying schedule: the trainer refuses it once its nodes have started
  (jobgen.train.schedule.check_schedule_total), for it would bend the learning rate from the
  resume point on.

Each refusal is one line naming the field, what the run directory says and the fix. A program of
the job's own decides its own length and is not judged here.
"""

from __future__ import annotations

from typing import Any, Optional

from jobgen.job.models import Job
from jobgen.rundir.metrics import output_dir
from jobgen.rundir.rewind import complete_steps
from jobgen.rundir.run import RunDir
from jobgen.rundir.status import pair_segments


def length_words(training: dict[str, Any]) -> str:
    """The run's length as its job says it: "max_steps 30", or "epochs 2" without max_steps."""
    if training.get("max_steps") is not None:
        return f"max_steps {training['max_steps']}"
    return f"epochs {training.get('epochs', 1)}"


def refusal(run: RunDir, job: Job) -> Optional[str]:
    """Why `job` should not be submitted into `run` as it stands, in one line; None when nothing
    the run directory says stands against it."""
    if job.training is None:
        return None
    before = run.settings()
    trained = before.get("training") if isinstance(before.get("training"), dict) else None
    if trained is None:
        return None  # a first submission, or a run of a program of the job's own until now
    steps = complete_steps(output_dir(run.path, {"training": {"output_dir": job.training.output_dir}}))
    if not steps:
        return None
    step = steps[-1]
    now = job.training.model_dump()
    same_length = length_words(trained) == length_words(now)
    decaying = job.training.lr_schedule != "constant" and trained.get("lr_schedule", "cosine") != "constant"
    if not same_length and decaying:
        return (f"training.max_steps: {run.path} has a checkpoint at step {step} of a run of {length_words(trained)} on a "
                f"{trained.get('lr_schedule', 'cosine')} schedule; this job has {length_words(now)}, which would change the "
                f"learning rate from the resume point on: set {length_words(trained).replace(' ', ': ')} to resume it, "
                "or give the job another name (or run_dir) to start a run of the new length")
    segments = pair_segments(run.segments())
    last = segments[-1] if segments else None
    if same_length and last is not None and last.get("outcome") == "completed" and last.get("last_step") == step:
        return (f"{run.path} completed at step {step}: submitted again as it is, it would train nothing; give the job "
                "another name (or run_dir) to train it again, or `jobgen submit --resume-from STEP` to train again "
                "from an earlier checkpoint of it")
    return None
