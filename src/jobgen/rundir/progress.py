"""Live progress for a person watching a job: `jobgen logs -f` and `jobgen submit --scheduler local`.

The job's log lines pass through as they are. The trainer's progress (each line of
metrics.jsonl: step of total, loss, tokens/s, time left) is shown by the reader, not written
into any log: on a terminal as one line at the bottom, redrawn in place (carriage return) under
the log lines; elsewhere (a file, a pipe) as a plain `jobgen: step ...` line per record. The
trainer's own step lines in a node or rank log are plain lines too; on a terminal they are
folded into the updating line instead of scrolling. While `jobgen submit` shows a job it runs
itself, a stop jobgen is sent is passed on to the job (StopRequests).
"""

from __future__ import annotations

import codecs
import io
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from jobgen.rundir.metrics import JsonlTail, output_dir
from jobgen.rundir.files import METRICS_FILE
from jobgen.rundir.metrics import describe_progress, last_record

POLL_SECONDS = 0.5
TRAINER_STEP_LINE = re.compile(r"\] INFO step \d+(/\d+)?  ")
# How a segment ends for good; after any other end (preempted, time limit) the job may come back.
FINAL_OUTCOMES = {"completed", "failed", "restarts_exhausted", "restart_storm"}
CLEAR_LINE = "\r\x1b[K"


class Display:
    """What a person watching sees. On a terminal the progress line stays at the bottom: every
    other line, the job's or jobgen's own (sys.stderr, see `above`), is printed above it (clear
    it, print the line, redraw), so no redraw erases a message. A terminal that went away (SIGHUP)
    is no longer written; the job's output is still read to its end."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out, self.tty = out, tty
        self.status = ""  # the progress line shown at the bottom of a terminal
        self.partial = ""
        self.gone = False

    def text(self, data: str) -> None:
        """Log output, in pieces as it arrives: whole lines are shown, the rest waits."""
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        if self.tty:
            lines = [line for line in lines if not TRAINER_STEP_LINE.search(line)]
        self.lines(lines)

    def lines(self, lines: list[str]) -> None:
        """Whole lines, shown above the progress line."""
        if lines:
            self._write((CLEAR_LINE if self.tty else "") + "".join(line + "\n" for line in lines))
            self._redraw()

    def progress(self, record: dict) -> None:
        line = describe_progress(record)
        if not self.tty:
            self._write(f"jobgen: {line}\n")
            return
        self.status = line
        self._redraw()

    def close(self) -> None:
        if self.partial:
            self.text("\n")
        if self.tty and self.status:
            self._write("\n")  # the last progress stays on screen
            self.status = ""

    @contextmanager
    def above(self) -> Iterator[None]:
        """While shown: what jobgen itself writes to a terminal's sys.stdout or sys.stderr (a
        warning, a stop it was sent) is printed above the progress line, not over it."""
        if not self.tty:
            yield
            return
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = (_LinesAbove(self) if stream.isatty() else stream for stream in saved)
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, _LinesAbove):
                    stream.finish()
            sys.stdout, sys.stderr = saved

    def _redraw(self) -> None:
        if self.tty and self.status:
            try:
                columns = os.get_terminal_size(self.out.fileno()).columns  # this stream's terminal
            except (OSError, ValueError):
                columns = 0
            width = (columns or 80) - 1  # a terminal that reports no size (0) gets 80
            self._write(CLEAR_LINE + self.status[:width])  # never wider: a wrapped line is not redrawn

    def _write(self, text: str) -> None:
        if self.gone:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except OSError:  # the terminal closed (EIO) or the reader of a pipe left (EPIPE)
            self.gone = True


class _LinesAbove(io.TextIOBase):
    """sys.stdout or sys.stderr while a Display shows progress: whole lines go above it."""

    def __init__(self, display: Display) -> None:
        self.display, self.partial = display, ""

    def write(self, text: str) -> int:
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()
        self.display.lines(lines)
        return len(text)

    def finish(self) -> None:
        if self.partial:
            self.display.lines([self.partial])
            self.partial = ""

    def isatty(self) -> bool:
        return True


class StopRequests:
    """While `jobgen submit` runs a job in its foreground: however jobgen is asked to end (Ctrl-C,
    `kill -INT` or `-TERM` of it alone, its terminal closing), the job is asked to stop (its
    script traps the signal: every rank checkpoints at the next step boundary) and jobgen waits
    for it, so a job never outlives the jobgen that shows it. The script runs in a session of its
    own (jobgen.schedulers.local), so this is the one way a stop reaches it: once. It gets the
    signal jobgen got, so that both say the same word (interrupted for SIGINT, terminated for
    SIGTERM); SIGHUP, which the script does not trap, as SIGTERM.

    The handlers only record and forward; what to say is printed by the watching loop, for a
    handler that wrote to the screen could run in the middle of another write to it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hangup"}  # as job.sh.j2 says them
    FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}

    def __init__(self) -> None:
        self.process: Optional["subprocess.Popen[bytes]"] = None
        self.received: list[int] = []
        self.told = 0
        self.forwarded = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequests":
        self.previous = {number: signal.signal(number, self._received) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def watching(self, process: "subprocess.Popen[bytes]") -> None:
        """The job's script, started: a stop asked for before it was is passed on now."""
        self.process = process
        self._forward()

    def news(self) -> list[str]:
        """A line for each signal received since the last call."""
        first = self.told
        new, self.told = self.received[first:], len(self.received)
        lines = []
        for i, number in enumerate(new, start=first):
            said = f"{self.WORDS.get(number, 'stopped')} ({signal.Signals(number).name})"
            lines.append(f"jobgen: {said}: stopping the job; waiting for its checkpoint" if i == 0
                         else f"jobgen: {said}: still waiting for the job to checkpoint and stop")
        return lines

    def _received(self, number: int, frame: object) -> None:
        self.received.append(number)
        self._forward()

    def _forward(self) -> None:
        if self.received and self.process is not None and not self.forwarded:
            self.forwarded = True
            try:
                os.kill(self.process.pid, self.FORWARDED.get(self.received[0], signal.SIGINT))
            except ProcessLookupError:
                pass  # it has ended already


def watch_process(process: "subprocess.Popen[bytes]", run_path: Path, out: TextIO, stops: StopRequests,
                  node_log: Optional[Path] = None) -> None:
    """Until `process` (whose stdout is a pipe) ends: its output, and the run's progress; a stop
    jobgen is asked for is passed on to it (StopRequests), and its output read to the end. With
    `node_log`, that log's new lines too (the job's own program writes no progress of jobgen's:
    its node 0's output is what there is to see)."""
    stops.watching(process)
    node_offset = 0
    display = Display(out, out.isatty())
    tail = JsonlTail(output_dir(run_path) / METRICS_FILE, from_end=True)
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span two reads
    open_pipe = True
    with display.above():
        while open_pipe:
            display.lines(stops.news())
            for _ in selector.select(POLL_SECONDS):
                # A stop jobgen was sent, told before the job's answer to it (read now).
                display.lines(stops.news())
                data = process.stdout.read1(65536)  # type: ignore[union-attr]
                if not data:
                    open_pipe = False
                display.text(decoder.decode(data, final=not data))
            if node_log is not None:
                node_offset = _show_new_text(node_log, node_offset, display)
            for record in tail.new_records():
                display.progress(record)
        if node_log is not None:
            _show_new_text(node_log, node_offset, display)
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
