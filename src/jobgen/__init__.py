"""jobgen: one typed job description, rendered and submitted to Slurm, PBS Pro or Torque.

The package is its parts, each a subpackage, lowest first; a part imports only the parts below
it (tests/test_layout.py checks every import, lazy ones included):

    job/         the job description: the models, their layers (defaults < site profile < job
                 file < --set), site profiles, readers of the user's files, pre-submit checks
    schedulers/  one module per scheduler: its directives, submit, state and cancel
    script/      rendering a job into a batch script: templates, their search path and contract,
                 containers
    rundir/      the run directory: its file names, the submission that lays it out, and every
                 reader of it (status, logs, progress, metrics, plot)
    train/       what runs on the nodes: jobgen-train, jobgen-probe, jobgen-torchrun
    api.py       the Python API, `jobgen.Job` and `jobgen.Run`: a job resolved once, validated,
                 rendered and submitted; the job commands of cli/ are built on it
    cli/         the `jobgen` command, one module per command group

Below them all, shared by every part: `errors` (one-line errors for people), `files` (atomic
writes), `resources` (where the bundled templates and configs are), `plugins` (entry points),
`parent_death` (a process that ends with its parent).
"""

__version__ = "0.1.0"

# The Python API (jobgen/api.py, above every part): loaded on first use, so that `import jobgen`,
# which every command and every rank does, does not import the job models and schedulers for it.
_API = ("Job", "Run", "InvalidJob", "JobgenError", "RunFailed")


def __getattr__(name: str):
    if name in _API:
        from jobgen import api

        return getattr(api, name)
    raise AttributeError(f"module 'jobgen' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
