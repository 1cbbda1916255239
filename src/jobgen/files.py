"""Writing files that other people and other nodes read."""

from __future__ import annotations

import os
from pathlib import Path

from jobgen.errors import JobgenError


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Whole or not at all, never group- or world-writable on a shared system."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None
