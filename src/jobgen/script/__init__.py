"""The batch script: a job rendered through Jinja2 templates for one scheduler.

    render.py             rendering, a pure function of the job (every value shell-quoted)
    template_search.py    where templates come from: --template-dir, sites, plug-ins, bundled
    template_contract.py  the blocks a site override may fill, and the variables each uses
    checks.py             what a scheduler refuses in a job, checked before any template (validate too)
    containers.py         which container runtimes a scheduler and launcher can start

May import jobgen.job and jobgen.schedulers; nothing above.
"""
