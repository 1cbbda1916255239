"""Where training records come from: the files of `training.data`, read a chunk at a time.

`training.data` (and `training.eval_data`) is one path or a list of paths, read in order. Each is:

    .json      a JSON array of records; parsed whole, since it is one document (give JSONL for a
               data set too big to parse at once)
    .jsonl     (or any other file) one JSON record a line, read line by line
    .parquet   read with pyarrow, a record batch at a time
    a folder   written by Hugging Face `datasets.Dataset.save_to_disk` (state.json names its
               data-*.arrow files, Arrow IPC streams): read with pyarrow, a record batch at a
               time, without the `datasets` package

A JSON array is told from JSONL by its first character, not by its name; a UTF-8 byte-order mark
before it is skipped. A CSV, TSV or Excel file is refused by its name, naming what is read. Records from Parquet and
Arrow come as Python dicts; a field that is null there is left out (a column is shared by every
record, so a record without the field has it as null), so such a record reads as its JSON twin.

`read_chunks(path)` yields lists of (record index, record) of at most CHUNK_RECORDS, so the
caller never holds a whole large file parsed; a JSONL line that is not JSON is an Unreadable in
its place, so the lines after it are read too. Nothing here checks what a record holds:
jobgen.job.conversations does.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Union

from jobgen.errors import UserError
from jobgen.job.textfile import file_not_utf8_message

CHUNK_RECORDS = 1000  # records a chunk holds: a few MB of parsed conversations
PYARROW = "pip install pyarrow (or jobgen's train extra)"
STATE = "state.json"  # what `datasets` writes beside the Arrow files of a saved data set
READ_FORMATS = ("jobgen reads JSON (an array of records), JSONL (a record a line), Parquet (.parquet) and a folder "
                "written by datasets' save_to_disk")
# Tables jobgen does not read, by suffix: the refusal names the formats it does and a conversion.
TABLE_SUFFIXES = {".csv": "read_csv", ".tsv": "read_csv", ".xlsx": None, ".xls": None}


@dataclass(frozen=True)
class Unreadable:
    """A record that cannot be read at all (a JSONL line that is not JSON): the whole message."""

    message: str


Chunk = list[tuple[int, Any]]  # (index of the record in its file, the record or an Unreadable)


def data_paths(value: Union[str, Sequence[str], None]) -> list[str]:
    """`training.data` as a list of paths (one path, a list, or none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def resolve_paths(value: Union[str, Sequence[str], None], base: str) -> Union[str, list[str], None]:
    """`training.data` or `eval_data` (a path or a list) made absolute against `base`, keeping its
    shape (the store key hashes the files' contents, not their paths)."""
    if value is None:
        return None
    if isinstance(value, str):
        return os.path.abspath(os.path.join(base, value))
    return [os.path.abspath(os.path.join(base, path)) for path in value]


def data_files(value: Union[str, Sequence[str], None]) -> list[str]:
    """Every file `training.data` reads, in order: a saved `datasets` folder's Arrow files in its place."""
    return [name for path in data_paths(value) for name in (arrow_files(path) if source_kind(path) == "arrow" else [path])]


def source_kind(path: str, field: str = "training.data") -> str:
    """"json" (an array or JSONL), "parquet" or "arrow" (a saved `datasets` folder); a UserError
    naming `field` for a path that is none of them."""
    if not os.path.exists(path):
        raise UserError(f"{field}: file {path!r} does not exist")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, STATE)):
            return "arrow"
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            raise UserError(f"{field}: {path!r} holds a DatasetDict (dataset_dict.json); give one split's folder, "
                            f"e.g. {os.path.join(path, 'train')!r}")
        raise UserError(f"{field}: {path!r} is a folder without {STATE}; give a .json, .jsonl or .parquet file, "
                        f"or a folder written by datasets' save_to_disk{_data_files_in(path)}")
    if path.endswith(".parquet"):
        return "parquet"
    suffix = os.path.splitext(path)[1].lower()
    if suffix in TABLE_SUFFIXES:
        raise UserError(f"{field}: {path!r} is a {suffix[1:].upper()} file, which jobgen does not read; {READ_FORMATS}"
                        f"{_conversion(path, suffix)}")
    return "json"


def _conversion(path: str, suffix: str) -> str:
    """How to turn a table into Parquet with pyarrow (jobgen's train extra has it)."""
    if TABLE_SUFFIXES[suffix] is None:
        return ": save it as CSV, then convert that to Parquet with pyarrow"
    import shlex

    options = f", parse_options=pacsv.ParseOptions(delimiter={json.dumps(chr(9))})" if suffix == ".tsv" else ""
    target = os.path.splitext(path)[0] + ".parquet"
    # Python strings in double quotes, so that the shell's single quotes need no escapes.
    code = (f"import pyarrow.csv as pacsv, pyarrow.parquet as pq; "
            f"pq.write_table(pacsv.read_csv({json.dumps(path)}{options}), {json.dumps(target)})")
    return f": convert it, e.g. python -c {shlex.quote(code)}"


def _data_files_in(folder: str, shown: int = 3) -> str:
    """What a folder holds that could be given instead (a hub dataset's download has its files in
    data/ or a folder a split), listed in the message; a few levels deep, so a big tree is not walked."""
    found = []
    for root, folders, files in os.walk(folder):
        depth = root[len(folder):].count(os.sep)
        if depth >= 3:
            folders.clear()
        folders[:] = sorted(f for f in folders if not f.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files) if f.endswith((".json", ".jsonl", ".parquet"))]
    if not found:
        return ""
    more = f" and {len(found) - shown} more" if len(found) > shown else ""
    return f"; it holds {', '.join(repr(f) for f in found[:shown])}{more}: list those of the split to use"


def read_chunks(path: str, size: int = 0) -> Iterator[Chunk]:
    """The records of `path` in order, `size` (CHUNK_RECORDS by default) at a time (see the module docstring)."""
    size = size or CHUNK_RECORDS
    kind = source_kind(path)
    if kind == "json":
        yield from _json_chunks(path, size)
    else:
        batches = _parquet_batches(path, size) if kind == "parquet" else _arrow_batches(path, size)
        index = 0
        for rows in batches:
            yield [(index + offset, _without_nulls(row)) for offset, row in enumerate(rows)]
            index += len(rows)


def count_records(data: Union[str, Sequence[str]]) -> int:
    """How many records the files hold, without parsing them (for a progress line); 0 where a
    file is a JSON array, which only parsing counts."""
    total = 0
    for path in data_paths(data):
        kind = source_kind(path)
        if kind != "json":
            pa = _pyarrow(path)
            try:
                if kind == "parquet":
                    total += pa.parquet.ParquetFile(path).metadata.num_rows
                for name in arrow_files(path) if kind == "arrow" else []:
                    with pa.memory_map(name) as source:
                        total += sum(batch.num_rows for batch in pa.ipc.open_stream(source))
            except (pa.ArrowException, OSError):
                return 0  # reading it says what is wrong
        else:
            with open(path, "rb") as handle:
                if handle.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
                    return 0
                handle.seek(0)
                total += sum(1 for line in handle if line.strip())
    return total


# --- JSON and JSONL -------------------------------------------------------------------------------


# utf-8-sig: a file saved with a byte-order mark (Windows editors, pandas' to_json on Windows)
# reads as the same text without it.
TEXT_ENCODING = "utf-8-sig"


def _json_chunks(path: str, size: int) -> Iterator[Chunk]:
    try:
        with open(path, encoding=TEXT_ENCODING) as handle:
            start = handle.read(4096)
            if start.lstrip().startswith("["):  # a JSON array: one document, parsed whole
                records = parse_array(path, start + handle.read())
                for first in range(0, len(records), size):
                    yield list(enumerate(records[first:first + size], start=first))
                return
            handle.seek(0)
            yield from jsonl_chunks(path, handle, size)
    except UnicodeDecodeError:
        raise UserError(f"{path}: {file_not_utf8_message(path)}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path!r}: {exc.strerror}") from None  # training.data or eval_data: the path says which


def jsonl_chunks(path: str, lines: Any, size: int) -> Iterator[Chunk]:
    chunk: Chunk = []
    index = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except (ValueError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else json_reason(exc)
            if index == 0:  # not JSONL at all (a JSON object over several lines, say): one line, not one per line
                raise UserError(f"{path}: line {lineno} is not valid JSON ({reason}), so the file is neither a JSON "
                                f"array nor JSONL (one object per line); {READ_FORMATS}") from None
            message = f"{path}: line {lineno} is not valid JSON ({reason}); expected one object per line"
            record = Unreadable(message)
        chunk.append((index, record))
        index += 1
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def parse_array(path: str, text: str) -> list[Any]:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise not_json(path, exc) from None


def not_json(path: str, exc: Exception) -> UserError:
    if isinstance(exc, json.JSONDecodeError):
        return UserError(f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}")
    return UserError(f"{path}: not valid JSON: {json_reason(exc)}")


def json_reason(exc: Exception) -> str:
    # json raises RecursionError past ~1000 levels and ValueError for a number of over 4300 digits.
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc).split(";")[0]


# --- Parquet and Arrow ----------------------------------------------------------------------------


def _pyarrow(path: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise UserError(f"{path!r} needs pyarrow, which is not installed: {PYARROW}") from None
    return pyarrow


def _parquet_batches(path: str, size: int) -> Iterator[list[dict]]:
    pa = _pyarrow(path)
    try:
        parquet = pa.parquet.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=size):
            yield batch.to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{path}: not a readable Parquet file: {_first_line(exc)}") from None


def arrow_files(path: str) -> list[str]:
    """The Arrow files of a saved `datasets` folder, in its state.json's order."""
    try:
        with open(os.path.join(path, STATE), encoding="utf-8") as handle:
            files = [entry["filename"] for entry in json.load(handle)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{os.path.join(path, STATE)}: not a datasets state file (expected '_data_files', a list of "
                        f"{{'filename': ...}}): {_first_line(exc)}") from None
    return [os.path.join(path, name) for name in files]


def _arrow_batches(path: str, size: int) -> Iterator[list[dict]]:
    pa = _pyarrow(path)
    for name in arrow_files(path):
        try:
            with pa.memory_map(name) as source:  # the pages are the page cache's: a batch at a time in memory
                for batch in pa.ipc.open_stream(source):
                    for first in range(0, batch.num_rows, size):
                        yield batch.slice(first, size).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{name}: not a readable Arrow stream file (as datasets' save_to_disk writes): "
                            f"{_first_line(exc)}") from None


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
