"""`jobgen plot` of a real run stopped with Ctrl-C and resumed (tests/local_run.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from tests.helpers import jobgen
from tests.local_run import STEPS


def test_plot_draws_every_segment_with_its_end_and_the_goodput(stopped_and_resumed_run, tmp_path) -> None:
    run_dir = stopped_and_resumed_run.run_dir
    picture, data_file = tmp_path / "run.png", tmp_path / "run.json"
    result = jobgen("plot", str(run_dir), "-o", str(picture), "--data", str(data_file))
    assert result.returncode == 0, result.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000
    data = json.loads(data_file.read_text())
    status = json.loads(jobgen("status", "--json", str(run_dir)).stdout)
    # Every segment `jobgen status` knows, with how it ended: stopped by Ctrl-C, then completed.
    assert [s["outcome"] for s in data["segments"]] == [s["outcome"] for s in status["segments"]]
    assert len(data["segments"]) == 2 and data["segments"][-1]["outcome"] == "completed"
    assert data["segments"][0]["outcome"] not in ("completed", "failed", "running or lost")
    assert data["goodput"] == status["goodput"] and 0 < data["goodput"] < 1
    # `jobgen status` also says where each segment's time to its first new step went.
    phases = {"imports", "process group", "model load", "deepspeed init", "checkpoint load", "first step"}
    assert all(s["startup_seconds"] > 0 and phases <= set(s["startup"]) for s in status["segments"]), status["segments"]
    # The restart's cost, drawn under it: status's figures, its start-up among them.
    assert data["interruptions"] == status["interruptions"] and len(data["interruptions"]) == 1
    (restart,) = data["interruptions"]
    assert restart["steps_trained_again"] == 0 and restart["seconds_to_first_new_step"] > 0
    assert restart["start_up_seconds"] == status["segments"][1]["startup_seconds"]
    # The curves: the first segment's steps, then the second's from where it resumed to the end.
    first, second = data["segments"]
    assert first["steps"][0] == 1 and second["steps"][0] == second["first_step"] + 1 and second["steps"][-1] == STEPS
    assert all(isinstance(v, float) for s in data["segments"] for v in s["loss"] + s["tokens_per_s"])
    # What `jobgen status` says beside the segments: the trainer's line on each (the newest report is
    # kept), the last loss, and where the LoRA adapter is.
    assert status["segments"][-1]["message"] == f"completed {STEPS} steps; final model in {run_dir / 'output' / 'final'}"
    assert (status["step"], status["last_loss"]) == (STEPS, second["loss"][-1])
    assert status["final_model"] == {"path": str(run_dir / "output" / "final"), "kind": "adapter", "method": "lora"}


def test_plot_gives_each_record_to_its_segment_when_the_next_starts_in_the_same_second(stopped_and_resumed_run, tmp_path) -> None:
    """Segment starts are recorded to the whole second: the run again, with the second segment's
    start moved into the second of the first segment's last record (as on a quiet machine)."""
    run_dir = tmp_path / "stop-resume"
    shutil.copytree(stopped_and_resumed_run.run_dir, run_dir, symlinks=True)
    records = [json.loads(line) for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    events = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()]
    second_job = [e for e in events if e["event"] == "start"][1]["job_id"]
    last_of_first = [r for r in records if r["time"] < min(r["time"] for r in records if r["job_id"] == second_job)][-1]
    same_second = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(last_of_first["time"])))
    for event in events:
        if event["job_id"] == second_job:
            event["started_at"] = same_second
    (run_dir / "segments.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    result = jobgen("plot", str(run_dir), "-o", str(tmp_path / "run.png"), "--data", str(tmp_path / "run.json"))
    assert result.returncode == 0, result.stderr
    first, second = json.loads((tmp_path / "run.json").read_text())["segments"]
    assert first["started_at"] < second["started_at"] == same_second
    assert first["steps"] == list(range(1, first["last_step"] + 1)) and first["steps"][-1] == last_of_first["step"]
    assert second["steps"] == list(range(second["first_step"] + 1, STEPS + 1))


def test_plot_without_matplotlib_says_how_to_install_it_in_one_line(stopped_and_resumed_run, tmp_path) -> None:
    # matplotlib is installed here: hide it from this one process, as on a machine without it.
    hide = "import sys; sys.modules['matplotlib'] = None; from jobgen.cli import main; sys.argv[0] = 'jobgen'; main()"
    result = subprocess.run([sys.executable, "-c", hide, "plot", str(stopped_and_resumed_run.run_dir), "-o", str(tmp_path / "x.png")],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "jobgen: error: jobgen plot needs matplotlib: pip install 'jobgen[plot]' (or pip install matplotlib)\n"
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_its_files_as_render_does(stopped_and_resumed_run, tmp_path) -> None:
    """-o and --data go through the one writer every -o uses (jobgen.files.write_output): a
    symlink's target is written and the link kept; a folder is one line, not a usage text."""
    (tmp_path / "pictures").mkdir()
    link = tmp_path / "run.png"
    link.symlink_to("pictures/run.png")
    result = jobgen("plot", str(stopped_and_resumed_run.run_dir), "-o", str(link))
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and (tmp_path / "pictures" / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = jobgen("plot", str(stopped_and_resumed_run.run_dir), "-o", str(tmp_path / "pictures"))
    assert result.returncode == 2
    assert result.stderr == f"jobgen: error: cannot write {tmp_path / 'pictures'}: it is a folder; name a file in it\n"
