"""Site directives reach the scheduler: chunk resources go into the one `-l select` line, and an
extra directive that repeats an option jobgen generates is refused, naming both lines.

PBS Pro honours the first `-l select` only (../shared/notes/pbs.md), and sbatch the last of two
`--time`: a repeated option is always one of the two silently lost.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, shell_findings

RESOURCES = {"nodes": 2, "gpus_per_node": 4, "memory_per_node": "64G", "partition": "gpu", "account": "ml"}


def write_job(tmp_path: Path, resources: dict | None = None, extra_directives: list[str] | None = None) -> Path:
    job: dict = {
        "name": "directives",
        "resources": {**RESOURCES, **(resources or {})},
        "environment": {"secrets": ["HF_TOKEN"]},
        # The probe reads no model or data, so `submit` has no files to check before it renders.
        "launch": {"entrypoint": "jobgen-probe"},
        "training": {"model": "m", "data": "d", "per_device_batch_size": 8},
    }
    if extra_directives is not None:
        job["extra_directives"] = extra_directives
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def header(script: str, prefix: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith(prefix + " ")]


def assert_refused(result, message: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("jobgen: error: ")]
    assert errors == [f"jobgen: error: {message}"]


# --- chunk resources ---------------------------------------------------------------------------

CHUNK = {"ompthreads": 8, "bigmem": True, "host_type": "a100"}


def test_pbs_chunk_resources_join_the_one_select_line(tmp_path: Path, shellcheck: str) -> None:
    script_path = tmp_path / "job.pbs"
    result = jobgen("render", "-s", "pbs", str(write_job(tmp_path, {"chunk_resources": CHUNK})), "-o", str(script_path))
    assert result.returncode == 0, result.stderr
    selects = [line for line in header(script_path.read_text(), "#PBS") if line.startswith("#PBS -l select")]
    assert selects == ["#PBS -l select=2:ncpus=4:ngpus=4:mem=64gb:mpiprocs=1:ompthreads=8:bigmem=true:host_type=a100"]
    assert "warning" not in result.stderr  # PBS Pro expresses every one of them
    assert shell_findings(script_path) == ""


def test_torque_takes_true_chunk_resources_as_node_properties_and_warns_about_the_rest(tmp_path: Path) -> None:
    result = jobgen("render", "-s", "torque", str(write_job(tmp_path, {"chunk_resources": CHUNK})))
    assert result.returncode == 0, result.stderr
    assert "#PBS -l nodes=2:ppn=4:gpus=4:bigmem" in header(result.stdout, "#PBS")
    for name in ("ompthreads", "host_type"):
        warning = f"resources.chunk_resources.{name} has no torque nodes= equivalent and is not used"
        assert f"jobgen: warning: {warning}" in result.stderr
        assert f"# warning: {warning}" in result.stdout
    assert "bigmem has no" not in result.stderr


def test_slurm_warns_that_chunk_resources_are_not_used(tmp_path: Path) -> None:
    result = jobgen("render", "-s", "slurm", str(write_job(tmp_path, {"chunk_resources": {"ompthreads": 8}})))
    assert result.returncode == 0, result.stderr
    assert "jobgen: warning: resources.chunk_resources has no slurm equivalent and is not used" in result.stderr
    assert "ompthreads" not in "\n".join(header(result.stdout, "#SBATCH"))


@pytest.mark.parametrize(
    "chunk,message",
    [
        ({"ncpus": 8}, "'ncpus' is set by jobgen: set resources.cpus_per_node instead"),
        ({"NGPUS": 8}, "'NGPUS' is set by jobgen: set resources.gpus_per_node instead"),
        ({"mpiprocs": 8}, "'mpiprocs' is set by jobgen: one per chunk"),
        ({"select": 3}, "'select' is set by jobgen: set resources.nodes instead"),
        ({"host_type": "a100:ngpus=8"}, "host_type: 'a100:ngpus=8' must be true/false, a whole number or a word"),
        ({"host_type": "a100;reboot"}, "host_type: 'a100;reboot' must be"),
        ({"1st": 1}, "'1st' is not a resource name"),
    ],
)
def test_chunk_resources_jobgen_sets_or_that_would_split_the_line_are_refused(
    tmp_path: Path, chunk: dict, message: str
) -> None:
    config = write_job(tmp_path, {"chunk_resources": chunk})
    for command in (["validate", str(config)], ["render", "-s", "pbs", str(config)]):
        result = jobgen(*command)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"'resources.chunk_resources' is {chunk!r}: {message}" in result.stderr


# --- extra directives that repeat a generated option -----------------------------------------

SELECT = "#PBS -l select=2:ncpus=4:ngpus=4:mem=64gb:mpiprocs=1"
WALLTIME, TIME = "#PBS -l walltime=04:00:00", "#SBATCH --time=0-04:00:00"
CHUNK_FIX = "put chunk resources in resources.chunk_resources"
ONE_LOG = "remove it: jobgen appends every requeued segment to one batch log"
CONFLICTS = [
    # scheduler, the extra directive, the generated line it repeats, what to do instead
    ("pbs", "#PBS -l select=2:ompthreads=8", SELECT, CHUNK_FIX),
    ("pbs", "#PBS -lselect=1:ncpus=2", SELECT, CHUNK_FIX),
    ("pbs", "#PBS -l nodes=2:ppn=4", SELECT, CHUNK_FIX),
    ("pbs", "#PBS -l mem=10gb", SELECT, "set resources.memory_per_node instead"),
    ("pbs", "#PBS -l software=abaqus,walltime=1:00:00", WALLTIME, "set resources.time_limit instead"),
    ("pbs", "#PBS -l place=pack", "#PBS -l place=scatter", "remove it: jobgen places one chunk per host "
     "(resources.exclusive asks for whole hosts)"),
    ("pbs", "#PBS -N other", "#PBS -N directives", "set name in the job file instead"),
    ("pbs", "#PBS -q long", "#PBS -q gpu", "set resources.partition instead"),
    ("pbs", "#PBS -A other", "#PBS -A ml", "set resources.account instead"),
    ("pbs", "#PBS -r n", "#PBS -r y", "set requeue.enabled instead"),
    ("pbs", "#PBS -j eo", "#PBS -j oe", "remove it: jobgen joins stdout and stderr in one batch log"),
    ("pbs", "#PBS -v FOO", "#PBS -v HF_TOKEN", "name the variables in environment.secrets instead"),
    ("torque", "#PBS -l nodes=2:ppn=16", "#PBS -l nodes=2:ppn=4:gpus=4", CHUNK_FIX),
    ("torque", "#PBS -l mem=1gb", "#PBS -l mem=128gb", "set resources.memory_per_node instead"),
    ("slurm", "#SBATCH -N 3", "#SBATCH --nodes=2", "set resources.nodes instead"),
    ("slurm", "#SBATCH -N3", "#SBATCH --nodes=2", "set resources.nodes instead"),
    ("slurm", "#SBATCH --nodes 3", "#SBATCH --nodes=2", "set resources.nodes instead"),
    ("slurm", "#SBATCH --time=1:00:00", TIME, "set resources.time_limit instead"),
    ("slurm", "#SBATCH -t 60", TIME, "set resources.time_limit instead"),
    ("slurm", "#SBATCH --mail-type=FAIL --time 60", TIME, "set resources.time_limit instead"),
    ("slurm", "#SBATCH --part=debug", "#SBATCH --partition=gpu", "set resources.partition instead"),
    ("slurm", "#SBATCH -p debug", "#SBATCH --partition=gpu", "set resources.partition instead"),
    ("slurm", "#SBATCH -A other", "#SBATCH --account=ml", "set resources.account instead"),
    ("slurm", "#SBATCH -J other", "#SBATCH --job-name=directives", "set name in the job file instead"),
    ("slurm", "#SBATCH --gres=gpu:a100:2", "#SBATCH --gpus-per-node=4", "set resources.gpus_per_node instead"),
    ("slurm", "#SBATCH -G 8", "#SBATCH --gpus-per-node=4", "set resources.gpus_per_node instead"),
    # Always generated (one CPU per rank unless cpus_per_node says more): srun asks for it again.
    ("slurm", "#SBATCH -c 8", "#SBATCH --cpus-per-task=4", "set resources.cpus_per_node instead"),
    ("slurm", "#SBATCH --mem-per-cpu=4G", "#SBATCH --mem=64G", "set resources.memory_per_node instead"),
    ("slurm", "#SBATCH -o x.out", "#SBATCH --output=%x-%j.out", ONE_LOG),
    ("slurm", "#SBATCH --no-requeue", "#SBATCH --requeue", "set requeue.enabled instead"),
    ("slurm", "#SBATCH -n 8", "#SBATCH --ntasks-per-node=1", "remove it: jobgen starts one task per node, "
     "and torchrun launch.procs_per_node ranks in it"),
]


@pytest.mark.parametrize("scheduler,line,generated,fix", CONFLICTS, ids=[case[1] for case in CONFLICTS])
def test_extra_directive_that_repeats_a_generated_option_is_refused(
    tmp_path: Path, scheduler: str, line: str, generated: str, fix: str
) -> None:
    config = str(write_job(tmp_path, extra_directives=[line]))
    for command in ("render", "validate"):  # validate runs the same checks, without rendering
        result = jobgen(command, "-s", scheduler, config)
        assert_refused(result, f"extra_directives: '{line}' conflicts with the generated '{generated}'; {fix}")


@pytest.mark.parametrize(
    "scheduler,line,generated,fix",
    [CONFLICTS[0], ("slurm", "#SBATCH --time=2-00:00:00", TIME, "set resources.time_limit instead")],
)
def test_site_profile_directive_that_repeats_a_generated_option_is_refused_at_render_and_submit(
    tmp_path: Path, scheduler: str, line: str, generated: str, fix: str
) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"defaults": {"extra_directives": [line]}}))
    config = write_job(tmp_path)
    for command in (["render"], ["submit", "--dry-run"], ["validate"]):
        result = jobgen(*command, "-s", scheduler, str(config), "--site", str(site), cwd=tmp_path)
        assert_refused(result, f"extra_directives: '{line}' conflicts with the generated '{generated}'; {fix}")
    assert not (tmp_path / "runs").exists()


def test_validate_checks_for_the_site_profiles_scheduler_unless_given_another(tmp_path: Path) -> None:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"scheduler": "slurm", "defaults": {"extra_directives": ["#SBATCH -t 60"]}}))
    config = str(write_job(tmp_path))
    result = jobgen("validate", config, "--site", str(site), cwd=tmp_path)
    assert_refused(result, f"extra_directives: '#SBATCH -t 60' conflicts with the generated '{TIME}'; "
                           "set resources.time_limit instead")
    fixed = jobgen("validate", config, "--site", str(site), "--set", "extra_directives=[]", cwd=tmp_path)
    assert fixed.returncode == 0 and fixed.stdout.splitlines()[0].endswith("; checked for slurm"), fixed.stderr
    # --scheduler wins over the profile's; a PBS script leaves Slurm's directives out.
    pbs = jobgen("validate", "-s", "pbs", config, "--site", str(site), cwd=tmp_path)
    assert pbs.returncode == 0 and pbs.stdout.splitlines()[0].endswith("; checked for pbs"), pbs.stderr
    plain = jobgen("validate", config, "--site", "none", cwd=tmp_path)
    assert plain.returncode == 0 and plain.stdout.splitlines()[0].endswith("; not checked against a scheduler (give --scheduler)")


def test_validate_refuses_a_launcher_the_scheduler_cannot_use(tmp_path: Path) -> None:
    config = str(write_job(tmp_path))
    result = jobgen("validate", "-s", "slurm", config, "--set", "launch.launcher=pbsdsh")
    assert_refused(result, "'launch.launcher' is 'pbsdsh', which slurm cannot use; accepted: srun")
    assert jobgen("validate", "-s", "pbs", config, "--set", "launch.launcher=pbsdsh").returncode == 0


ALLOWED = {
    "pbs": ["#PBS -m abe", "#PBS -M me@example.org", "#PBS -W group_list=ml", "#PBS -l software=abaqus"],
    "torque": ["#PBS -m abe", "#PBS -W group_list=ml"],
    # --exclusive passes while the job leaves it unset: jobgen does not generate it then.
    "slurm": ["#SBATCH --mail-type=FAIL", "#SBATCH --reservation=ft", "#SBATCH --gres=nvme:1", "#SBATCH --exclusive"],
}


@pytest.mark.parametrize("scheduler", ALLOWED)
def test_extra_directives_jobgen_does_not_generate_pass_through(tmp_path: Path, scheduler: str) -> None:
    prefix, other_flavour = ("#SBATCH", "#PBS -m abe") if scheduler == "slurm" else ("#PBS", "#SBATCH --mail-type=FAIL")
    allowed = ALLOWED[scheduler]
    result = jobgen("render", "-s", scheduler, str(write_job(tmp_path, extra_directives=allowed + [other_flavour])))
    assert result.returncode == 0, result.stderr
    assert header(result.stdout, prefix)[-len(allowed):] == allowed
    assert header(result.stdout, other_flavour.split()[0]) == []
