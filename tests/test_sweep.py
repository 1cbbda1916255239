"""Sweeps without a cluster: --sweep and sweep files read into points, the points' names and jobs,
and the scripts `jobgen submit --sweep --dry-run` would submit (one job array on Slurm)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from jobgen.errors import JobgenError
from jobgen.job.layers import layered_job
from jobgen.job.models import Job
from jobgen.job.sweep import make_sweep, parse_sweep_option, point_jobs
from tests.helpers import jobgen, shell_findings


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "data.json").write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]')
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "lr-sweep",
        "resources": {"nodes": 2, "gpus_per_node": 4, "partition": "gpu"},
        "training": {"model": str(tmp_path / "model"), "data": str(tmp_path / "data.json"), "per_device_batch_size": 8},
    }))
    return path


def names(sweep) -> list[str]:
    return [point.name for point in sweep.points]


def test_sweep_options_make_the_grid_first_key_slowest_named_by_their_values() -> None:
    sweep = make_sweep(("training.learning_rate=1e-4,2e-4", "training.lora.r=8,16"))
    assert names(sweep) == ["learning_rate=1e-4,r=8", "learning_rate=1e-4,r=16", "learning_rate=2e-4,r=8", "learning_rate=2e-4,r=16"]
    assert [p.index for p in sweep.points] == [0, 1, 2, 3] and sweep.max_running is None
    assert sweep.points[1].plain_values() == {"training.learning_rate": "1e-4", "training.lora.r": 16}
    assert sweep.keys == ["training.learning_rate", "training.lora.r"]


def test_a_value_with_commas_in_brackets_is_one_value() -> None:
    key, values = parse_sweep_option("training.lora.target_modules=[q_proj,v_proj],[o_proj]")
    assert key == "training.lora.target_modules" and [v.value for v in values] == [["q_proj", "v_proj"], ["o_proj"]]


def test_names_are_safe_folder_names_and_unique() -> None:
    sweep = make_sweep(("training.data=/data/a b.json,/data/a?b.json",))
    assert names(sweep) == ["data=-data-a-b.json,0", "data=-data-a-b.json,1"]
    assert all("/" not in name and " " not in name for name in names(sweep))
    # Two keys that end alike are named in full.
    sweep = make_sweep(("training.lora.alpha=16", "resources.alpha=1"))
    assert names(sweep) == ["training.lora.alpha=16,resources.alpha=1"]


def test_a_sweep_file_lists_points_crossed_with_its_grid_and_sets_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(
        "max_running: 3\n"
        "grid:\n  training.seed: [1, 2]\n"
        "points:\n  - {training.lora.r: 8, training.lora.alpha: 16}\n  - {training.lora.r: 16, training.lora.alpha: 32}\n"
    )
    sweep = make_sweep(("training.learning_rate=1e-4",), path)
    assert sweep.max_running == 3 and len(sweep.points) == 4
    assert names(sweep)[0] == "r=8,alpha=16,seed=1,learning_rate=1e-4"
    assert make_sweep((), path, max_running=1).max_running == 1  # --max-running wins over the file


@pytest.mark.parametrize("option, message", [
    ("training.learning_rate", "expected dotted.key=VALUE,VALUE"),
    ("training.learning_rate=1e-4,,2e-4", "an empty value"),
    ("run_dir=a,b", "'run_dir' cannot be swept"),
    ("name=a,b", "'name' cannot be swept"),
    ("training..r=1", "is not a dotted key"),
])
def test_a_bad_sweep_option_is_one_line_naming_it(option: str, message: str) -> None:
    with pytest.raises(JobgenError, match=re.escape(message)):
        make_sweep((option,))


def test_a_bad_sweep_file_is_one_line_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    for text, message in [
        ("grids: {}\n", "unknown key 'grids'"),
        ("grid: {training.seed: 1}\n", "expected a list of values"),
        ("points: [8]\n", "point 1: expected a mapping"),
        ("max_running: 0\ngrid: {training.seed: [1]}\n", "max_running: 0 is not a positive whole number"),
        ("grid:\n  training.seed: [1, 2]\n  training.seed: [3]\n",
         "sweep.yaml: key 'grid.training.seed' is given twice, at line 2 and line 3"),
    ]:
        path.write_text(text)
        with pytest.raises(JobgenError, match=re.escape(message)):
            make_sweep((), path)


def test_each_point_is_the_job_with_its_values_in_its_own_run_directory(job_file: Path) -> None:
    layered, site = layered_job(job_file, None)
    sweep = make_sweep(("training.learning_rate=1e-4,2e-4",))
    jobs = [resolved.job for resolved in point_jobs(layered, site, sweep, "runs/lr-sweep", str(job_file))]
    assert [job.training.learning_rate for job in jobs] == [1e-4, 2e-4]
    assert [job.effective_run_dir for job in jobs] == ["runs/lr-sweep/learning_rate=1e-4", "runs/lr-sweep/learning_rate=2e-4"]
    assert all(job.training.per_device_batch_size == 8 and job.resources.nodes == 2 for job in jobs)


def test_a_bad_key_or_value_names_the_key_and_the_point(job_file: Path) -> None:
    layered, site = layered_job(job_file, None)
    with pytest.raises(JobgenError) as bad_key:
        point_jobs(layered, site, make_sweep(("training.lerning_rate=1e-4",)), "runs/x", str(job_file))
    assert str(bad_key.value).startswith(
        f"{job_file}, sweep point lerning_rate=1e-4: unknown key 'training.lerning_rate' (did you mean 'learning_rate'?)")
    with pytest.raises(JobgenError, match=re.escape(f"{job_file}, sweep point r=0: 'training.lora.r' is 0: ")):
        point_jobs(layered, site, make_sweep(("training.lora.r=8,0",)), "runs/x", str(job_file))


def dry_run(job_file: Path, *args: str):
    return jobgen("submit", "--site", "none", "--dry-run", str(job_file), *args, cwd=job_file.parent)


def test_the_slurm_dry_run_is_one_job_array_that_maps_each_task_to_its_point(job_file: Path, tmp_path: Path) -> None:
    result = dry_run(job_file, "-s", "slurm", "--sweep", "training.learning_rate=1e-4,2e-4", "--sweep", "training.lora.r=8,16",
                     "--max-running", "2")
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --output=%x-%A_%a.out" in script
    assert "JOBGEN_JOB_ID=${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" in script
    folder = tmp_path / "runs" / "lr-sweep"
    for index, name in enumerate(["learning_rate=1e-4,r=8", "learning_rate=1e-4,r=16", "learning_rate=2e-4,r=8", "learning_rate=2e-4,r=16"]):
        assert f"  {index}) jobgen_run_dir=runs/lr-sweep/{name} ;;" in script
        assert f"# point {index}: " in result.stderr and str(folder / name) in result.stderr
    # Each task's own job, embedded as a plain job's is: it validates, with that point's values.
    embedded = re.findall(r"<<'JOBGEN_JOB_YAML'\n(.*?)^JOBGEN_JOB_YAML$", script, re.S | re.M)
    jobs = [Job.model_validate(yaml.safe_load(text)) for text in embedded]
    assert [(j.training.learning_rate, j.training.lora.r) for j in jobs] == [(1e-4, 8), (1e-4, 16), (2e-4, 8), (2e-4, 16)]
    path = tmp_path / "array.sh"
    path.write_text(script)
    assert shell_findings(path) == ""
    assert not folder.exists(), "a dry run writes nothing"


def test_a_slurm_array_cannot_sweep_what_changes_its_script(job_file: Path) -> None:
    result = dry_run(job_file, "-s", "slurm", "--sweep", "resources.nodes=1,2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("jobgen: error: sweep: 'resources.nodes' differs between the points")
    assert "sweep only training.* keys there" in result.stderr and "Traceback" not in result.stderr


def test_an_array_directive_of_the_job_conflicts_with_the_sweep(job_file: Path) -> None:
    data = yaml.safe_load(job_file.read_text())
    data["extra_directives"] = ["#SBATCH --array=0-9"]
    job_file.write_text(yaml.safe_dump(data))
    result = dry_run(job_file, "-s", "slurm", "--sweep", "training.seed=1,2")
    assert result.returncode == 2 and "with --max-running as its limit" in result.stderr


@pytest.mark.parametrize("scheduler", ["pbs", "torque"])
def test_pbs_and_torque_submit_one_job_per_point(job_file: Path, scheduler: str) -> None:
    result = dry_run(job_file, "-s", scheduler, "--sweep", "resources.nodes=1,2")
    assert result.returncode == 0, result.stderr
    headers = re.findall(r"^# ---- (.*) ----$", result.stderr, re.M)
    assert [Path(h).parent.name for h in headers] == ["nodes=1", "nodes=2"]
    assert "--array" not in result.stdout and "-J " not in result.stdout


def test_a_job_without_a_sweep_renders_as_before(job_file: Path) -> None:
    plain = dry_run(job_file, "-s", "slurm")
    assert plain.returncode == 0 and "--array" not in plain.stdout and "#SBATCH --output=%x-%j.out" in plain.stdout
    assert "SLURM_ARRAY" not in plain.stdout
    assert dry_run(job_file, "-s", "slurm", "--max-running", "2").stderr.strip().endswith("give --sweep KEY=V1,V2 or --sweep-file too")


def test_a_container_jobs_points_are_named_without_commas(job_file: Path) -> None:
    # The run directory is mounted into the container in a comma-separated list.
    result = dry_run(job_file, "-s", "slurm", "--set", "container.runtime=apptainer", "--set", "container.image=/images/a.sif",
                     "--sweep", "training.learning_rate=1e-4,2e-4", "--sweep", "training.seed=1,2")
    assert result.returncode == 0, result.stderr
    assert "  3) jobgen_run_dir=runs/lr-sweep/learning_rate=2e-4+seed=2 ;;" in result.stdout


def test_status_of_a_sweep_is_a_table_of_its_points_found_by_folder_or_array_id(tmp_path: Path) -> None:
    """Written as `jobgen submit --sweep` writes them: the record, each point's records, the index."""
    import json

    folder = tmp_path / "runs" / "lr"
    state = tmp_path / "state"
    points = []
    for index, (lr, loss) in enumerate([(1e-4, 2.5), (2e-4, 2.25)]):
        run = folder / f"learning_rate={lr}"
        (run / "output").mkdir(parents=True)
        job_id = f"77_{index}"
        (run / "submissions.jsonl").write_text(json.dumps({"job_id": job_id, "scheduler": "local", "sweep": str(folder)}) + "\n")
        (run / "segments.jsonl").write_text(
            json.dumps({"event": "start", "job_id": job_id, "restart": 0, "started_at": "2026-01-01T00:00:00Z"}) + "\n"
            + json.dumps({"event": "end", "job_id": job_id, "restart": 0, "started_at": "2026-01-01T00:00:00Z",
                          "at": "2026-01-01T00:01:40Z", "first_step": 0, "last_step": 5, "outcome": "completed",
                          "train_seconds": 80}) + "\n")
        (run / "job.yaml").write_text("name: lr\n")
        (run / "output" / "metrics.jsonl").write_text(json.dumps({"step": 5, "total_steps": 5, "loss": loss}) + "\n")
        (state / "jobgen").mkdir(parents=True, exist_ok=True)
        with (state / "jobgen" / "index.jsonl").open("a") as index_file:
            index_file.write(json.dumps({"job_id": job_id, "scheduler": "local", "run_dir": str(run)}) + "\n")
        points.append({"index": index, "name": run.name, "values": {"training.learning_rate": lr}, "run_dir": str(run), "job_id": job_id})
    (folder / "sweep.json").write_text(json.dumps({"scheduler": "local", "array_job_id": None, "max_running": None,
                                                   "keys": ["training.learning_rate"], "points": points}))
    env = {"XDG_STATE_HOME": str(state)}
    by_folder = json.loads(jobgen("status", str(folder), "--json", env=env).stdout)
    assert [(p["values"], p["state"], p["step"], p["last_loss"], p["goodput"]) for p in by_folder["points"]] == [
        ({"training.learning_rate": 1e-4}, "completed", 5, 2.5, 0.8), ({"training.learning_rate": 2e-4}, "completed", 5, 2.25, 0.8)]
    assert json.loads(jobgen("status", "77", "--json", env=env).stdout) == by_folder
    table = jobgen("status", str(folder), env=env).stdout.splitlines()
    assert table[2].split() == ["point", "training.learning_rate", "job", "state", "step", "loss", "goodput"]
    assert table[3].split() == ["0", "0.0001", "77_0", "completed", "5/5", "2.5000", "80.0%"]
    runs = jobgen("runs", env=env).stdout
    # `jobgen runs` tells the points apart: the job's name and the point's.
    assert [line.split()[0] for line in runs.splitlines()[1:]] == ["lr/learning_rate=0.0002", "lr/learning_rate=0.0001"]


def test_a_swept_data_file_is_checked_for_each_point(job_file: Path) -> None:
    missing = job_file.parent / "missing.json"
    result = dry_run(job_file, "-s", "slurm", "--sweep", f"training.data={job_file.parent / 'data.json'},{missing}")
    assert result.returncode == 2
    assert f"training.data: file '{missing}' does not exist" in result.stderr and "Traceback" not in result.stderr


def test_validate_checks_every_point(job_file: Path) -> None:
    ok = jobgen("validate", "--site", "none", "-s", "slurm", str(job_file), "--sweep", "training.lora.r=8,16", cwd=job_file.parent)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == "sweep: 2 points ok: r=8, r=16"
    bad = jobgen("validate", "--site", "none", str(job_file), "--sweep", "training.lora.r=8,0", cwd=job_file.parent)
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == f"jobgen: error: {job_file}, sweep point r=0: 'training.lora.r' is 0: Input should be greater than or equal to 1"
    array = jobgen("validate", "--site", "none", "-s", "slurm", str(job_file), "--sweep", "resources.nodes=1,2", cwd=job_file.parent)
    assert array.returncode == 2 and "sweep only training.* keys there" in array.stderr


def test_render_prints_the_array_script_that_submit_would_submit(job_file: Path, tmp_path: Path) -> None:
    args = ("-s", "slurm", "--sweep", "training.lora.r=8,16", "--max-running", "1")
    rendered = jobgen("render", "--site", "none", str(job_file), *args, cwd=tmp_path)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stdout == dry_run(job_file, *args).stdout and "#SBATCH --array=0-1%1" in rendered.stdout
    pbs = jobgen("render", "--site", "none", "-s", "pbs", str(job_file), "--sweep", "training.lora.r=8,16", cwd=tmp_path)
    assert pbs.returncode == 2 and pbs.stderr.startswith("jobgen: error: pbs runs a sweep as one job per point")
