"""Live progress of a real local run (tests/local_run.py): on a terminal, one line redrawn in
place; in a pipe (`jobgen submit` and `jobgen logs -f`), plain lines; the log files stay plain."""

from __future__ import annotations

import re

from tests.local_run import STEPS, STOP_AFTER_STEP

PROGRESS = re.compile(rf"step (\d+)/{STEPS}  loss \d+\.\d{{4}}  [\d,]+ tokens/s  \d+:\d\d left")


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: a carriage return goes back to the line's start and
    ESC[K clears the rest of it, so only what was drawn last on a line stays."""
    lines = [line.split("\r")[-1].replace("\x1b[K", "") for line in raw.replace("\r\n", "\n").split("\n")]
    return [line for line in lines if line]


def progress_steps(text: str) -> list[int]:
    return [int(m.group(1)) for m in map(PROGRESS.search, text.splitlines()) if m]


def test_on_a_terminal_the_progress_is_one_line_redrawn_in_place(stopped_and_resumed_run) -> None:
    raw = stopped_and_resumed_run.terminal
    assert "\r\x1b[K" in raw  # redrawn, not scrolled
    shown = screen(raw)
    progress = [line for line in shown if PROGRESS.search(line)]
    assert len(progress) == 1, shown  # one line, left showing the last step before the stop
    assert int(PROGRESS.search(progress[0]).group(1)) >= STOP_AFTER_STEP
    assert not any("INFO step" in line for line in shown)  # the trainer's step lines do not scroll past
    assert any("asking every rank to checkpoint" in line for line in shown), shown  # Ctrl-C's effect, told
    # jobgen's own lines (here: the stop it was sent) are printed above the progress line too.
    assert any(line == "jobgen: interrupted (SIGINT): stopping the job; waiting for its checkpoint" for line in shown), shown


def test_ctrl_c_is_told_as_interrupted_sigint_from_the_first_line_to_the_outcome(stopped_and_resumed_run) -> None:
    """jobgen's line first, then the job's answer and its end, all in one word; `jobgen status` records it."""
    import json

    from tests.helpers import jobgen

    said = [line for line in screen(stopped_and_resumed_run.terminal) if line.startswith("jobgen: ")]
    told = said.index("jobgen: interrupted (SIGINT): stopping the job; waiting for its checkpoint")
    asked = said.index("jobgen: interrupted (SIGINT): asking every rank to checkpoint at the next step boundary and stop")
    assert told < asked, said
    assert any(line.startswith("jobgen: stopped (interrupted) with a complete checkpoint at step ") for line in said), said
    assert not any("terminated" in line for line in said), said
    segments = json.loads(jobgen("status", "--json", str(stopped_and_resumed_run.run_dir)).stdout)["segments"]
    assert [s["outcome"] for s in segments] == ["interrupted", "completed"]


def test_in_a_pipe_submit_and_logs_follow_print_plain_progress_lines(stopped_and_resumed_run) -> None:
    for text in (stopped_and_resumed_run.submit_piped, stopped_and_resumed_run.follow_piped):
        assert "\r" not in text and "\x1b" not in text
        steps = progress_steps(text)
        assert steps and steps == sorted(steps) and steps[-1] == STEPS, text
        assert all(line.startswith("jobgen: step ") for line in text.splitlines() if PROGRESS.search(line))
        assert f"jobgen: training completed at step {STEPS}" in text


def test_the_log_files_stay_plain(stopped_and_resumed_run) -> None:
    logs = {path.name: path.read_text() for path in (stopped_and_resumed_run.run_dir / "logs").rglob("*") if path.is_file()}
    node0 = "".join(text for name, text in sorted(logs.items()) if name.endswith("-node0.out"))
    assert re.search(rf"\[jobgen-train rank 0\] INFO step {STEPS}/{STEPS}  loss \d+\.\d{{4}}  [\d,]+ tokens/s  0:00 left", node0)
    assert not any("\x1b[K" in text for text in logs.values())  # the updating line is the reader's alone
