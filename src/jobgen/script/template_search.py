"""Where templates come from: a search path of folders, the first folder holding a name wins.

In order: `--template-dir` folders, `$JOBGEN_TEMPLATE_PATH` (colon-separated), the site profile's
`templates:` folder, /etc/jobgen/templates, the user's `$XDG_CONFIG_HOME/jobgen/templates`
(~/.config by default), the `templates` folders of installed site packages (entry-point group
`jobgen.sites`: a `templates` folder in each; consulted when a site profile is in use, since
listing installed packages costs more than a render), and last the templates shipped with jobgen.
`bundled/NAME` always means the shipped one, so an override can extend what it replaces. Folders
that do not exist are skipped. A system folder comes before the user's: it holds site policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from jobgen.resources import bundled_path

BUNDLED = "bundled"
SYSTEM_FOLDER = Path("/etc/jobgen/templates")


@dataclass(frozen=True)
class TemplateFolder:
    """One folder of the search path, and why it is there (shown by `jobgen templates list`)."""

    origin: str
    path: Path

    @property
    def bundled(self) -> bool:
        return self.origin == BUNDLED


def user_folder() -> Path:
    from jobgen.job.sites import user_config_dir

    return user_config_dir() / "templates"


def search_path(
    template_dirs: Sequence[Path] = (), site_folder: Optional[Path] = None, site_packages: bool = True
) -> list[TemplateFolder]:
    """Every folder templates are looked up in, first match first; the bundled folder is last."""
    folders = [TemplateFolder("--template-dir", Path(d)) for d in template_dirs]
    folders += [TemplateFolder("$JOBGEN_TEMPLATE_PATH", Path(p)) for p in os.environ.get("JOBGEN_TEMPLATE_PATH", "").split(":") if p]
    if site_folder is not None:
        folders.append(TemplateFolder("site profile", Path(site_folder)))
    folders.append(TemplateFolder("system", SYSTEM_FOLDER))
    folders.append(TemplateFolder("user config", user_folder()))
    if site_packages:
        folders += site_package_folders()
    existing = [folder for folder in folders if folder.path.is_dir()]
    return existing + [TemplateFolder(BUNDLED, bundled_path("templates"))]


def site_package_folders() -> list[TemplateFolder]:
    """The `templates` folder of each installed site package (entry-point group `jobgen.sites`)."""
    from jobgen.plugins import site_package_folders as installed

    return [TemplateFolder(f"site package {name}", folder / "templates") for name, folder in installed()]


def resolve_all(
    template_dirs: Sequence[Path] = (), site_folder: Optional[Path] = None
) -> tuple[list[TemplateFolder], dict[str, tuple[TemplateFolder, list[TemplateFolder]]]]:
    """The search path (with every installed scheduler plug-in's folder, which a render adds for
    its own scheduler only), and for every template name (`*.j2` in a folder) the folder it
    resolves from and the folders after it that also hold it (what it overrides)."""
    folders = search_path(template_dirs, site_folder)
    folders[-1:-1] = plugin_scheduler_folders()
    found: dict[str, tuple[TemplateFolder, list[TemplateFolder]]] = {}
    for folder in folders:
        for path in sorted(folder.path.glob("*.j2")):
            name = path.relative_to(folder.path).as_posix()
            if name in found:
                found[name][1].append(folder)
            else:
                found[name] = (folder, [])
    return folders, found


def plugin_scheduler_folders() -> list[TemplateFolder]:
    """The template folder of each installed scheduler plug-in (entry-point group jobgen.schedulers)."""
    from jobgen.schedulers import BUNDLED as BUNDLED_SCHEDULERS
    from jobgen.schedulers import get_scheduler, scheduler_names

    return [
        TemplateFolder(f"scheduler {name}", path)
        for name in scheduler_names()
        if name not in BUNDLED_SCHEDULERS
        for path in get_scheduler(name).template_dirs()
    ]


def override_folders(template_dirs: Sequence[Path] = (), site_folder: Optional[Path] = None) -> list[TemplateFolder]:
    """The folders before the bundled one, installed site packages aside (what `validate` parses)."""
    return [folder for folder in search_path(template_dirs, site_folder, site_packages=False) if not folder.bundled]
