"""Two start-up costs a `jobgen` command does not need to pay.

A command is one short burst of work: a render spends about half its time importing jinja2,
pydantic, click and yaml, and most of the rest with pydantic building the job's validators.
Two costs on top of that are not the command's own. `benchmarks/render_cold_start.py` measures
them: on 2 cores, medians of 31 alternating runs, a render took 204 ms with them and 175 ms
without them.
"""

from __future__ import annotations

import gc
import importlib
import sys
import types

_PLUGIN_LOADER = "pydantic.plugin._loader"


def skip_startup_costs() -> None:
    """Called once per command, before the job is read."""
    # The cyclic collector walks the ~30,000 young objects (all alive until exit) that pydantic
    # makes while building validators, about 80 times per render, and finds almost nothing: ~10 ms.
    # No command runs long in Python: `logs -f` execs tail, and a local run's parent only waits
    # for the script, whose output goes straight to the terminal.
    gc.disable()
    if _PLUGIN_LOADER not in sys.modules:
        sys.modules[_PLUGIN_LOADER] = _NoPydanticPlugins(_PLUGIN_LOADER)


class _NoPydanticPlugins(types.ModuleType):
    """Stands in for pydantic's plugin loader and answers "no plugins".

    That is what PYDANTIC_DISABLE_PLUGINS=__all__ answers too. But the real loader imports
    importlib.metadata (email, csv, zipfile) for its entry-point scan on the first model pydantic
    builds, which takes ~15 ms even when the scan is disabled. jobgen uses no pydantic plugin.
    Any other name asked of this module loads the real loader, so a pydantic whose loader
    changes loses only the saving, not the command.
    """

    @staticmethod
    def get_plugins() -> tuple[()]:
        return ()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            # The import system asks a module for __path__ and the like: not a use of the loader.
            raise AttributeError(name)
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)
