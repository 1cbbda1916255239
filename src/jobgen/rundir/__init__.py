"""The run directory: one job on disk, written by its submission, its script and its trainer,
and read back by every command that explains it.

    files.py       every file name in a run directory, spelled once (templates get them too)
    run.py         RunDir: the job file, the submissions and segments records; find_run; the
                   user's index of submissions ($XDG_STATE_HOME/jobgen/index.jsonl)
    submission.py  render, lay out the run directory, hand the script to the scheduler
    sweep.py       a sweep's folder: its record of points, their submission (one job array on
                   Slurm), and `jobgen status` of every point
    status.py      `jobgen status`: segments, goodput, the scheduler's word
    outcome.py     what a run came to: the trainer's line (why a segment failed), the last loss,
                   the final model or adapter, a probe's result
    logs.py        which log `jobgen logs` reads: the named job's, its node's or rank's
    index.py       `jobgen runs`: one line per run of this user, newest first
    metrics.py     the trainer's metrics and start-up records, read without torch
    progress.py    live progress: `jobgen logs -f` and a local run's terminal
    plot.py        `jobgen plot`
    model_pin.py   a hub model's commit, pinned for the run so that its restarts load what it
                   started with

May import jobgen.job, jobgen.schedulers and jobgen.script; nothing above. The trainer writes
into the run directory with these names (jobgen.train imports files.py, metrics.py and model_pin.py).
"""
