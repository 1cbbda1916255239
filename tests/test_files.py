"""jobgen.files: the atomic writes that run directories, checkpoints and exit reports rely on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.train.exit_report import write_json_atomically


def test_writers_with_one_pid_never_mix_their_texts(tmp_path: Path) -> None:
    """Threads share a pid, as processes on two nodes can: each write is whole and none fails."""
    target = tmp_path / "state.json"
    texts = [str(n) * 200_000 for n in range(4)]
    errors: list[BaseException] = []

    def writer(text: str) -> None:
        try:
            for _ in range(25):
                write_atomic(target, text)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    seen = set()
    while any(thread.is_alive() for thread in threads):
        if target.exists():
            seen.add(target.read_text())
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert seen <= set(texts) and target.read_text() in texts
    assert os.listdir(tmp_path) == ["state.json"]  # no temporary file left behind


def test_a_write_that_fails_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    write_json_atomically(str(folder / "report.json"), {"step": 3})
    assert (folder / "report.json").read_text() == '{\n  "step": 3\n}\n'
    assert oct((folder / "report.json").stat().st_mode & 0o777) == "0o644"
    with pytest.raises(JobgenError, match=r"^cannot write .*missing/state.json: No such file or directory$"):
        write_atomic(folder / "missing" / "state.json", "x")
    assert os.listdir(folder) == ["report.json"]
