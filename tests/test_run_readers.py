"""What `jobgen logs`, `jobgen status` and `jobgen runs` make of a run directory, read back from
records laid out as the batch script, the trainer and `jobgen submit` write them (no job runs
here: tests/test_plot.py, test_pbs_scripts.py and test_launchers.py check them on real runs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobgen.rundir.files import rank_log
from tests.helpers import jobgen


def write_run(run_dir: Path, state: Path, jobs: list[dict], *, nodes: int = 2, procs: int = 2,
              entrypoint: str = "jobgen-train", method: str = "lora", name: str = "demo") -> Path:
    """A run directory with one submission per job in `jobs` (each: id, and its segments as
    (started_at, ended_at or None, outcome, first_step, last_step, restart)), recorded in the
    index under `state` as `jobgen submit` does, and a batch, node and rank log of each job."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    job = {"name": name, "resources": {"nodes": nodes, "gpus_per_node": 0},
           "launch": {"procs_per_node": procs, "entrypoint": entrypoint},
           "training": {"method": method, "output_dir": "output"}}
    (run_dir / "job.yaml").write_text(yaml.safe_dump(job))
    for entry in jobs:
        job_id = entry["id"]
        append(run_dir / "submissions.jsonl", {"job_id": job_id, "scheduler": "local", "submitted_at": "2026-01-01T00:00:00Z"})
        append(state / "jobgen" / "index.jsonl", {"job_id": job_id, "scheduler": "local", "run_dir": str(run_dir),
                                                  "submitted_at": "2026-01-01T00:00:00Z"})
        for started, ended, outcome, first, last, restart in entry.get("segments", []):
            common = {"job_id": job_id, "restart": restart, "started_at": started}
            append(run_dir / "segments.jsonl", {"event": "start", **common, "at": started, "first_step": None,
                                                 "last_step": None, "outcome": "", "train_seconds": None})
            if ended:
                append(run_dir / "segments.jsonl", {"event": "end", **common, "at": ended, "first_step": first,
                                                     "last_step": last, "outcome": outcome, "train_seconds": 30})
        (run_dir / "logs" / f"{job_id}.out").write_text(f"batch log of {job_id}\n")
        for k in range(nodes):
            (run_dir / "logs" / f"{job_id}-node{k}.out").write_text(f"node {k} of {job_id}\n")
        (run_dir / rank_log(job_id, 1)).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rank_log(job_id, 1)).write_text(f"rank 1 of {job_id}\n")
    return run_dir


def append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(record) + "\n")


def trainer_exit(run_dir: Path, reason: str, message: str, job_id: str, restart: int = 0) -> None:
    """RUN_DIR/trainer-exit.json as jobgen.train.exit_report writes it."""
    (run_dir / "trainer-exit.json").write_text(json.dumps({
        "reason": reason, "signal": None, "first_step": 0, "last_step": 0, "checkpoint": None,
        "started_at": "2026-01-01T00:00:10+00:00", "ended_at": "2026-01-01T00:00:50+00:00", "train_seconds": 30.0,
        "message": message, "job_id": job_id, "restart": restart}, indent=2) + "\n")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def env(state: Path) -> dict[str, str]:
    return {"XDG_STATE_HOME": str(state)}


@pytest.fixture
def two_jobs(tmp_path: Path, state: Path) -> Path:
    """One run directory, submitted twice: local-1 ran (and was preempted), then local-2."""
    return write_run(tmp_path / "runs" / "demo", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "preempted", 0, 3, 0)]},
        {"id": "local-2", "segments": [("2026-01-01T01:00:00Z", "2026-01-01T01:01:00Z", "completed", 3, 6, 0)]},
    ])


# --- jobgen logs ----------------------------------------------------------------------------------


def test_logs_of_a_job_id_print_that_jobs_logs_not_the_newest(two_jobs: Path, env: dict) -> None:
    assert jobgen("logs", "local-1", "--batch", env=env).stdout == "batch log of local-1\n"
    assert jobgen("logs", "local-1", "--node", "1", env=env).stdout == "node 1 of local-1\n"
    assert jobgen("logs", "local-1", "--rank", "1", env=env).stdout == "rank 1 of local-1\n"
    # The newest job by its id, or by its run directory, as before.
    assert jobgen("logs", "local-2", "--batch", env=env).stdout == "batch log of local-2\n"
    assert jobgen("logs", str(two_jobs), "--node", "0", env=env).stdout == "node 0 of local-2\n"


def test_logs_show_the_batch_log_then_node_0s_last_lines_where_the_loss_is(two_jobs: Path, env: dict) -> None:
    """The batch log says where the job ran and how it ended; rank 0's step lines (the loss) and a
    failure's traceback are in node 0's log, whose end follows it."""
    node_0 = two_jobs / "logs" / "local-2-node0.out"
    node_0.write_text("".join(f"[jobgen-train rank 0] INFO step {step}/30  loss {3 - step / 10:.4f}\n" for step in range(1, 31)))
    shown = jobgen("logs", str(two_jobs), env=env).stdout.splitlines()
    assert shown[:2] == ["batch log of local-2",
                         f"==> node 0: {node_0} (its last 20 of 30 lines; jobgen logs --node 0 prints it whole) <=="]
    assert shown[2] == "[jobgen-train rank 0] INFO step 11/30  loss 1.9000"
    assert shown[-1] == "[jobgen-train rank 0] INFO step 30/30  loss 0.0000" and len(shown) == 22
    # Before any node has written its log: the batch log alone.
    node_0.unlink()
    assert jobgen("logs", str(two_jobs), env=env).stdout == "batch log of local-2\n"
    assert jobgen("logs", "local-1", env=env).stdout == (
        f"batch log of local-1\n==> node 0: {two_jobs}/logs/local-1-node0.out (jobgen logs --node 0 prints it whole) <==\n"
        "node 0 of local-1\n")
    refused = jobgen("logs", str(two_jobs), "--batch", "--node", "1", env=env)
    assert refused.returncode == 2 and refused.stderr == "jobgen: error: --batch is the batch log alone: give it without --node or --rank\n"


def test_logs_follow_of_an_older_job_shows_its_log_and_ends(two_jobs: Path, env: dict) -> None:
    # Its segment ended without a final outcome (preempted), but a later submission's job followed it.
    result = subprocess.run([sys.executable, "-m", "jobgen.cli", "logs", "-f", "local-1"], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "batch log of local-1\n"


def test_logs_of_a_node_or_rank_the_job_does_not_have_say_which_it_has(two_jobs: Path, env: dict) -> None:
    result = jobgen("logs", str(two_jobs), "--node", "5", env=env)
    assert result.returncode == 2
    assert result.stderr == "jobgen: error: job local-2 has nodes 0-1 (resources.nodes): there is no node 5\n"
    result = jobgen("logs", "local-1", "--rank", "4", env=env)
    assert result.stderr == ("jobgen: error: job local-1 has ranks 0-3 (world size 4: 2 node(s) x 2 process(es)): "
                             "there is no rank 4\n")
    # A node the job has, whose log is not there (yet), is still the job's to write.
    (two_jobs / "logs" / "local-2-node1.out").unlink()
    result = jobgen("logs", str(two_jobs), "--node", "1", env=env)
    assert result.returncode == 2 and "the job may still be pending" in result.stderr


def test_a_one_node_job_has_only_node_0(tmp_path: Path, state: Path, env: dict) -> None:
    run_dir = write_run(tmp_path / "one", state, [{"id": "local-9", "segments": []}], nodes=1, procs=1)
    result = jobgen("logs", str(run_dir), "--node", "1", env=env)
    assert result.stderr == "jobgen: error: job local-9 has only node 0 (resources.nodes): there is no node 1\n"


# --- jobgen status --------------------------------------------------------------------------------


def test_status_says_why_a_segment_failed(tmp_path: Path, state: Path, env: dict) -> None:
    run_dir = write_run(tmp_path / "runs" / "demo", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "preempted", 0, 3, 0),
                                       ("2026-01-01T00:02:00Z", "2026-01-01T00:03:00Z", "failed", 3, 3, 1)]},
    ])
    why = "training.data: file 'data/chat.json' does not exist"
    trainer_exit(run_dir, "failed", why, "local-1", restart=1)
    report = json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)
    assert [s["message"] for s in report["segments"]] == [None, why]
    table = jobgen("status", str(run_dir), env=env).stdout
    assert f"job local-1 restart 1 failed: {why}\n" in table
    # No report of its own (the trainer was killed, or a later segment's replaced it): where to look.
    trainer_exit(run_dir, "failed", why, "local-1", restart=0)
    table = jobgen("status", str(run_dir), env=env).stdout
    assert f"job local-1 restart 1 failed: the trainer's report is gone or was never written: see {run_dir}/logs/local-1.out" in table
    assert json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)["segments"][0]["message"] == why


def test_status_says_the_last_loss_and_where_the_final_adapter_is(two_jobs: Path, env: dict) -> None:
    output = two_jobs / "output"
    (output / "final").mkdir(parents=True)
    records = [{"step": s, "total_steps": 6, "loss": 3.0 - s / 10, "job_id": "local-2", "restart": 0} for s in (4, 5, 6)]
    (output / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "lo')  # a line being written
    trainer_exit(two_jobs, "completed", f"completed 6 steps; final model in {output / 'final'}", "local-2")
    report = json.loads(jobgen("status", "--json", str(two_jobs), env=env).stdout)
    assert (report["step"], report["total_steps"], report["last_loss"]) == (6, 6, 2.4)
    assert report["final_model"] == {"path": str(output / "final"), "kind": "adapter", "method": "lora"}
    assert report["segments"][-1]["message"] == f"completed 6 steps; final model in {output / 'final'}"
    assert report["entrypoint"] == "jobgen-train" and report["probe"] is None and report["goodput"] is not None
    table = jobgen("status", str(two_jobs), env=env).stdout
    assert "last loss 2.4000 at step 6/6\n" in table
    assert f"final adapter (lora): {output / 'final'}\n" in table
    assert "failed" not in table


def test_status_and_plot_pass_over_an_evaluation_logged_alone_on_resuming(two_jobs: Path, env: dict) -> None:
    """A resumed keep_best run evaluates the step its stop skipped and logs that on a line of its own,
    without the training fields: the last loss and the loss curve come from the training lines."""
    output = two_jobs / "output"
    output.mkdir(parents=True)
    lines = [{"step": 3, "total_steps": 6, "loss": 2.7, "job_id": "local-1", "restart": 0, "time": 1767225630},
             {"step": 3, "total_steps": 6, "eval_loss": 2.9, "job_id": "local-2", "restart": 0, "time": 1767229210}]
    (output / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = json.loads(jobgen("status", "--json", str(two_jobs), env=env).stdout)
    assert (report["step"], report["last_loss"], report["last_eval"]["loss"]) == (3, 2.7, 2.9), report
    drawn = jobgen("plot", str(two_jobs), "-o", str(two_jobs / "plot.png"), "--data", str(two_jobs / "plot.json"), env=env)
    assert drawn.returncode == 0, drawn.stderr
    plotted = json.loads((two_jobs / "plot.json").read_text())
    first, second = plotted["segments"]
    assert (first["steps"], first["loss"], second["steps"], second["eval"]) == ([3], [2.7], [], [[3, 2.9]]), plotted


def test_status_of_a_full_fine_tune_names_the_final_model_only_once_completed(tmp_path: Path, state: Path, env: dict) -> None:
    run_dir = write_run(tmp_path / "full", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "completed", 0, 6, 0)]},
    ], method="full")
    (run_dir / "output" / "final").mkdir(parents=True)
    assert json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)["final_model"]["kind"] == "model"
    append(run_dir / "segments.jsonl", {"event": "start", "job_id": "local-1", "restart": 1,
                                        "started_at": "2026-01-01T00:02:00Z", "at": "2026-01-01T00:02:00Z"})
    assert json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)["final_model"] is None


def test_status_of_a_probe_is_its_outcome_not_a_goodput(tmp_path: Path, state: Path, env: dict) -> None:
    run_dir = write_run(tmp_path / "probe", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "completed", 0, 0, 0)]},
    ], entrypoint="jobgen-probe")
    trainer_exit(run_dir, "completed", "4 ranks reached each other", "local-1")
    report = json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)
    assert report["probe"] == {"outcome": "completed", "message": "4 ranks reached each other"}
    assert report["goodput"] is None and report["final_model"] is None and report["step"] is None
    table = jobgen("status", str(run_dir), env=env).stdout
    assert "probe: 4 ranks reached each other" in table
    assert "goodput" not in table and "steps" not in table and "first step" not in table
    # One that failed says how, or where to look when it could not say.
    trainer_exit(run_dir, "failed", "all_reduce gave 9.0, expected 10.0", "local-1")
    assert "probe: all_reduce gave 9.0, expected 10.0" in jobgen("status", str(run_dir), env=env).stdout
    (run_dir / "trainer-exit.json").unlink()
    assert f"probe: the probe left no report: see {run_dir}/logs/local-1*.out" in jobgen("status", str(run_dir), env=env).stdout


# --- jobgen runs ----------------------------------------------------------------------------------


def test_runs_lists_every_run_newest_first_and_a_removed_one_as_gone(tmp_path: Path, state: Path, env: dict) -> None:
    done = write_run(tmp_path / "runs" / "done", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "completed", 0, 6, 0)]},
    ], name="llama-lora")
    (done / "output").mkdir()
    (done / "output" / "metrics.jsonl").write_text(json.dumps({"step": 6, "total_steps": 6, "loss": 1.25}) + "\n")
    removed = write_run(tmp_path / "runs" / "removed", state, [{"id": "local-2", "segments": []}], name="old")
    shutil.rmtree(removed)
    broken = write_run(tmp_path / "runs" / "broken", state, [
        {"id": "local-3", "segments": [("2026-01-01T02:00:00Z", "2026-01-01T02:01:00Z", "failed", 0, 0, 0)]},
    ], name="qwen-qlora")
    # Submitted again: the run is listed once, where its latest submission puts it.
    append(state / "jobgen" / "index.jsonl", {"job_id": "local-1", "scheduler": "local", "run_dir": str(done)})

    env = {**env, "TZ": "Europe/Paris"}
    found = json.loads(jobgen("runs", "--json", env=env).stdout)
    assert [(r["name"], r["state"], r["step"], r["last_loss"], r["run_dir"]) for r in found] == [
        ("llama-lora", "completed", 6, 1.25, str(done)),
        ("qwen-qlora", "failed", None, None, str(broken)),
        ("removed", "gone", None, None, str(removed)),
    ]
    table = jobgen("runs", env=env)
    assert table.returncode == 0 and table.stderr == ""
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["name", "state", "submitted", "step", "loss", "run", "directory"]
    # When it was submitted, in this machine's time zone (the records keep UTC).
    assert lines[1].split() == ["llama-lora", "completed", "2026-01-01", "01:00", "6/6", "1.2500", str(done)]
    assert lines[3].split() == ["removed", "gone", "2026-01-01", "01:00", "-", "-", str(removed)]
    assert jobgen("list", env=env).stdout == table.stdout


def test_runs_filters_by_name_and_state_and_limits(tmp_path: Path, state: Path, env: dict) -> None:
    for name, outcome in [("llama-lora", "completed"), ("llama-full", "failed"), ("qwen-lora", "completed")]:
        write_run(tmp_path / "runs" / name, state, [
            {"id": f"local-{name}", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", outcome, 0, 6, 0)]},
        ], name=name)
    names = lambda *args: [r["name"] for r in json.loads(jobgen("runs", "--json", *args, env=env).stdout)]
    assert names() == ["qwen-lora", "llama-full", "llama-lora"]
    assert names("llama*") == ["llama-full", "llama-lora"]
    assert names("--state", "completed") == ["qwen-lora", "llama-lora"]
    assert names("*lora", "--state", "failed") == []
    assert names("--state", "completed", "--limit", "1") == ["qwen-lora"]
    assert names("-n", "2") == ["qwen-lora", "llama-full"]
    nothing = jobgen("runs", "mistral*", env=env)
    assert nothing.returncode == 0 and nothing.stdout == "no run matches (jobgen runs without a pattern or --state lists them all)\n"


def test_runs_prune_drops_the_entries_of_removed_run_directories_and_nothing_else(tmp_path: Path, state: Path, env: dict) -> None:
    kept = write_run(tmp_path / "runs" / "kept", state, [{"id": "local-1", "segments": []}], name="kept")
    removed = write_run(tmp_path / "runs" / "removed", state, [{"id": "local-2"}, {"id": "local-3"}], name="removed")
    shutil.rmtree(removed)
    index = state / "jobgen" / "index.jsonl"
    before = index.read_text()
    # No terminal to ask on (CI): nothing is removed without --yes.
    asked = jobgen("runs", "--prune", env=env)
    assert asked.returncode == 2 and index.read_text() == before
    assert asked.stderr == (f"gone: {removed}\njobgen: error: 1 run directory is gone: give --yes to remove their entries "
                            "from the index without asking\n")
    pruned = jobgen("runs", "--prune", "--yes", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stderr.endswith(f"jobgen: removed 1 gone run directory (2 line(s)) from {index}\n")
    assert [r["run_dir"] for r in json.loads(jobgen("runs", "--json", env=env).stdout)] == [str(kept)]
    assert kept.is_dir() and (kept / "submissions.jsonl").is_file()  # a run directory is never touched
    assert jobgen("runs", "--prune", env=env).stderr == f"jobgen: every run directory in {index} is there: nothing to prune\n"


def test_a_run_is_found_by_the_name_jobgen_runs_shows(tmp_path: Path, state: Path, env: dict) -> None:
    """`jobgen status NAME` from anywhere: the name resolves through the index of runs, so a run
    submitted in another folder is found without its path; two runs of one name are listed."""
    run_dir = write_run(tmp_path / "project" / "runs" / "tiny-lora", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "completed", 0, 6, 0)]},
    ], name="tiny-lora")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    status = jobgen("status", "tiny-lora", cwd=elsewhere, env=env)
    assert status.returncode == 0, status.stderr
    assert f"run directory  {run_dir}" in status.stdout
    assert jobgen("logs", "tiny-lora", "--batch", cwd=elsewhere, env=env).stdout == "batch log of local-1\n"
    assert json.loads(jobgen("status", "--json", "tiny-lora", cwd=elsewhere, env=env).stdout)["run_dir"] == str(run_dir)
    # export takes a run as the others do: here, one without its final model yet.
    exported = jobgen("export", "tiny-lora", cwd=elsewhere, env=env)
    assert exported.returncode == 2 and "no final model yet" in exported.stderr and str(run_dir) in exported.stderr, exported.stderr

    unknown = jobgen("status", "tiny-lorra", cwd=elsewhere, env=env)
    assert unknown.returncode == 2 and unknown.stderr == (
        "jobgen: error: 'tiny-lorra' is neither a run directory, a job id nor the name of a run submitted with "
        "`jobgen submit` (`jobgen runs` lists them)\n")
    other = write_run(tmp_path / "other" / "runs" / "tiny-lora", state, [{"id": "local-2", "segments": []}], name="tiny-lora")
    # Two of one name (two checkouts' runs of one job): the newest, the other listed.
    both = jobgen("status", "tiny-lora", cwd=elsewhere, env=env)
    assert both.returncode == 0 and both.stderr == (
        f"jobgen: 'tiny-lora' names 2 runs: this is the newest, {other}; the other(s): {run_dir} "
        "(give a run directory to choose one)\n")
    assert f"run directory  {other}" in both.stdout
    # A path still means the path: the run directory there, not a name.
    assert f"run directory  {run_dir}" in jobgen("status", "runs/tiny-lora", cwd=tmp_path / "project", env=env).stdout

    # A sweep's points are listed as NAME/POINT: NAME is the sweep, NAME/POINT one point.
    sweep = tmp_path / "project" / "runs" / "lr-sweep"
    points = [write_run(sweep / f"learning_rate={lr}", state, [{"id": f"local-lr{lr}", "segments": []}], name="lr-sweep")
              for lr in ("1e-4", "2e-4")]
    (sweep / "sweep.json").write_text(json.dumps({"scheduler": "local", "keys": ["training.learning_rate"], "points": [
        {"index": i, "name": point.name, "values": {"training.learning_rate": float(point.name.split("=")[1])},
         "run_dir": str(point), "job_id": f"local-lr{point.name.split('=')[1]}"} for i, point in enumerate(points)]}))
    listed = [r["name"] for r in json.loads(jobgen("runs", "--json", "lr-sweep*", env=env).stdout)]
    assert listed == ["lr-sweep/learning_rate=2e-4", "lr-sweep/learning_rate=1e-4"]
    table = jobgen("status", "lr-sweep", cwd=elsewhere, env=env)
    assert table.returncode == 0 and table.stdout.startswith(f"sweep  {sweep}  (2 points on local)"), table.stderr
    assert f"run directory  {points[1]}" in jobgen("status", listed[0], cwd=elsewhere, env=env).stdout


def test_runs_before_any_submission_says_where_they_will_be_recorded(env: dict, state: Path) -> None:
    result = jobgen("runs", env=env)
    assert result.returncode == 0
    assert result.stdout == f"no runs yet: each `jobgen submit` is recorded in {state / 'jobgen' / 'index.jsonl'}\n"
    assert jobgen("runs", "--json", env=env).stdout == "[]\n"


def test_runs_asks_the_scheduler_only_about_a_run_whose_records_have_not_ended(monkeypatch) -> None:
    from jobgen.rundir import index

    latest = {"job_id": "7", "scheduler": "slurm"}
    ended = lambda outcome: {"job_id": "7", "restart": 0, "ended_at": "2026-01-01T00:01:00Z", "outcome": outcome}
    still_open = {"job_id": "7", "restart": 0, "ended_at": None, "outcome": "running or lost"}
    asked = []
    for says, expected in [
        (True, {"none": "pending", "open": "running", "preempted": "pending"}),  # queued, running, requeued
        (False, {"none": "not started", "open": "running or lost", "preempted": "preempted"}),  # the scheduler is done with it
        (None, {"none": "submitted", "open": "running or lost", "preempted": "preempted"}),  # no scheduler to ask here
    ]:
        monkeypatch.setattr(index, "_active", lambda entry, says=says: asked.append(entry["job_id"]) or says)
        found = {"none": index.state(latest, []), "open": index.state(latest, [still_open]),
                 "preempted": index.state(latest, [ended("preempted")])}
        assert found == expected, says
    asked.clear()
    assert index.state(latest, [ended("preempted"), ended("completed")]) == "completed" and asked == []
    # Another submission's segments are not the latest's: it has not started.
    assert index.state(latest, [{**ended("completed"), "job_id": "6"}]) == "submitted"


def test_status_gives_a_hung_segment_the_steps_it_trained(tmp_path: Path, state: Path, env: dict) -> None:
    """A hang's end records no steps (the supervisor ended the ranks before they reported them):
    the segment's own metrics records say how far it trained."""
    run_dir = write_run(tmp_path / "runs" / "demo", state, [
        {"id": "local-1", "segments": [("2026-01-01T00:00:00Z", "2026-01-01T00:10:00Z", "hung", None, None, 0),
                                       ("2026-01-01T00:11:00Z", "2026-01-01T00:12:00Z", "completed", 20, 40, 1)]},
    ])
    for step in range(1, 31):
        append(run_dir / "output" / "metrics.jsonl", {"step": step, "total_steps": 40, "loss": 1.0, "time": 1767225600 + step,
                                                       "job_id": "local-1", "restart": 0})
    report = json.loads(jobgen("status", "--json", str(run_dir), env=env).stdout)
    assert [(s["outcome"], s["first_step"], s["last_step"]) for s in report["segments"]] == [("hung", 0, 30), ("completed", 20, 40)]
    assert "0->30" in jobgen("status", str(run_dir), env=env).stdout
