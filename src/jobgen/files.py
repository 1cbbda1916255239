"""Writing files that other people and other nodes read."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

from jobgen.errors import JobgenError


def replace_atomically(path: Union[str, Path], text: str, mode: int = 0o644, durable: bool = False) -> None:
    """`path` holds `text`, whole or not at all; `durable` also waits for the disk. The temporary
    name comes from mkstemp, not the pid: pids repeat across the nodes that share a run directory.
    Raises OSError."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(path.parent)


def fsync_directory(directory: Union[str, Path]) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Whole or not at all, never group- or world-writable on a shared system; one line on failure."""
    try:
        replace_atomically(path, text, mode)
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None
