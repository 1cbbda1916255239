"""Where the bundled templates and configs live: inside the wheel, or at the top of a checkout."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def bundled_path(name: str) -> Path:
    """`templates` or `configs`: the copy shipped in the wheel, else the checkout's own folder."""
    shipped = _PACKAGE / name
    if shipped.is_dir():
        return shipped
    return _PACKAGE.parent.parent / name
