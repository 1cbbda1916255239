"""Writing files that other people and other nodes read."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Union

from jobgen.errors import JobgenError


def replace_atomically(path: Union[str, Path], text: Union[str, bytes, list], mode: int = 0o644, durable: bool = False) -> None:
    """`path` holds `text` (or a list of buffers, one after the other), whole or not at all;
    `durable` also waits for the disk. The temporary name comes from mkstemp, not the pid: pids
    repeat across the nodes that share a run directory. Raises OSError."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            for piece in text if isinstance(text, list) else [text.encode("utf-8") if isinstance(text, str) else text]:
                handle.write(piece)
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


def write_atomic(path: Path, text: Union[str, bytes], mode: int = 0o644) -> None:
    """Whole or not at all, never group- or world-writable on a shared system; one line on failure."""
    try:
        replace_atomically(path, text, mode)
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None


def write_output(path: Path, data: Union[str, bytes]) -> None:
    """Every file a person names with a command's -o (or --data): a regular file, or a new one, is
    replaced whole (write_atomic); a symlink's target is written and the link kept; a device or FIFO
    (`-o /dev/null`, `-o /dev/stdout`) is written as open() would, never replaced by a regular file.
    One line on failure."""
    target = Path(os.path.realpath(path))  # a link's target, also through linked folders
    try:
        kind = os.stat(target).st_mode
    except FileNotFoundError:
        kind = stat.S_IFREG  # a new file
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None
    if stat.S_ISDIR(kind):
        raise JobgenError(f"cannot write {path}: it is a folder; name a file in it")
    if stat.S_ISREG(kind):
        write_atomic(target, data)
        return
    try:
        with open(target, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
    except OSError as error:
        raise JobgenError(f"cannot write {path}: {error.strerror}") from None
