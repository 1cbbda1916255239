"""What installed packages add to jobgen, through two entry-point groups:

    [project.entry-points."jobgen.schedulers"]
    lsf = "jobgen_lsf:Lsf"                # a Scheduler subclass; its template beside the module
    [project.entry-points."jobgen.sites"]
    mycluster = "mycluster_jobgen"        # a package whose folder holds site profiles and templates

Looked up only when asked (importlib.metadata costs a command more than a render takes).
"""

from __future__ import annotations

from pathlib import Path

from jobgen.errors import JobgenError

SCHEDULER_GROUP = "jobgen.schedulers"
SITE_GROUP = "jobgen.sites"


def installed_schedulers() -> dict[str, str]:
    """Scheduler name -> "module:Class" for every installed `jobgen.schedulers` entry point."""
    return {entry.name: entry.value for entry in _entry_points(SCHEDULER_GROUP)}


def site_package_folders() -> list[tuple[str, Path]]:
    """(entry point name, folder) for every installed `jobgen.sites` entry point, by name.

    An entry point names a package (`mycluster = "mycluster_jobgen"`): its folder is the
    package's own directory. Or it names an attribute holding a path (`"mycluster_jobgen:SITE_DIR"`),
    relative to the package's directory unless absolute. What the folder holds is the site
    profiles' business (jobgen.job.sites). A package that cannot be imported is a JobgenError.
    """
    folders = []
    for entry in sorted(_entry_points(SITE_GROUP), key=lambda entry: entry.name):
        module_name, _, attribute = entry.value.partition(":")
        loaded = load_entry_point(SITE_GROUP, entry.name, module_name)
        folder = Path(loaded.__file__).resolve().parent
        if attribute:
            folder = folder / Path(str(load_entry_point(SITE_GROUP, entry.name, entry.value)))
        folders.append((entry.name, folder))
    return folders


def load_entry_point(group: str, name: str, value: str) -> object:
    """The object `value` ("module" or "module:attribute") names; one line when it cannot load."""
    import importlib

    module_name, _, attribute = value.partition(":")
    try:
        loaded: object = importlib.import_module(module_name.strip())
        for part in filter(None, attribute.strip().split(".")):
            loaded = getattr(loaded, part)
    except Exception as error:  # a plug-in's own bug: say whose, in one line
        raise JobgenError(
            f"the {group} entry point '{name}' ({value}) could not be loaded: {type(error).__name__}: {error}; "
            f"reinstall or uninstall the package that provides it"
        ) from None
    return loaded


def _entry_points(group: str):
    from importlib.metadata import entry_points

    return entry_points(group=group)
