"""`jobgen sites`: the profiles on this machine, where each comes from, and a check that a profile
renders every example job into scripts that `bash -n`, shellcheck and `sbatch --test-only` accept."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import click

from jobgen.errors import JobgenError


@click.group()
def sites() -> None:
    """Site profiles: the defaults and limits an admin keeps for a cluster.

    \b
    A profile is found by name on the site path ($JOBGEN_SITE_PATH, $XDG_CONFIG_HOME/jobgen/sites,
    /etc/jobgen/sites, the bundled examples); `site: NAME` in $XDG_CONFIG_HOME/jobgen/config.yaml
    makes one the default for every command. Writing one: docs/admins.md.
    """


@sites.command("list")
def list_sites() -> None:
    """Every profile on the site path: name, scheduler, file, and the files of the same name it shadows."""
    from jobgen.job.sites import all_sites, chosen_site, read_profile, site_folders

    default = chosen_site(None)
    click.echo(f"  {'NAME':<24} {'SCHEDULER':<10} FILE")
    for name, found in all_sites().items():
        (folder, path), shadowed = found[0], found[1:]
        try:
            scheduler = read_profile(path, name).scheduler or "-"
        except JobgenError as error:
            scheduler = f"invalid: {str(error).splitlines()[0]}"
        mark = "*" if name == default else " "
        click.echo(f"{mark} {name:<24} {scheduler:<10} {path} ({folder.origin})")
        for other, other_path in shadowed:
            click.echo(f"  {'':<24} {'':<10} shadows {other_path} ({other.origin})")
    if default:
        from jobgen.job.sites import user_config_file

        click.echo(f"* the default site (`site: {default}` in {user_config_file()})", err=True)
    click.echo("searched: " + ", ".join(f"{f.path} ({f.origin})" for f in site_folders()), err=True)


@sites.command()
@click.argument("name", required=False)
def show(name: Optional[str]) -> None:
    """The profile NAME as jobgen reads it, and the file it came from (the default site without NAME)."""
    import yaml

    from jobgen.job.sites import find_site, load_site

    name = _site_or_default(name)
    site = load_site(name)
    found = find_site(name) if site.path != Path(name) else []
    origin = f" ({found[0][0].origin})" if found else ""
    click.echo(f"# site {name}: {site.path}{origin}")
    for folder, path in found[1:]:
        click.echo(f"# shadows {path} ({folder.origin})")
    document = {
        "description": site.description or None,
        "scheduler": site.scheduler,
        "defaults": site.defaults,
        "limits": {part: limits.model_dump(exclude_none=True) for part, limits in site.limits.items()},
        "templates": str(site.template_dir) if site.template_dir else None,
        "examples": str(site.examples_dir) if site.examples_dir else None,
    }
    document = {key: value for key, value in document.items() if value not in (None, {})}
    click.echo(yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=100), nl=False)


@sites.command()
@click.argument("name", required=False)
@click.option("--scheduler", "-s", metavar="NAME", help="Render for this scheduler instead of the profile's.")
def check(name: Optional[str], scheduler: Optional[str]) -> None:
    """Render every example job under site NAME and check the scripts.

    \b
    The jobs: the bundled configs/examples/*.yaml, and the profile's own `examples:` folder.
    Each script goes through `bash -n`, shellcheck (warnings and errors), and, for Slurm where
    sbatch is on PATH, `sbatch --test-only` (the cluster this runs on judges partitions, nodes,
    time and accounts; nothing is submitted). One line per problem; exit status 1 if any.
    """
    from jobgen.resources import bundled_path
    from jobgen.schedulers import get_scheduler
    from jobgen.job.sites import load_site

    name = _site_or_default(name)
    site = load_site(name)
    scheduler = scheduler or site.scheduler
    if not scheduler:
        raise JobgenError(f"site {name} sets no 'scheduler:'; give --scheduler")
    sbatch = get_scheduler(scheduler).directive_prefix == "#SBATCH"
    jobs = sorted((bundled_path("configs") / "examples").glob("*.yaml"))
    if site.examples_dir:
        jobs += sorted(site.examples_dir.glob("*.yaml"))
    checker = _ScriptChecker(sbatch)
    with tempfile.TemporaryDirectory(prefix="jobgen-sites-check-") as folder:
        for index, job in enumerate(jobs):
            checker.render(job, name, scheduler, Path(folder) / str(index))
        checker.lint()
    checker.note_pyxis()
    for line in checker.problems:
        click.echo(line)
    for line in checker.notes:
        click.echo(f"jobgen: note: {line}", err=True)
    ran = ["bash -n", "shellcheck"] + (["sbatch --test-only"] if checker.sbatch else [])
    click.echo(
        f"jobgen: site {name}, {scheduler}: {len(jobs)} job(s), {checker.rendered} rendered; "
        f"{', '.join(ran)}: {len(checker.problems)} problem(s)",
        err=True,
    )
    if checker.problems:
        raise SystemExit(1)


def _site_or_default(name: Optional[str]) -> str:
    from jobgen.job.sites import chosen_site, user_config_file

    name = name or chosen_site(None)
    if not name:
        raise JobgenError(f"give a site NAME (`jobgen sites list` shows them), or set `site: NAME` in {user_config_file()}")
    return name


class _ScriptChecker:
    """Renders jobs and collects one line per problem, each starting with the job file it came from."""

    def __init__(self, sbatch: bool) -> None:
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.rendered = 0
        self.sbatch = sbatch and shutil.which("sbatch") is not None
        if sbatch and not self.sbatch:
            self.notes.append("sbatch is not on PATH: `sbatch --test-only` was not run (run the check on a login node)")
        self._files: dict[str, tuple[Path, str]] = {}  # rendered file -> (job file, "batch script" or "node script")
        self.pyxis_jobs: list[Path] = []

    def render(self, job: Path, site: str, scheduler: str, folder: Path) -> None:
        from jobgen.cli.options import resolve
        from jobgen.script.render import NODE_SCRIPT_END, render

        try:
            resolved = resolve(job, site, (), echo_warnings=False)
            script = render(resolved, scheduler)
        except JobgenError as error:
            self._problem(job, *str(error).splitlines())
            return
        self.rendered += 1
        container = resolved.job.container
        if container.image and container.runtime == "pyxis":
            self.pyxis_jobs.append(job)
        folder.mkdir()
        scripts = {"batch script": script}
        node = re.search(rf"<<'{NODE_SCRIPT_END}'\n(.*?)^{NODE_SCRIPT_END}$", script, re.S | re.M)
        if node:  # embedded as a quoted heredoc, so shellcheck sees it only as text: check it alone
            scripts["node script"] = node.group(1)
        for kind, text in scripts.items():
            path = folder / kind.replace(" ", "-")
            path.write_text(text)
            self._files[str(path)] = (job, kind)
            syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            if syntax.returncode:  # bash says one mistake in two lines: where and why, then the line itself
                said = "; ".join(line.replace(f"{path}: ", "") for line in syntax.stderr.splitlines())
                self._problem(job, f"bash -n: {kind}, {said}")
        if self.sbatch:
            self._test_only(job, folder / "batch-script")

    def _test_only(self, job: Path, batch: Path) -> None:
        try:
            result = subprocess.run(
                ["sbatch", "--test-only", str(batch)], capture_output=True, text=True, cwd=batch.parent, timeout=60
            )
        except subprocess.TimeoutExpired:
            self._problem(job, "sbatch --test-only: no answer within 60 s")
            return
        if result.returncode:
            from jobgen.schedulers.commands import scheduler_message

            self._problem(job, f"sbatch --test-only: {scheduler_message(result.stderr or result.stdout)}")

    def note_pyxis(self) -> None:
        """pyxis's options are on the srun line in the script, which `sbatch --test-only` does not
        read, and only a Slurm with the pyxis plug-in knows them: say when this one cannot."""
        if not (self.sbatch and self.pyxis_jobs):
            return
        try:
            help_text = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            help_text = ""
        if "--container-image" not in help_text:
            self.notes.append(
                f"{len(self.pyxis_jobs)} job(s) use pyxis, and this Slurm's srun has no --container-image (pyxis is not "
                "installed here): their srun container options were not checked; run the check where pyxis is"
            )

    def lint(self) -> None:
        """One shellcheck for every file: it takes a fraction of a second to start, once."""
        if not self._files:
            return
        if shutil.which("shellcheck") is None:
            self.problems.append("shellcheck is not on PATH, so no script was linted: install it (apt-get install shellcheck)")
            return
        result = subprocess.run(
            ["shellcheck", "-f", "gcc", "-S", "warning", "-s", "bash", *self._files], capture_output=True, text=True
        )
        for line in (result.stdout + result.stderr).splitlines():
            finding = re.match(r"^(.*?):(\d+):(\d+): (.*)$", line)
            if finding and finding.group(1) in self._files:
                job, kind = self._files[finding.group(1)]
                self._problem(job, f"shellcheck: {kind}, line {finding.group(2)}, column {finding.group(3)}: {finding.group(4)}")
            else:
                self.problems.append(f"shellcheck: {line}")

    def _problem(self, job: Path, *lines: str) -> None:
        self.problems += [line if line.startswith(f"{job}:") else f"{job}: {line}" for line in lines]
