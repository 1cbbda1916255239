"""Users' files must be UTF-8 text: one that is not is named with its first bad byte, never a traceback.

Shared by every reader of a file a user gives: the job file and site profile (jobgen.job.layers),
template overrides (jobgen.script.render) and conversation data (jobgen.train.data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

BLOCK = 1 << 20


def not_utf8_message(raw: bytes, lines_before: int = 0) -> str:
    """Where `raw` stops being UTF-8, for a message after the file's name:
    `not UTF-8 text: byte 0xe9 at line 1, column 10; save the file as UTF-8`."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        start = error.start
        line_start = raw.rfind(b"\n", 0, start) + 1
        line = lines_before + raw.count(b"\n", 0, start) + 1
        # Columns count characters, as an editor shows them; the bytes before `start` decode.
        column = len(raw[line_start:start].decode("utf-8")) + 1
        return f"not UTF-8 text: byte 0x{raw[start]:02x} at line {line}, column {column}; save the file as UTF-8"
    return "not UTF-8 text; save the file as UTF-8"


def file_not_utf8_message(path: Union[str, Path]) -> str:
    """`not_utf8_message` for a file of any size, read a block at a time (after a text read failed)."""
    lines_before, carry = 0, b""
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK):
            chunk = carry + block
            # Up to the last newline: a newline byte is never part of a multi-byte character.
            cut = chunk.rfind(b"\n") + 1
            try:
                chunk[:cut].decode("utf-8")
            except UnicodeDecodeError:
                return not_utf8_message(chunk[:cut], lines_before)
            lines_before += chunk.count(b"\n", 0, cut)
            carry = chunk[cut:]
    return not_utf8_message(carry, lines_before)
