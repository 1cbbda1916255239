"""A hub model staged for nodes without internet: a Hugging Face cache laid out as huggingface_hub
lays it out (blobs/, refs/main, snapshots/COMMIT/ of links into blobs/), built here from the tiny
model under the name jobgen-test/tiny; huggingface_hub's own readers confirm the layout. Then
`jobgen validate` on it, and real local runs that load it with the hub offline. Nothing is
downloaded: HF_ENDPOINT points at a closed local port, so a download attempt would fail."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobgen.job.hub_cache import hub_cache, job_cache, look_up
from tests.hub_stand_in import HubStandIn

MODEL = "jobgen-test/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HF_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")


def build_hub_cache(hf_home: Path, model: str, source: Path, commit: str = COMMIT, revision: str = "main") -> Path:
    """HF_HOME/hub/models--ORG--NAME holding `source`'s files as one snapshot; its snapshot folder."""
    repo = hf_home / "hub" / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True, exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()  # the library names a blob by its etag
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / revision).write_text(commit)
    return snapshot


def clean_env(**extra: str) -> dict:
    env = {name: value for name, value in os.environ.items() if name not in HF_VARIABLES}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens: no test downloads anything
    env["JOBGEN_PG_TIMEOUT_MINUTES"] = "3"
    return {**env, **extra}


@pytest.fixture(scope="module")
def hf_home(tiny: Path, tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    build_hub_cache(home, MODEL, tiny / "model")
    return home


def test_the_built_cache_is_what_huggingface_hub_reads(hf_home: Path) -> None:
    from huggingface_hub import scan_cache_dir, snapshot_download

    repos = {repo.repo_id: repo for repo in scan_cache_dir(hf_home / "hub").repos}
    revision = next(iter(repos[MODEL].revisions))
    assert (revision.commit_hash, set(revision.refs)) == (COMMIT, {"main"})
    assert {f.file_name for f in revision.files} == {p.name for p in revision.snapshot_path.iterdir()}
    found = snapshot_download(MODEL, cache_dir=str(hf_home / "hub"), local_files_only=True)
    assert Path(found) == hf_home / "hub" / "models--jobgen-test--tiny" / "snapshots" / COMMIT
    cached = look_up(MODEL, "main", hub_cache({"HF_HOME": str(hf_home)}))
    assert (cached.complete, cached.commit, Path(cached.snapshot)) == (True, COMMIT, Path(found))
    assert look_up(MODEL, COMMIT, hub_cache({"HF_HOME": str(hf_home)})).complete


@pytest.mark.parametrize("variables", [
    {}, {"HF_HOME": "~/hf"}, {"HF_HOME": "/shared/hf", "HF_HUB_CACHE": "/other/hub"},
    {"HUGGINGFACE_HUB_CACHE": "/legacy"}, {"XDG_CACHE_HOME": "/xdg"}, {"HF_HOME": "$HOME/hf"},
])
def test_the_cache_is_chosen_as_huggingface_hub_chooses_it(variables: dict) -> None:
    env = clean_env(**variables)
    library = subprocess.run([sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert hub_cache(env).path == library


def test_the_jobs_variables_choose_its_cache_else_the_users(monkeypatch) -> None:
    monkeypatch.setenv("HF_HOME", "/home/me/hf")
    assert job_cache({"HF_HOME": "/shared/hf"}).chosen_by == "HF_HOME=/shared/hf"
    assert job_cache({"OTHER": "1"}).path == "/home/me/hf/hub"


def write_job(folder: Path, tiny: Path, hf_home: Path, model: str = MODEL, name: str = "hub", steps: int = 2, **training) -> Path:
    from tests.helpers import free_port

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(tiny / "data.json", folder / "data.json")
    (folder / "job.yaml").write_text(yaml.safe_dump({
        "name": name,
        "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
        "launch": {"procs_per_node": 1, "master_port": free_port()},
        "environment": {"variables": {"HF_HOME": str(hf_home)}},
        "training": {"model": model, "data": "data.json", "method": "lora", "precision": "fp32", "per_device_batch_size": 2,
                     "max_length": 64, "max_steps": steps, "save_interval": 100, "lora": {"r": 4, "alpha": 8}, **training},
    }))
    return folder / "job.yaml"


def jobgen(folder: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobgen.cli", *args], cwd=folder, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def incomplete_copy(hf_home: Path, destination: Path) -> Path:
    """A copy of the cache whose snapshot lost its weights' blob (the link stays, dangling)."""
    shutil.copytree(hf_home, destination, symlinks=True)
    weights = destination / "hub" / "models--jobgen-test--tiny" / "snapshots" / COMMIT / "model.safetensors"
    os.unlink(weights.resolve())
    return destination


def test_validate_is_quiet_for_a_staged_model_and_warns_for_one_the_cache_lacks(tiny: Path, hf_home: Path, tmp_path: Path) -> None:
    config = write_job(tmp_path / "ok", tiny, hf_home)
    out = jobgen(config.parent, "validate", "job.yaml")
    assert out.returncode == 0 and ": ok:" in out.stdout and "training.model" not in out.stderr, out.stderr

    config = write_job(tmp_path / "absent", tiny, hf_home, model="jobgen-test/absent")
    out = jobgen(config.parent, "validate", "job.yaml")
    assert out.returncode == 0 and ": ok:" in out.stdout, out.stderr
    assert model_warnings(out.stderr) == [
        f"jobgen: warning: training.model: jobgen-test/absent is not in the cache the nodes use (HF_HOME={hf_home}): "
        "run `jobgen prepare JOB.yaml` on a machine with internet, or the nodes will try to download it" + NOT_CHECKED
    ]

    broken = incomplete_copy(hf_home, tmp_path / "hf-broken")
    config = write_job(tmp_path / "incomplete", tiny, broken)
    out = jobgen(config.parent, "validate", "job.yaml")
    assert out.returncode == 0, out.stderr
    [warning] = model_warnings(out.stderr)
    assert "training.model: jobgen-test/tiny (commit 0123456789ab) is incomplete" in warning
    assert "the weights (model.safetensors or pytorch_model.bin) missing" in warning


def test_validate_reads_the_models_config_at_the_jobs_revision_in_the_jobs_cache(tiny: Path, tmp_path: Path) -> None:
    """The cache the job's environment.variables give the nodes, not the submitting user's; and the
    job's revision there: a tag that is the GPTQ checkpoint, beside main that is not."""
    home = tmp_path / "hf"
    build_hub_cache(home, MODEL, tiny / "model")
    quantized = tmp_path / "int4"
    shutil.copytree(tiny / "model", quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (quantized / "config.json").write_text(json.dumps(config))
    build_hub_cache(home, MODEL, quantized, commit="a" * 40, revision="int4")
    write_job(tmp_path / "main", tiny, home)
    out = jobgen(tmp_path / "main", "validate", "job.yaml")
    assert out.returncode == 0 and ": ok:" in out.stdout, out.stderr
    write_job(tmp_path / "tag", tiny, home, model_revision="int4")
    out = jobgen(tmp_path / "tag", "validate", "job.yaml")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert (f"jobgen: error: training.model: {MODEL} is a pre-quantized GPTQ checkpoint (quantization_config.quant_method), "
            "which method lora cannot train") in out.stderr, out.stderr


def test_validate_checks_the_commit_a_run_is_pinned_to_not_where_main_points_now(tiny: Path, tmp_path: Path) -> None:
    """A resubmission loads the run's pinned commit (model-commit.json, written here by the
    trainer's own pin_commit): gone from the cache, it is what validate warns of, though main,
    which moved, is complete; a new run of the same job is checked at main."""
    from jobgen.rundir.model_pin import pin_commit

    home = tmp_path / "hf"
    build_hub_cache(home, MODEL, tiny / "model")
    write_job(tmp_path / "job", tiny, home, name="pinned")
    pin_commit(str(tmp_path / "job" / "runs" / "pinned"), MODEL, "main", COMMIT)
    build_hub_cache(home, MODEL, tiny / "model", commit="f" * 40)  # main moves on
    shutil.rmtree(home / "hub" / "models--jobgen-test--tiny" / "snapshots" / COMMIT)  # someone cleaned the cache
    out = jobgen(tmp_path / "job", "validate", "job.yaml")
    assert out.returncode == 0, out.stderr
    assert model_warnings(out.stderr) == [
        f"jobgen: warning: training.model: {MODEL} at revision {COMMIT} is not in the cache the nodes use (HF_HOME={home}): "
        "run `jobgen prepare JOB.yaml` on a machine with internet, or the nodes will try to download it" + NOT_CHECKED
    ]
    write_job(tmp_path / "new", tiny, home, name="new")
    out = jobgen(tmp_path / "new", "validate", "job.yaml")
    assert out.returncode == 0 and model_warnings(out.stderr) == [], out.stderr


# What validate adds for a model the cache lacks, where the hub cannot be asked (HF_ENDPOINT, a closed port).
NOT_CHECKED = ("; the hub (http://127.0.0.1:9) cannot be reached from here (Connection refused), so its name, revision "
               "and config (model type, its own code and trust_remote_code) were not checked")


def model_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "training.model" in line]


def run_logs(run_dir: Path) -> str:
    return "".join(path.read_text(errors="replace") for path in sorted((run_dir / "logs").rglob("*")) if path.is_file())


def test_a_staged_model_trains_with_the_hub_offline(tiny: Path, hf_home: Path, tmp_path: Path) -> None:
    config = write_job(tmp_path, tiny, hf_home)
    out = jobgen(tmp_path, "submit", "-s", "local", "job.yaml")
    run_dir = tmp_path / "runs" / "hub"
    logs = run_logs(run_dir)
    assert out.returncode == 0, out.stdout + out.stderr + logs
    assert f"training.model jobgen-test/tiny: commit {COMMIT} from the cache (HF_HOME={hf_home}); HF_HUB_OFFLINE=1" in logs
    assert json.loads((run_dir / "trainer-exit.json").read_text())["reason"] == "completed"


def test_a_staged_model_missing_its_weights_fails_on_the_node_in_one_line(tiny: Path, hf_home: Path, tmp_path: Path) -> None:
    broken = incomplete_copy(hf_home, tmp_path / "hf-broken")
    write_job(tmp_path, tiny, broken, name="broken")
    out = jobgen(tmp_path, "submit", "-s", "local", "job.yaml")
    run_dir = tmp_path / "runs" / "broken"
    logs = run_logs(run_dir)
    assert out.returncode != 0
    line = (f"jobgen-train: error: training.model: jobgen-test/tiny (commit 0123456789ab) is incomplete in the cache the "
            f"nodes use (HF_HOME={broken}): the weights (model.safetensors or pytorch_model.bin) missing from "
            f"{broken}/hub/models--jobgen-test--tiny/snapshots/{COMMIT}; run `jobgen prepare JOB.yaml` on a machine with internet")
    assert line in logs, logs
    # Every log: the rank's, the node's (torchrun's report of the failed rank is one line) and the job's.
    assert all("Traceback" not in path.read_text() for path in (run_dir / "logs").rglob("*") if path.is_file())
    assert json.loads((run_dir / "trainer-exit.json").read_text())["failure"] == "user_error"


def test_the_librarys_offline_error_becomes_one_line_naming_the_cache(tmp_path: Path) -> None:
    """A file the library wants and jobgen's check does not know of: the library's own offline error."""
    script = ("from jobgen.errors import UserError\nfrom jobgen.train.modeling import load_tokenizer\n"
              "try:\n    load_tokenizer('jobgen-test/absent')\nexcept UserError as error:\n    print(error)\n")
    out = subprocess.run([sys.executable, "-c", script], env=clean_env(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1"),
                         capture_output=True, text=True, timeout=120)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("training.model: could not load a tokenizer from jobgen-test/absent with the hub offline "
                           f"(HF_HUB_OFFLINE=1) from the cache the nodes use (HF_HOME={tmp_path}): "), out.stdout + out.stderr
    assert line.endswith("; run `jobgen prepare JOB.yaml` on a machine with internet")


def test_stage_model_downloads_what_training_needs_into_the_jobs_cache(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    """stage_model's own logic, with snapshot_download replaced by one that lays out what the hub
    would send (the real download is not tested here: no test reaches the hub)."""
    import fnmatch

    import huggingface_hub

    from jobgen.job.hub_stage import stage_model
    from jobgen.job.models import Job

    calls = []

    def snapshot_download(repo_id, revision, cache_dir, allow_patterns, **kwargs):
        calls.append((repo_id, revision, cache_dir, allow_patterns))
        sent = tmp_path / "sent"
        sent.mkdir(exist_ok=True)
        for file in (tiny / "model").iterdir():
            if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
                shutil.copy(file, sent / file.name)
        return str(build_hub_cache(Path(cache_dir).parent, repo_id, sent))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.chdir(tmp_path)
    hf_home = tmp_path / "shared-hf"
    job = Job.model_validate(yaml.safe_load(write_job(tmp_path / "job", tiny, hf_home).read_text()))
    lines: list[str] = []
    with HubStandIn({MODEL: {"model_type": "llama"}}) as hub:  # asked before the download: it has the model
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        cached = stage_model(job, progress=lines.append)
    assert cached.complete and cached.commit == COMMIT
    assert [call[:3] for call in calls] == [(MODEL, "main", str(hf_home / "hub"))]
    assert lines[-1] == (f"training.model: {MODEL} is in {hf_home}/hub at commit {COMMIT}; "
                         f"to pin it, set training.model_revision: {COMMIT}")
    pinned = job.model_copy(update={"training": job.training.model_copy(update={"model_revision": COMMIT})})
    assert stage_model(pinned, progress=lines.append).commit == COMMIT and len(calls) == 1  # already there
    local = job.model_copy(update={"training": job.training.model_copy(update={"model": str(tiny / "model")})})
    assert stage_model(local, progress=lines.append) is None


def test_a_run_keeps_the_commit_it_started_with_when_the_branch_moves(tiny: Path, hf_home: Path, tmp_path: Path) -> None:
    """The first start pins the commit main points at (RUN_DIR/model-commit.json); then main moves
    in the shared cache (someone downloads the model's new commit) and the run, resubmitted for
    more steps, still loads the commit it started with, while a new run loads the new one."""
    home = tmp_path / "hf"
    shutil.copytree(hf_home, home, symlinks=True)
    write_job(tmp_path / "job", tiny, home, name="pinned", lr_schedule="constant")  # a constant rate resumes to more steps
    first = jobgen(tmp_path / "job", "submit", "-s", "local", "job.yaml")
    run_dir = tmp_path / "job" / "runs" / "pinned"
    assert first.returncode == 0, first.stdout + first.stderr + run_logs(run_dir)
    assert json.loads((run_dir / "model-commit.json").read_text()) == {"model": MODEL, "revision": "main", "commit": COMMIT}

    moved = "fedcba9876543210fedcba9876543210fedcba98"
    build_hub_cache(home, MODEL, tiny / "model", commit=moved)  # refs/main now names the new snapshot
    write_job(tmp_path / "job", tiny, home, name="pinned", steps=4, lr_schedule="constant")
    again = jobgen(tmp_path / "job", "submit", "-s", "local", "job.yaml")
    logs = run_logs(run_dir)
    assert again.returncode == 0, again.stdout + again.stderr + logs
    assert (f"training.model {MODEL}: this run is pinned to commit {COMMIT}, the one it started with (model-commit.json); "
            f"main is now {moved[:12]} in the cache, which a new run would train on") in logs
    assert f"training.model {MODEL} at revision {COMMIT}: commit {COMMIT} from the cache" in logs
    assert f"commit {moved} from the cache" not in logs
    exit_report = json.loads((run_dir / "trainer-exit.json").read_text())
    assert (exit_report["reason"], exit_report["last_step"]) == ("completed", 4), exit_report

    write_job(tmp_path / "new", tiny, home, name="new")
    fresh = jobgen(tmp_path / "new", "submit", "-s", "local", "job.yaml")
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert json.loads((tmp_path / "new" / "runs" / "new" / "model-commit.json").read_text())["commit"] == moved


# `jobgen prepare` with huggingface_hub.snapshot_download replaced by one that lays out what the hub
# would send at commit argv[1] (no test reaches the hub): prints DOWNLOAD for each call.
STAND_IN_HUB_PREPARE = """
import fnmatch, shutil, sys, tempfile
from pathlib import Path
sys.path.insert(0, {repo!r})
import huggingface_hub
from tests.train.test_hub_cache import build_hub_cache

def snapshot_download(repo_id, revision, cache_dir, allow_patterns, **kwargs):
    print("DOWNLOAD", revision, flush=True)
    sent = Path(tempfile.mkdtemp())
    for file in Path({model!r}).iterdir():
        if any(fnmatch.fnmatch(file.name, pattern) for pattern in allow_patterns):
            shutil.copy(file, sent / file.name)
    return str(build_hub_cache(Path(cache_dir).parent, repo_id, sent, commit=sys.argv[1]))

huggingface_hub.snapshot_download = snapshot_download
from jobgen.cli import main
main(["prepare", "job.yaml"])
"""


def test_stand_in_hub_jobgen_prepare_pins_what_it_downloads_and_keeps_the_pin(tiny: Path, tmp_path: Path) -> None:
    home = tmp_path / "hf"
    folder = write_job(tmp_path / "job", tiny, home, name="prepared").parent
    script = STAND_IN_HUB_PREPARE.format(repo=str(Path(__file__).parents[2]), model=str(tiny / "model"))
    env = clean_env(HF_HOME=str(home))

    def prepare(hub_main: str) -> subprocess.CompletedProcess:
        # The hub's answers from a stand-in (tests.hub_stand_in); the tokenizer is read from what was staged.
        with HubStandIn({MODEL: {"model_type": "llama"}}) as hub:
            return subprocess.run([sys.executable, "-c", script, hub_main], cwd=folder, env={**env, "HF_ENDPOINT": hub.url},
                                  capture_output=True, text=True, timeout=300)

    run_dir = folder / "runs" / "prepared"
    first = prepare(COMMIT)
    assert first.returncode == 0 and first.stdout.splitlines() == ["DOWNLOAD main"], first.stdout + first.stderr
    assert (f"jobgen: training.model: commit {COMMIT} pinned for this run ({run_dir}/model-commit.json): "
            "its starts and restarts load it, wherever main points then") in first.stderr
    assert json.loads((run_dir / "model-commit.json").read_text())["commit"] == COMMIT

    moved = "fedcba9876543210fedcba9876543210fedcba98"
    build_hub_cache(home, MODEL, tiny / "model", commit=moved)  # main has moved in the cache since
    again = prepare(moved)
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr  # the pinned commit is there
    assert (f"jobgen: training.model: this run is pinned to commit {COMMIT}, the one it started with "
            f"({run_dir}/model-commit.json)") in again.stderr
    assert f"{MODEL} at revision {COMMIT} is already in {home}/hub (commit {COMMIT})" in again.stderr
    assert "was prepared already" in again.stderr  # the same tokenizer: the same store


def test_a_node_that_cannot_reach_the_hub_for_a_model_not_staged_says_so_at_once(tiny: Path, tmp_path: Path) -> None:
    # Each rank downloads a model its cache lacks; with no hub (HF_ENDPOINT a closed port) the
    # library retried each file for about a minute, logging every try, before its error.
    import time

    empty = tmp_path / "hf-empty"
    write_job(tmp_path, tiny, empty, name="nohub")
    started = time.monotonic()
    out = jobgen(tmp_path, "submit", "-s", "local", "job.yaml")
    took = time.monotonic() - started
    run_dir = tmp_path / "runs" / "nohub"
    logs = run_logs(run_dir)
    assert out.returncode != 0
    line = (f"jobgen-train: error: training.model: {MODEL} is not in {empty}/hub (HF_HOME={empty}) and the hub "
            "(http://127.0.0.1:9) cannot be reached from here (Connection refused): stage it into the nodes' cache with "
            "`jobgen prepare JOB.yaml` on a machine with internet")
    assert line in logs, logs
    assert "Retrying in" not in logs and took < 60, f"{took:.0f} s"
    assert json.loads((run_dir / "trainer-exit.json").read_text())["failure"] == "user_error"
