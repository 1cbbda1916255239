"""`jobgen export`: a finished run's model as a plain Hugging Face folder (jobgen.train.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError


@click.command()
@click.argument("target", metavar="RUN_DIR|JOB_ID|NAME|OUTPUT_DIR|FINAL_DIR")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path),
              help="The folder to write (default: OUTPUT_DIR/merged with --merge, else OUTPUT_DIR/export).")
@click.option("--merge", is_flag=True, help="Merge a LoRA or Q-LoRA adapter into its base model's weights: a "
              "folder AutoModelForCausalLM loads without peft.")
@click.option("--base", metavar="MODEL", help="The base model's folder or hub name, where the run's training.model "
              "is not found from here.")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True,
              help="The merged weights' type (auto: the base model's own).")
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
def export(target: str, output: Optional[Path], merge: bool, base: Optional[str], dtype: str, force: bool) -> None:
    """Export a finished run's final model (OUTPUT_DIR/final), e.g. jobgen export runs/NAME --merge -o NAME-merged.

    The run is given as the other commands take it (its folder, a job id, or the name `jobgen
    runs` shows), or as its output folder or the final model's folder.

    \b
    A LoRA or Q-LoRA run saves an adapter: --merge loads the base model on the CPU, merges the
    adapter into it (peft merge_and_unload) and writes a plain transformers folder with the
    tokenizer; without --merge, the adapter with its base model recorded. A full fine-tune is
    copied as it is. Needs the training side: pip install 'jobgen[train]'.
    """
    from jobgen.train.export import export as write_export, find_source

    from jobgen.rundir.run import find_run

    # A folder is that folder; anything else names a run as `jobgen status` takes it.
    source = find_source(Path(target) if Path(target).exists() else find_run(target).path)
    out = output or source.final.parent / ("merged" if merge else "export")
    if out.exists() and not force:
        raise JobgenError(f"{out} exists: give --force to replace it, or -o another folder")
    if out.resolve() == source.final.resolve() or source.final.resolve() in out.resolve().parents:
        raise JobgenError(f"-o {out}: is (inside) the final model being exported; give another folder")
    click.echo(f"jobgen: exported {write_export(source, out, merge, base, dtype)}", err=True)
