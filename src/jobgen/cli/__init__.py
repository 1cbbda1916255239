"""The `jobgen` command line: one module per command group, each thin (parse, call, print).

    main.py       the `jobgen` group: one line per error, the start-up costs skipped
    options.py    the options every job command shares, and resolving a job file with them
    job.py        render, validate, submit, schema
    init.py       init: a first job file, commented, from answers, flags or a recipe
    prepare.py    prepare: the job's data tokenized into its store ahead of the job
    runs.py       runs (list), status, logs, cancel, plot
    export.py     export: a finished run's model, a LoRA adapter merged into its base
    sites.py      jobgen sites list|show|check
    templates.py  jobgen templates list|show
    reference.py  the documentation's job-key and command references, generated (an mkdocs hook)

May import every part below it; imports nothing heavy at start-up (no torch on a login node).
"""

from jobgen.cli.main import main

__all__ = ["main"]
