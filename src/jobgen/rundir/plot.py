"""`jobgen plot`: a picture of a run. Above, the loss and tokens/s over the optimizer steps with
each segment's start marked; below, the segments on a wall-clock timeline, each with how it ended
(preempted, time limit, completed, ...) and the run's goodput as `jobgen status` computes it.
For the job's own program (launch.command) the loss is its Trainer's log_history, as `jobgen
status` reads it, and the goodput "n/a": jobgen does not see its training time.

matplotlib is an optional extra (`pip install 'jobgen[plot]'`): the data is gathered without it
(`plot_data`, also written by `--data`), and only drawing needs it.

A sweep's folder draws every point's loss curve in one picture, labelled by its values (`plot_sweep`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional

from jobgen.errors import JobgenError
from jobgen.files import write_output
from jobgen.rundir.run import find_run
from jobgen.rundir.metrics import metrics
from jobgen.rundir import cost
from jobgen.rundir.status import KILLED, _epoch, attach_startups, goodput, killed_from_metrics, pair_segments

OUTCOME_COLOURS = {"completed": "tab:green", "preempted": "tab:orange", "time_limit": "tab:purple",
                   "failed": "tab:red", "running or lost": "tab:gray", KILLED: "tab:brown"}


def plot_data(target: str) -> dict[str, Any]:
    """Every segment (its end reason, times, steps, and the metrics it logged) and the goodput."""
    run = find_run(target)
    segments = killed_from_metrics(pair_segments(run.segments()), run.path)
    if not segments:
        raise JobgenError(f"{run.path} has no segment yet: nothing to plot")
    starts = [_epoch(s["started_at"]) for s in segments]
    settings = run.settings()
    launch = settings.get("launch") if isinstance(settings.get("launch"), dict) else {}
    own = bool(launch.get("command"))
    records = [] if own else metrics(run.path)
    mine_of = own_program_records(segments, run) if own else records_by_segment(segments, records)
    entries = []
    for i, segment in enumerate(segments):
        mine = mine_of[i]
        trained = [r for r in mine if "loss" in r]  # not an evaluation logged alone on resuming
        ended = _epoch(segment["ended_at"]) if segment["ended_at"] else None
        entries.append({
            "job_id": segment["job_id"], "restart": segment["restart"], "outcome": segment["outcome"],
            "started_at": segment["started_at"], "ended_at": segment["ended_at"],
            "held_seconds": None if ended is None else ended - starts[i], "train_seconds": segment["train_seconds"],
            "first_step": segment["first_step"], "last_step": segment["last_step"],
            "steps": [r["step"] for r in trained], "loss": [r["loss"] for r in trained],
            "tokens_per_s": [r.get("tokens_per_s") for r in trained],
            "eval": [[r["step"], r["eval_loss"]] for r in mine if isinstance(r.get("eval_loss"), (int, float))],
        })
    if own:  # its training time is the program's own: jobgen sees only how long the nodes were held
        return {"run_dir": str(run.path), "goodput": None, "goodput_unknown": OWN_GOODPUT, "segments": entries}
    # What each restart cost, as `jobgen status` says it: steps trained again, seconds and where they went.
    lost = cost.interruptions(attach_startups(segments, run.path), records)
    return {"run_dir": str(run.path), "goodput": goodput(segments), "segments": entries, "interruptions": lost}


OWN_GOODPUT = "n/a: an own program (launch.command) tells jobgen no training time"


def own_program_records(segments: list[dict[str, Any]], run) -> list[list[dict[str, Any]]]:
    """Each segment's records for the job's own program: the Trainer's log_history in its newest
    complete checkpoint (jobgen.rundir.outcome), a record to the segment whose steps hold it
    (after its first step, up to its last checkpoint's); steps trained after a segment's last
    checkpoint were lost with it and are not in the history."""
    from jobgen.rundir.outcome import own_program_history, own_program_state

    def step_of(value: Any) -> int:
        return value if isinstance(value, int) else 0  # none yet: before the first checkpoint

    found: list[list[dict[str, Any]]] = [[] for _ in segments]
    for record in own_program_history(own_program_state(run)):
        step = record.get("step")
        if not isinstance(step, int):
            continue
        i = next((i for i in reversed(range(len(segments)))
                  if step_of(segments[i]["first_step"]) < step <= step_of(segments[i]["last_step"])), None)
        if i is not None:
            found[i].append(record)
    return found


def records_by_segment(segments: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each segment's metrics records, in order. A record names the segment that wrote it (its
    job id and restart count, as segments.jsonl does); one written before records did goes by
    time, to the segment whose start precedes it, which a start recorded to the whole second may
    get wrong when the next segment starts in the second of a record."""
    index = {(str(s["job_id"]), str(s["restart"])): i for i, s in enumerate(segments)}
    starts = [_epoch(s["started_at"]) for s in segments]
    found: list[list[dict[str, Any]]] = [[] for _ in segments]
    for record in records:
        if "restart" in record:
            i = index.get((str(record.get("job_id")), str(record["restart"])))
        elif isinstance(record.get("time"), (int, float)):
            i = next((i for i in reversed(range(len(starts))) if starts[i] <= record["time"]), None)
        else:
            i = None
        if i is not None:
            found[i].append(record)
    return found


def draw(data: dict[str, Any]) -> bytes:
    """The run's picture, as PNG."""
    try:
        import matplotlib
    except ImportError:
        raise JobgenError("jobgen plot needs matplotlib: pip install 'jobgen[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display needed on a login node
    import matplotlib.pyplot as plt

    figure, (curves, timeline) = plt.subplots(2, 1, figsize=(10, 6.5), gridspec_kw={"height_ratios": [3, 1.2]})
    speed = curves.twinx()
    for i, segment in enumerate(data["segments"]):
        label = {"loss": "loss", "speed": "tokens/s"} if i == 0 else {"loss": None, "speed": None}
        curves.plot(segment["steps"], segment["loss"], color="tab:blue", label=label["loss"])
        speed.plot(segment["steps"], segment["tokens_per_s"], color="tab:orange", alpha=0.5, label=label["speed"])
        if segment.get("eval"):  # the held-out loss, where the run evaluates
            steps, losses = zip(*segment["eval"])
            curves.plot(steps, losses, color="tab:green", marker="o", label="eval loss" if i == 0 else None)
        start = segment["first_step"] if segment["first_step"] is not None else (segment["steps"] or [0])[0]
        curves.axvline(start, color="gray", linestyle="--", linewidth=0.8)
        curves.annotate(f"segment {i + 1}", (start, 1), xycoords=("data", "axes fraction"), fontsize=8,
                        rotation=90, va="top", ha="right", color="gray")
    curves.set_xlabel("optimizer step")
    curves.set_ylabel("loss", color="tab:blue")
    if any(v is not None for segment in data["segments"] for v in segment["tokens_per_s"]):
        speed.set_ylabel("tokens/s", color="tab:orange")
    else:  # an own program's records have no throughput: no empty axis for it
        speed.set_axis_off()
    curves.set_title(Path(data["run_dir"]).name)

    origin = _epoch(data["segments"][0]["started_at"])
    for i, segment in enumerate(data["segments"]):
        left = (_epoch(segment["started_at"]) - origin) / 60
        width = (segment["held_seconds"] or 0) / 60
        colour = OUTCOME_COLOURS.get(segment["outcome"], "tab:brown")
        timeline.barh(0, width, left=left, color=colour, edgecolor="black", height=0.6)
        timeline.annotate(segment["outcome"].replace("_", " "), (left + width / 2, 0), ha="center", va="center", fontsize=8)
    starts = {(str(s["job_id"]), s["restart"]): (_epoch(s["started_at"]) - origin) / 60 for s in data["segments"]}
    for lost in data.get("interruptions") or []:  # under each restart: its steps trained again and seconds
        left = starts.get((str(lost["job_id"]), lost["restart"]))
        if left is None:
            continue
        first = lost["seconds_to_first_new_step"]
        said = f"{lost['steps_trained_again']} step(s) again" + (f", new step after {first:.0f} s" if first is not None else "")
        timeline.annotate(said, (left, -0.45), ha="left", va="top", fontsize=7, color="dimgray")
    timeline.set_ylim(-1, 0.5)
    timeline.set_yticks([])
    timeline.set_xlabel("minutes since the first segment started")
    goodput_value = data["goodput"]
    if data.get("goodput_unknown"):
        timeline.set_title(f"segments; goodput {data['goodput_unknown']}", fontsize=9)
    else:
        timeline.set_title("segments; goodput " + ("-" if goodput_value is None else f"{goodput_value:.1%}")
                           + " (training time / time the finished segments held their nodes)", fontsize=9)
    figure.tight_layout()
    return _png(figure)


def plot(target: str, output: Optional[Path]) -> tuple[Path, dict[str, Any]]:
    data = plot_data(target)
    path = output or Path(data["run_dir"]) / "plot.png"
    write_output(path, draw(data))
    return path, data


def sweep_plot_data(target: str) -> dict[str, Any]:
    """Each point of the sweep in folder `target`: its values and its loss over the optimizer
    steps (a step trained again after a lost segment counts once, as last trained)."""
    from jobgen.rundir.sweep import point_dirs

    points = []
    for point, run in point_dirs(target):
        by_step = {r["step"]: r["loss"] for r in metrics(run.path) if isinstance(r.get("step"), int) and "loss" in r}
        steps = sorted(by_step)
        points.append({"index": point.get("index"), "name": point.get("name"), "values": point.get("values") or {},
                       "run_dir": str(run.path), "steps": steps, "loss": [by_step[s] for s in steps]})
    if not any(p["steps"] for p in points):
        raise JobgenError(f"{target}: no point of the sweep has logged a step yet: nothing to plot")
    return {"sweep": str(Path(target).resolve()), "points": points}


def draw_sweep(data: dict[str, Any]) -> bytes:
    """Every point's loss curve, as PNG."""
    try:
        import matplotlib
    except ImportError:
        raise JobgenError("jobgen plot needs matplotlib: pip install 'jobgen[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, curves = plt.subplots(figsize=(10, 6))
    for point in data["points"]:
        if point["steps"]:
            curves.plot(point["steps"], point["loss"], label=f"{point['index']}: {point['name']}")
    curves.set_xlabel("optimizer step")
    curves.set_ylabel("loss")
    curves.set_title(f"sweep {Path(data['sweep']).name}: {len(data['points'])} points")
    curves.legend(fontsize=8)
    figure.tight_layout()
    return _png(figure)


def plot_sweep(target: str, output: Optional[Path]) -> tuple[Path, dict[str, Any]]:
    data = sweep_plot_data(target)
    path = output or Path(data["sweep"]) / "plot.png"
    write_output(path, draw_sweep(data))
    return path, data


def _png(figure: Any) -> bytes:
    """Drawn in memory, so that jobgen.files.write_output writes the file as every -o is written."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
