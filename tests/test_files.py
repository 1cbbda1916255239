"""jobgen.files: the atomic writes that run directories, checkpoints and exit reports rely on."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from jobgen.errors import JobgenError
from jobgen.files import write_atomic
from jobgen.train.exit_report import write_json_atomically
from tests.helpers import REPO, cannot_run, jobgen


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


# Every -o of every command writes through jobgen.files.write_output: what the path is decides how.
def _render_to(output: Path) -> str:
    result = jobgen("render", "-s", "slurm", "configs/examples/cpu-debug-2node.yaml", "-o", str(output), cwd=REPO)
    assert result.returncode == 0, result.stderr
    return jobgen("render", "-s", "slurm", "configs/examples/cpu-debug-2node.yaml", cwd=REPO).stdout


def test_render_to_a_device_writes_to_it_and_leaves_the_device(tmp_path: Path) -> None:
    """`jobgen render JOB -o /dev/null`, on a copy of /dev/null: replacing it by a regular file, as
    root, broke every other user's jobs on that machine."""
    if os.geteuid() != 0:
        cannot_run("mknod of a copy of /dev/null needs root")
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    _render_to(null)
    assert stat.S_ISCHR(null.stat().st_mode) and null.stat().st_rdev == os.stat("/dev/null").st_rdev
    assert os.listdir(tmp_path) == ["null"]


def test_render_to_a_fifo_writes_through_it(tmp_path: Path) -> None:
    fifo = tmp_path / "script.pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    expected = _render_to(fifo)
    reader.join(timeout=30)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert received == [expected.encode()]


def test_render_to_a_symlink_writes_its_target_and_keeps_the_link(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    target = tmp_path / "scripts" / "job.sbatch"
    target.write_text("old\n")
    link = tmp_path / "job.sbatch"
    link.symlink_to("scripts/job.sbatch")
    expected = _render_to(link)
    assert link.is_symlink() and os.readlink(link) == "scripts/job.sbatch"
    assert target.read_text() == expected


def test_render_to_a_folder_is_one_line(tmp_path: Path) -> None:
    result = jobgen("render", "-s", "slurm", "configs/examples/cpu-debug-2node.yaml", "-o", str(tmp_path), cwd=REPO)
    assert result.returncode == 2
    assert result.stderr.endswith(f"jobgen: error: cannot write {tmp_path}: it is a folder; name a file in it\n"), result.stderr
