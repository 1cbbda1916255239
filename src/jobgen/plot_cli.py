"""The `jobgen plot` command; jobgen.plot does the work (imported when the command runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click


@click.command()
@click.argument("target", metavar="RUN_DIR|JOB_ID", default=".")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="The PNG to write (default RUN_DIR/plot.png).")
@click.option("--data", "data_file", type=click.Path(dir_okay=False, path_type=Path), help="Also write the plotted data here, as JSON.")
def plot(target: str, output: Optional[Path], data_file: Optional[Path]) -> None:
    """Draw the run: loss and tokens/s over the steps with each segment's start marked, and under
    them the segments (how each ended) with the goodput. Needs matplotlib: pip install 'jobgen[plot]'."""
    from jobgen.plot import plot as draw_run

    path, data = draw_run(target, output)
    if data_file is not None:
        data_file.write_text(json.dumps(data, indent=2) + "\n")
    click.echo(f"jobgen: wrote {path}", err=True)
