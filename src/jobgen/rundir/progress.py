"""Live progress for a person watching a job: `jobgen logs -f` and `jobgen submit --scheduler local`.

The job's log lines pass through as they are. The trainer's progress (each line of
metrics.jsonl: step of total, loss, tokens/s, time left) is shown by the reader, not written
into any log: on a terminal as one line at the bottom, redrawn in place (carriage return) under
the log lines; elsewhere (a file, a pipe) as a plain `jobgen: step ...` line per record. The
trainer's own step lines in a node or rank log are plain lines too; on a terminal they are
folded into the updating line instead of scrolling.
"""

from __future__ import annotations

import codecs
import os
import re
import selectors
import subprocess
import time
from pathlib import Path
from typing import Optional, TextIO

from jobgen.rundir.metrics import JsonlTail, output_dir
from jobgen.rundir.files import METRICS_FILE
from jobgen.rundir.metrics import describe_progress, last_record

POLL_SECONDS = 0.5
TRAINER_STEP_LINE = re.compile(r"\] INFO step \d+(/\d+)?  ")
# How a segment ends for good; after any other end (preempted, time limit) the job may come back.
FINAL_OUTCOMES = {"completed", "failed", "restarts_exhausted"}
CLEAR_LINE = "\r\x1b[K"


class Display:
    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.status = ""  # the progress line shown at the bottom of a terminal
        self.partial = ""

    def text(self, data: str) -> None:
        """Log output, in pieces as it arrives: whole lines are shown, the rest waits."""
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        if not lines:
            return
        if self.tty:
            lines = [line for line in lines if not TRAINER_STEP_LINE.search(line)]
            if not lines:
                return
            self.out.write(CLEAR_LINE)
        self.out.write("".join(line + "\n" for line in lines))
        self._redraw()

    def progress(self, record: dict) -> None:
        line = describe_progress(record)
        if not self.tty:
            self.out.write(f"jobgen: {line}\n")
            self.out.flush()
            return
        self.status = line
        self._redraw()

    def close(self) -> None:
        if self.partial:
            self.text("\n")
        if self.tty and self.status:
            self.out.write("\n")  # the last progress stays on screen
            self.status = ""
        self.out.flush()

    def _redraw(self) -> None:
        if self.tty and self.status:
            try:
                columns = os.get_terminal_size(self.out.fileno()).columns  # this stream's terminal
            except (OSError, ValueError):
                columns = 0
            width = (columns or 80) - 1  # a terminal that reports no size (0) gets 80
            self.out.write(CLEAR_LINE + self.status[:width])  # never wider: a wrapped line is not redrawn
        self.out.flush()


def watch_process(process: "subprocess.Popen[bytes]", run_path: Path, out: TextIO) -> None:
    """Until `process` (whose stdout is a pipe) ends: its output, and the run's progress.

    Ctrl-C reaches the job's processes too (one terminal group): the job checkpoints and stops,
    and this goes on showing its output until it has."""
    display = Display(out, out.isatty())
    tail = JsonlTail(output_dir(run_path) / METRICS_FILE, from_end=True)
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
    open_pipe = True
    while open_pipe:
        try:
            for _ in selector.select(POLL_SECONDS):
                data = process.stdout.read1(65536)  # type: ignore[union-attr]
                if not data:
                    open_pipe = False
                display.text(decoder.decode(data, final=not data))
            for record in tail.new_records():
                display.progress(record)
        except KeyboardInterrupt:
            continue
    for record in tail.new_records():
        display.progress(record)
    display.close()
    process.wait()


def follow_log(target: str, node: Optional[int], rank: Optional[int], out: TextIO) -> None:
    """`jobgen logs -f`: the log from its start, then as it grows, until the job has ended for
    good (or Ctrl-C). The log is looked up again at each new segment (a PBS continuation runs
    under a new job id). Progress is drawn on a terminal; as plain lines only in the batch log,
    which has no trainer lines of its own."""
    from jobgen.rundir.logs import current_log_path, events_of
    from jobgen.rundir.run import find_target

    run, named = find_target(target)  # a job id follows that job (and its continuations)
    submissions = [entry for entry in run.submissions() if named is None or entry.get("job_id") == named]
    foreground = bool(submissions) and submissions[-1].get("scheduler") == "local"
    display = Display(out, out.isatty())
    metrics_path = output_dir(run.path) / METRICS_FILE
    tail = JsonlTail(metrics_path, from_end=True)
    if display.tty and (newest := last_record(metrics_path)):
        display.progress(newest)
    show_progress = display.tty or (node is None and rank is None)
    path, offset = current_log_path(target, node, rank), 0
    ended_at = None
    try:
        while True:
            offset = _show_new_text(path, offset, display)
            for record in tail.new_records():
                if show_progress:
                    display.progress(record)
            every = run.segments()
            events = events_of(run, named, every)
            last = events[-1] if events else {}
            # A named job that a later submission's job followed into this run directory is over.
            superseded = bool(events) and events[-1] is not every[-1]
            if last.get("event") == "start" and not superseded and (current := current_log_path(target, node, rank)) != path:
                _show_new_text(path, offset, display)
                path, offset = current, 0
            elif superseded or (last.get("event") == "end" and (foreground or last.get("outcome") in FINAL_OUTCOMES)):
                if ended_at is not None and time.time() - ended_at >= 1:
                    _show_new_text(path, offset, display)  # the script's last lines follow its end record
                    break
                ended_at = ended_at or time.time()
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        pass
    display.close()


def _show_new_text(path: Path, offset: int, display: Display) -> int:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return offset
    data = data[: data.rfind(b"\n") + 1]  # whole lines, so no character is cut in two
    display.text(data.decode(errors="replace"))
    return offset + len(data)
