"""What a run came to, beyond its segments' start and end records: the trainer's one line on its
segment (RUN_DIR/trainer-exit.json: why it failed, or what it completed), the last logged loss,
where the final model or adapter is, and a probe's result. Read by `jobgen status` and `jobgen runs`.
"""

from __future__ import annotations

import glob
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from jobgen.rundir import files as runfiles
from jobgen.rundir.metrics import last_eval, last_metrics, output_dir
from jobgen.rundir.run import RunDir

PROBE = "jobgen-probe"


def trainer_report(run: RunDir) -> Optional[dict[str, Any]]:
    """RUN_DIR/trainer-exit.json, written by rank 0 at the end of each segment and removed by the
    batch script when the next one starts: the newest segment's, if its trainer got that far."""
    try:
        found = json.loads((run.path / runfiles.TRAINER_EXIT).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def attach_messages(segments: list[dict[str, Any]], run: RunDir) -> list[dict[str, Any]]:
    """Each segment's `message`: the trainer's one line, for the segment the report is about
    (None for the others: each segment's report replaces the one before)."""
    for segment in segments:
        segment["message"] = None
    report = trainer_report(run)
    mine = _segment_of(report, segments) if report else None
    if mine is not None and isinstance(report.get("message"), str) and report["message"]:
        mine["message"] = report["message"]
    return segments


# What a node says of itself when it ends before its program starts (node.sh: a command not on
# PATH, a module that does not load): "jobgen: node N (HOST): ...". Its one other line of that
# shape only says which interface its sockets use.
NODE_SAYS = re.compile(r"^jobgen: (node \d+ \([^)]*\): .*)$")


def node_line(run: RunDir, job_id: str) -> Optional[str]:
    """The last thing a node of job `job_id` said of itself before its program started, where one
    did (its log, RUN_DIR/logs/JOBID-nodeK.out); None where none did."""
    found = None
    for log in sorted((run.path / runfiles.LOGS).glob(f"{glob.escape(job_id)}-node*.out")):
        try:
            lines = _tail(log).splitlines()  # its end: the lines before it stopped (a node log may be large)
        except OSError:
            continue
        for line in lines:
            said = NODE_SAYS.match(line)
            if said and "sockets on" not in line:
                found = said.group(1)
    return found


def _segment_of(report: dict[str, Any], segments: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if "restart" in report:  # it names its segment as segments.jsonl does
        key = (str(report.get("job_id")), str(report["restart"]))
        return next((s for s in reversed(segments) if (str(s["job_id"]), str(s["restart"])) == key), None)
    # Written before reports named their segment: the newest, if the trainer started after it did.
    if not segments:
        return None
    try:
        started = datetime.fromisoformat(str(report["started_at"]).replace("Z", "+00:00")).timestamp()
        segment_started = datetime.fromisoformat(segments[-1]["started_at"].replace("Z", "+00:00")).timestamp()
    except (KeyError, TypeError, ValueError):
        return None
    return segments[-1] if started >= segment_started else None


def summary(run: RunDir, segments: list[dict[str, Any]], job: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The run's entrypoint, its newest logged step and loss, its final model, a probe's result.
    `segments` as jobgen.rundir.status pairs them, with their messages attached."""
    job = run.settings() if job is None else job
    launch = job.get("launch") if isinstance(job.get("launch"), dict) else {}
    if launch.get("command"):
        return own_command_summary(run, launch["command"])
    entrypoint = launch.get("entrypoint") or "jobgen-train"
    probe = entrypoint == PROBE
    last = None if probe else last_metrics(run.path, job)  # a probe trains nothing
    return {
        "entrypoint": entrypoint,
        "step": _number(last, "step"),
        "total_steps": _number(last, "total_steps"),
        "last_loss": _number(last, "loss"),
        "last_eval": None if probe else _eval_of(last_eval(run.path, job)),
        "final_model": None if probe else final_model(run, job, segments),
        "best": None if probe else best_checkpoint(run, job, segments),
        "probe": probe_result(run, segments) if probe else None,
    }


OWN_COMMAND = "launch.command"


def own_command_summary(run: RunDir, command: list[Any]) -> dict[str, Any]:
    """summary() for the job's own program: it tells jobgen nothing while it runs, so the step and
    loss are the newest complete checkpoint's (its trainer_state.json log_history, a Hugging Face
    Trainer's), which the batch script names in RUN_DIR/newest-checkpoint at each segment's end."""
    state = own_program_state(run)
    logged = [entry for entry in own_program_history(state) if "loss" in entry]
    last = {"step": state.get("global_step"), "total_steps": state.get("max_steps"),
            "loss": logged[-1]["loss"] if logged else None}
    words = " ".join(str(word) for word in command)
    return {
        "entrypoint": OWN_COMMAND, "step": _number(last, "step"), "total_steps": _number(last, "total_steps"),
        "last_loss": _number(last, "loss"), "last_eval": None, "final_model": None, "best": None, "probe": None,
        "own_command": f"{words if len(words) <= 60 else words[:57] + '...'}: jobgen cannot see its steps while it "
                       "runs; steps and loss are its newest complete checkpoint's (trainer_state.json); no goodput "
                       "or time to the first step",
    }


def own_program_state(run: RunDir) -> dict[str, Any]:
    """The trainer_state.json of the checkpoint RUN_DIR/newest-checkpoint names (the batch script
    writes it at each segment's end); {} when there is none or it cannot be read."""
    try:
        checkpoint = (run.path / runfiles.NEWEST_CHECKPOINT).read_text(encoding="utf-8").strip()
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8")) if checkpoint else {}
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def own_program_history(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A Trainer's log_history: its logged records ({"step", "loss", ...}, {"step", "eval_loss"}),
    every segment's up to that checkpoint, as a resumed Trainer carries them on."""
    history = state.get("log_history")
    return [entry for entry in history if isinstance(entry, dict)] if isinstance(history, list) else []


def _eval_of(record: Optional[dict[str, Any]]) -> Optional[dict[str, float]]:
    if record is None or _number(record, "eval_loss") is None:
        return None
    return {"step": _number(record, "step"), "loss": _number(record, "eval_loss"),
            "perplexity": _number(record, "eval_perplexity")}


def final_model(run: RunDir, job: dict[str, Any], segments: list[dict[str, Any]]) -> Optional[dict[str, str]]:
    """Where the trainer saved the final model (full fine-tune) or adapter (LoRA, Q-LoRA) with
    its tokenizer: OUTPUT_DIR/final, once the newest segment completed the run."""
    if not segments or segments[-1]["outcome"] != "completed":
        return None
    path = output_dir(run.path, job) / runfiles.FINAL_MODEL
    if not path.is_dir():
        return None
    training = job.get("training") if isinstance(job.get("training"), dict) else {}
    method = str(training.get("method") or "lora")
    return {"path": str(path), "kind": "model" if method == "full" else "adapter", "method": method}


def best_checkpoint(run: RunDir, job: dict[str, Any], segments: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """training.keep_best: the checkpoint of the lowest eval loss so far, as
    OUTPUT_DIR/checkpoints/best.json names it ({"step", "eval_loss", "checkpoint": its path}), and
    "model": OUTPUT_DIR/best once the newest segment completed the run; None without one."""
    folder = output_dir(run.path, job)
    try:
        pointer = json.loads((folder / runfiles.BEST_CHECKPOINT).read_text(encoding="utf-8"))
        step, loss, name = pointer["step"], pointer["eval_loss"], pointer["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (isinstance(step, int) and isinstance(loss, (int, float)) and isinstance(name, str)):
        return None
    model = folder / runfiles.BEST_MODEL
    completed = bool(segments) and segments[-1]["outcome"] == "completed"
    return {"step": step, "eval_loss": loss, "checkpoint": str(folder / "checkpoints" / name),
            "model": str(model) if completed and model.is_dir() else None}


def probe_result(run: RunDir, segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest probe's outcome and its line: "2 ranks reached each other", or what failed."""
    if not segments:
        return {"outcome": None, "message": "not started yet"}
    last = segments[-1]
    if last["message"]:
        message = last["message"]
    elif last["ended_at"] is None:
        message = "running (or lost)"
    else:
        message = f"the probe left no report: see {run.path / runfiles.LOGS}/{last['job_id']}*.out"
    return {"outcome": last["outcome"], "message": message}


def _tail(path: Path, size: int = 65536) -> str:
    with path.open("rb") as handle:
        handle.seek(max(0, handle.seek(0, 2) - size))
        return handle.read().decode(errors="replace")


def failure_lines(run_dir: str, segments: list[dict[str, Any]], own_program: bool = False) -> list[str]:
    """One line per failed segment: the trainer's reason, a node's own, or where to read it."""
    lines = []
    for segment in segments:
        if segment["outcome"] != "failed":
            continue
        if own_program:  # it writes no report: its own output is where it says why
            where = f"the program's output is in {run_dir}/{runfiles.node_log(segment['job_id'], '*')}"
        else:
            where = f"the trainer's report is gone or was never written: see {run_dir}/{runfiles.batch_log(segment['job_id'])}"
        # Without the trainer's line, the node's own, where one ended before its program started:
        # read here, where it is shown, not for every reader of the segments (`jobgen runs`).
        reason = segment.get("message") or node_line(RunDir(Path(run_dir)), str(segment["job_id"])) or where
        lines.append(f"job {segment['job_id']} restart {segment['restart']} failed: {reason}")
    return lines


def format_lines(report: dict[str, Any]) -> list[str]:
    """What `jobgen status` prints under the segments: failures, the last loss, the final model,
    or a probe's result."""
    lines = failure_lines(report["run_dir"], report["segments"], bool(report.get("own_command"))) if report.get("probe") is None else []
    if report.get("own_command"):
        lines.append(f"own program ({OWN_COMMAND}) {report['own_command']}")
    if report.get("step") is not None:
        total = f"/{int(report['total_steps'])}" if report.get("total_steps") is not None else ""
        loss = f"loss {report['last_loss']:.4f} at " if report.get("last_loss") is not None else ""
        lines.append(f"last {loss}step {int(report['step'])}{total}")
    evaluated = report.get("last_eval")
    if evaluated and evaluated.get("step") is not None:
        perplexity = f", perplexity {evaluated['perplexity']:.2f}" if evaluated.get("perplexity") is not None else ""
        lines.append(f"last eval loss {evaluated['loss']:.4f}{perplexity} at step {int(evaluated['step'])}")
    if report.get("final_model"):
        final = report["final_model"]
        lines.append(f"final {final['kind']} ({final['method']}): {final['path']}")
    best = report.get("best")
    if best:
        where = best["model"] or best["checkpoint"]
        kind = f"{report['final_model']['kind']} " if best["model"] and report.get("final_model") else ""
        lines.append(f"best {kind}(eval loss {best['eval_loss']:.4f} at step {best['step']}): {where}")
    if report.get("probe"):
        lines.append(f"probe: {report['probe']['message']}")
    return lines


def _number(record: Optional[dict[str, Any]], key: str) -> Optional[float]:
    value = (record or {}).get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
