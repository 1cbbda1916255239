"""`jobgen templates list|show`: which template a render uses, and from which folder.

Imports only click at start-up: the search path and Jinja are loaded when a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from jobgen.cli.options import template_dir_option
from jobgen.errors import JobgenError

_site_option = click.option("--site", metavar="NAME", help="Include this site profile's folder of templates (default: the user's default site; --site none: none).")


@click.group("templates")
def templates() -> None:
    """The templates a render uses, and where each is found.

    \b
    Search path, first match wins: --template-dir, $JOBGEN_TEMPLATE_PATH, the site profile's
    folder, /etc/jobgen/templates, $XDG_CONFIG_HOME/jobgen/templates (~/.config), installed site
    packages, scheduler plug-ins' folders, the bundled templates. An override extends the shipped
    one as 'bundled/NAME'; its blocks: docs/template-contract.md.
    """


@templates.command("list")
@template_dir_option
@_site_option
def list_templates(template_dirs: tuple[Path, ...], site: Optional[str]) -> None:
    """Every template name, the folder it resolves from, and whether it overrides a bundled one."""
    from jobgen.script.template_search import resolve_all

    folders, found = resolve_all(template_dirs, _site_folder(site))
    click.echo("search path, first match wins:")
    for folder in folders:
        click.echo(f"  {folder.origin}: {folder.path}")
    width = max(len(name) for name in found)
    for name, (folder, shadowed) in sorted(found.items()):
        note = "bundled" if folder.bundled else f"{folder.origin}, {'overrides bundled' if any(f.bundled for f in shadowed) else 'new'}"
        click.echo(f"{name:<{width}}  {note}  {folder.path / name}")


@templates.command("show")
@click.argument("name")
@click.option("--bundled", "bundled", is_flag=True, help="Show the shipped template, whatever overrides it.")
@template_dir_option
@_site_option
def show_template(name: str, bundled: bool, template_dirs: tuple[Path, ...], site: Optional[str]) -> None:
    """Print the text of template NAME as a render would use it."""
    from jobgen.script.template_search import resolve_all

    if name.startswith("bundled/"):
        name, bundled = name[len("bundled/"):], True
    _, found = resolve_all(template_dirs, _site_folder(site))
    if name not in found:
        raise JobgenError(f"no template '{name}' on the template search path; jobgen templates list shows every name")
    folder, shadowed = found[name]
    if bundled:
        folder = next((f for f in (folder, *shadowed) if f.bundled), None)
        if folder is None:
            raise JobgenError(f"'{name}' is not a bundled template: it comes from {found[name][0].origin} only")
    path = folder.path / name
    from jobgen.job.textfile import file_not_utf8_message

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise JobgenError(f"{path}: {file_not_utf8_message(path)}") from None
    click.echo(f"# {name}: {folder.origin}, {path}", err=True)
    click.echo(text, nl=False)


def _site_folder(site: Optional[str]) -> Optional[Path]:
    from jobgen.job.sites import chosen_site, load_site

    return load_site(chosen_site(site)).template_dir
