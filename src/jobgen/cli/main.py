"""The `jobgen` group. Imports nothing heavy at start-up: no torch on a login node."""

from __future__ import annotations

import sys

import click

from jobgen.cli import job, runs
from jobgen.cli.data import data
from jobgen.cli.export import export
from jobgen.cli.init import init
from jobgen.cli.prepare import prepare
from jobgen.cli.sites import sites
from jobgen.cli.startup import skip_startup_costs
from jobgen.cli.templates import templates
from jobgen.errors import JobgenError


class JobgenGroup(click.Group):
    """Turns a JobgenError anywhere below into one line on stderr and exit status 2; and a command
    line click refuses (an unknown option, a bad value) into one line too, naming the --help to
    read, where click prints four (usage, hint, a blank line, the error)."""

    aliases = {"list": "runs"}  # other names a command answers to, left out of --help

    def get_command(self, ctx: click.Context, cmd_name: str):
        return super().get_command(ctx, self.aliases.get(cmd_name, cmd_name))

    def invoke(self, ctx: click.Context):
        skip_startup_costs()
        try:
            return super().invoke(ctx)
        except JobgenError as error:
            for line in str(error).splitlines():
                click.echo(f"jobgen: error: {line}", err=True)
            sys.exit(2)
        except click.UsageError as error:
            click.echo(f"jobgen: error: {error.format_message().rstrip('.')} (see {command_words(error.ctx)} --help)", err=True)
            sys.exit(error.exit_code)


def command_words(ctx) -> str:
    """`jobgen submit` for a context of submit, however jobgen was started (`python -m jobgen.cli`)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["jobgen", *reversed(names)])


@click.group(cls=JobgenGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="jobgen")
def main() -> None:
    """Render, submit and follow multi-node fine-tuning jobs on Slurm, PBS Pro and Torque.

    \b
    Layers, lowest first: bundled defaults < site profile (--site) < job file < --set.
    Start with:  jobgen render --scheduler slurm configs/examples/llama-lora-2node.yaml
    """


for command in (init, job.render, job.validate, job.schema, job.submit, prepare, data, runs.runs, runs.status, runs.cancel, runs.logs, sites, runs.plot, export, templates):
    main.add_command(command)

if __name__ == "__main__":
    main()
