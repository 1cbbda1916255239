"""Site profiles through the `jobgen` command, as an admin writes them and a user relies on them:
limits refused in one line, the scheduler and the site taken from the profile and the user's
config, and `jobgen sites list/show/check`."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import EXAMPLES, REPO, install_as_pip_does, jobgen, node_script_of, shell_findings

JOB = {
    "name": "jobgen-test-site",
    "resources": {"nodes": 2, "gpus_per_node": 4, "time_limit": "72:00:00", "partition": "gpu"},
    "training": {"model": "m", "data": "d"},
}
PROFILE = {
    "description": "A test site.",
    "scheduler": "slurm",
    "defaults": {"resources": {"partition": "gpu", "account": "ml"}},
    "limits": {"gpu": {"max_nodes": 4, "max_time": "48:00:00", "max_gpus_per_node": 4}},
}


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def site(tmp_path: Path) -> dict:
    """A folder on JOBGEN_SITE_PATH holding the profile `testsite`, and an empty user config folder."""
    write_yaml(tmp_path / "sites" / "testsite.yaml", PROFILE)
    return {"JOBGEN_SITE_PATH": str(tmp_path / "sites"), "XDG_CONFIG_HOME": str(tmp_path / "config")}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("jobgen: error:")]


def test_a_job_over_its_partitions_limits_is_refused_in_one_line_per_limit(tmp_path: Path, site: dict) -> None:
    config = write_yaml(tmp_path / "job.yaml", JOB)
    for command in (["render"], ["validate"], ["submit", "--dry-run"]):
        result = jobgen(*command, "--site", "testsite", str(config), cwd=tmp_path, env=site)
        assert result.returncode == 2, command
        assert error_lines(result.stderr) == [
            f"jobgen: error: {config}: partition gpu allows at most 48:00:00; the job asks for 72:00:00: "
            "lower 'resources.time_limit' or choose another partition (limits of site testsite)"
        ], command

    result = jobgen("render", "--site", "testsite", str(config), "--set", "resources.time_limit='48:00:00'",
                    "--set", "resources.nodes=5", "--set", "resources.gpus_per_node=8", cwd=tmp_path, env=site)
    assert error_lines(result.stderr) == [
        f"jobgen: error: {config}: partition gpu allows at most 4 nodes; the job asks for 5: "
        "lower 'resources.nodes' or choose another partition (limits of site testsite)",
        f"jobgen: error: {config}: partition gpu allows at most 4 GPUs per node; the job asks for 8: "
        "lower 'resources.gpus_per_node' or choose another partition (limits of site testsite)",
    ]
    # Within its limits, or in a partition the site sets none for, the job renders.
    assert jobgen("render", "--site", "testsite", str(config), "--set", "resources.time_limit='48:00:00'", env=site).returncode == 0
    assert jobgen("render", "--site", "testsite", str(config), "--set", "resources.partition=long", env=site).returncode == 0


def test_a_pbs_site_says_queue(tmp_path: Path, site: dict) -> None:
    write_yaml(tmp_path / "sites" / "pbssite.yaml", {**PROFILE, "scheduler": "pbs", "defaults": {}})
    result = jobgen("render", "--site", "pbssite", str(write_yaml(tmp_path / "job.yaml", JOB)), env=site)
    assert "queue gpu allows at most 48:00:00; the job asks for 72:00:00: lower 'resources.time_limit' or choose another queue" in result.stderr


def test_the_scheduler_comes_from_the_profile_unless_given(tmp_path: Path, site: dict) -> None:
    config = write_yaml(tmp_path / "job.yaml", {**JOB, "resources": {**JOB["resources"], "time_limit": "01:00:00"}})
    from_site = jobgen("render", "--site", "testsite", str(config), env=site)
    assert from_site.returncode == 0, from_site.stderr
    assert "#SBATCH --partition=gpu" in from_site.stdout and "#SBATCH --account=ml" in from_site.stdout
    assert "#PBS" in jobgen("render", "--site", "testsite", "-s", "pbs", str(config), env=site).stdout

    without = jobgen("render", str(config), env=site)
    assert without.returncode == 2
    [line] = error_lines(without.stderr)
    # Installed scheduler plug-ins join the list after the bundled four.
    assert line.startswith("jobgen: error: no scheduler: give --scheduler (slurm|pbs|torque|local")
    assert line.endswith(
        f"), or a site profile that sets 'scheduler:' (--site NAME, or `site: NAME` in {site['XDG_CONFIG_HOME']}/jobgen/config.yaml)"
    )


def test_a_list_in_the_job_file_that_drops_the_sites_items_says_so(tmp_path: Path, site: dict) -> None:
    """Mappings merge key by key, a list is replaced whole: a job file's environment.modules that
    leaves out a module the site profile loads is a warning naming the key and what it drops."""
    write_yaml(tmp_path / "sites" / "testsite.yaml", {**PROFILE, "defaults": {
        **PROFILE["defaults"], "environment": {"modules": ["cuda/12.4", "nccl/2.21"], "setup": ["ulimit -n 4096"]}}})
    job = {**JOB, "resources": {**JOB["resources"], "time_limit": "01:00:00"},
           "launch": {"entrypoint": "jobgen-probe"}}  # no model or data for validate to read
    config = write_yaml(tmp_path / "job.yaml", {**job, "environment": {"modules": ["cuda/12.4", "gcc/13"]}})
    for command in (["validate"], ["render", "-o", "/dev/null"]):
        result = jobgen(*command, "--site", "testsite", str(config), cwd=tmp_path, env=site)
        assert result.returncode == 0, result.stderr
        assert [line for line in result.stderr.splitlines() if "replaces" in line] == [
            f"jobgen: warning: environment.modules in {config} replaces the site profile's list (testsite), dropping "
            f"nccl/2.21: lists are not merged; add it to environment.modules in {config} to keep it"
        ], command
    # A list that keeps every item of the site's (or a key the job file leaves alone) is no news.
    write_yaml(config, {**job, "environment": {"modules": ["nccl/2.21", "cuda/12.4", "gcc/13"]}})
    assert "replaces" not in jobgen("validate", "--site", "testsite", str(config), cwd=tmp_path, env=site).stderr


def test_the_default_site_comes_from_the_users_config_and_none_opts_out(tmp_path: Path, site: dict) -> None:
    config = write_yaml(tmp_path / "job.yaml", {**JOB, "resources": {"gpus_per_node": 4}})
    write_yaml(tmp_path / "config" / "jobgen" / "config.yaml", {"site": "testsite"})
    result = jobgen("render", str(config), env=site)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=gpu" in result.stdout and "(site profile testsite)" in result.stdout

    opted_out = jobgen("render", "--site", "none", "-s", "slurm", str(config), env=site)
    assert opted_out.returncode == 0 and "--partition" not in opted_out.stdout

    # Without XDG_CONFIG_HOME, the config is ~/.config/jobgen/config.yaml.
    home = tmp_path / "home"
    write_yaml(home / ".config" / "jobgen" / "config.yaml", {"site": "testsite"})
    env = {"JOBGEN_SITE_PATH": site["JOBGEN_SITE_PATH"], "HOME": str(home), "XDG_CONFIG_HOME": ""}
    assert "#SBATCH --partition=gpu" in jobgen("render", str(config), env=env).stdout

    write_yaml(tmp_path / "config" / "jobgen" / "config.yaml", {"sit": "testsite"})
    typo = jobgen("render", str(config), env=site)
    assert typo.returncode == 2
    assert error_lines(typo.stderr) == [
        f"jobgen: error: {tmp_path}/config/jobgen/config.yaml: unknown key 'sit' (did you mean 'site'?); known keys here: site"
    ]


def test_a_profiles_mistakes_are_one_line_naming_the_key(tmp_path: Path, site: dict) -> None:
    config = write_yaml(tmp_path / "job.yaml", JOB)
    cases = {
        "limit": "unknown key 'limit' in site profile; known keys: description, scheduler, defaults, limits, policy, templates, examples",
        "defaults": "defaults: unknown key 'resources.partiton' (did you mean 'partition'?)",
        "limits": "'limits.gpu.max_time' is '2 days': expected [D-]HH:MM:SS",
        "scheduler": "'scheduler': unknown scheduler 'lsf'",
        "unquoted": "'limits.gpu.max_time' is 172800: expected [D-]HH:MM:SS in quotes, e.g. max_time: \"48:00:00\"; "
                    "unquoted, YAML 1.1 reads 48:00:00 as the number 172800 (base 60)",
        "twice": "key 'limits.gpu.max_nodes' is given twice, at line 4 and line 5; YAML would keep only the second: keep one",
    }
    profiles = {
        "limit": {"limit": {}},
        "defaults": {"defaults": {"resources": {"partiton": "gpu"}}},
        "limits": {"limits": {"gpu": {"max_time": "2 days"}}},
        "scheduler": {"scheduler": "lsf"},
        "unquoted": "limits:\n  gpu: {max_time: 48:00:00}\n",  # as an admin types it
        "twice": "scheduler: slurm\nlimits:\n  gpu:\n    max_nodes: 4\n    max_nodes: 64\n",
    }
    for key, profile in profiles.items():
        path = tmp_path / "sites" / f"bad-{key}.yaml"
        if isinstance(profile, str):
            path.write_text(profile)
        else:
            write_yaml(path, profile)
        result = jobgen("render", "-s", "slurm", "--site", f"bad-{key}", str(config), env=site)
        [line] = error_lines(result.stderr)
        assert line.startswith(f"jobgen: error: {path}: {cases[key]}"), line


def test_sites_list_names_each_profile_where_it_is_found_and_what_it_shadows(tmp_path: Path, site: dict) -> None:
    write_yaml(tmp_path / "first" / "testsite.yaml", {"scheduler": "pbs"})
    env = {**site, "JOBGEN_SITE_PATH": f"{tmp_path / 'first'}:{tmp_path / 'sites'}"}
    write_yaml(tmp_path / "config" / "jobgen" / "config.yaml", {"site": "testsite"})
    result = jobgen("sites", "list", env=env)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["*", "testsite", "pbs", f"{tmp_path}/first/testsite.yaml", "($JOBGEN_SITE_PATH)"] in rows
    assert ["shadows", f"{tmp_path}/sites/testsite.yaml", "($JOBGEN_SITE_PATH)"] in rows
    assert ["pbspro-tmrsh", "pbs", f"{REPO}/configs/sites/pbspro-tmrsh.yaml", "(bundled)"] in rows


def test_sites_show_prints_the_profile_as_read_and_where_it_came_from(tmp_path: Path, site: dict) -> None:
    (tmp_path / "sites" / "overrides").mkdir()
    write_yaml(tmp_path / "sites" / "testsite.yaml", {**PROFILE, "templates": "overrides"})
    result = jobgen("sites", "show", "testsite", env=site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"# site testsite: {tmp_path}/sites/testsite.yaml ($JOBGEN_SITE_PATH)"
    shown = yaml.safe_load(result.stdout)
    assert shown == {**PROFILE, "templates": str(tmp_path / "sites" / "overrides")}


ARCHETYPES = {  # profile: (scheduler, the jobs it renders: the bundled examples and its own)
    "slurm-pyxis": ("slurm", len(EXAMPLES) + 1),
    "slurm-apptainer-lmod": ("slurm", len(EXAMPLES)),
    "pbspro-tmrsh": ("pbs", len(EXAMPLES)),
}


@pytest.mark.parametrize("profile", ARCHETYPES)
def test_sites_check_passes_on_each_bundled_archetype(profile: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    scheduler, jobs = ARCHETYPES[profile]
    if scheduler == "slurm":
        request.getfixturevalue("slurm_cluster")  # so that sbatch --test-only runs, on the test cluster
    result = jobgen("sites", "check", profile, env={"XDG_CONFIG_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""
    checks = "bash -n, shellcheck, sbatch --test-only" if scheduler == "slurm" else "bash -n, shellcheck"
    assert f"site {profile}, {scheduler}: {jobs} job(s), {jobs} rendered; {checks}: 0 problem(s)" in result.stderr
    if profile == "slurm-pyxis":
        # The test cluster's Slurm has no pyxis: the check says what it could not check there.
        has_pyxis = "--container-image" in subprocess.run(["srun", "--help"], capture_output=True, text=True).stdout
        noted = "1 job(s) use pyxis, and this Slurm's srun has no --container-image (pyxis is not installed here)"
        assert (noted in result.stderr) == (not has_pyxis)


@pytest.mark.usefixtures("slurm_cluster")
def test_sites_check_gives_one_line_per_problem_and_fails(tmp_path: Path, site: dict) -> None:
    # A template override with a bash syntax error in one job's script and a shellcheck warning in
    # the others', a partition this cluster lacks, limits two of the examples exceed, and an
    # example of the site's own that does not validate.
    (tmp_path / "sites" / "overrides").mkdir()
    (tmp_path / "sites" / "overrides" / "slurm.sh.j2").write_text(
        '{% extends "bundled/slurm.sh.j2" %}\n{% block prologue %}\n'
        '{% if job.name == "llama3-8b-lora" %}\nif then\n{% else %}\nsite_unused=1\n{% endif %}\n{% endblock %}\n'
    )
    write_yaml(tmp_path / "sites" / "examples" / "broken.yaml", {"training": {"model": "m"}})
    write_yaml(tmp_path / "sites" / "testsite.yaml", {
        **PROFILE,
        "defaults": {"resources": {"partition": "nosuch"}},
        "limits": {"gpu": {"max_nodes": 2}, "debug": {"max_time": "00:10:00"}},
        "templates": "overrides",
        "examples": "examples",
    })
    result = jobgen("sites", "check", "testsite", env=site)
    assert result.returncode == 1
    examples = {path.stem: str(path) for path in EXAMPLES}
    problems = result.stdout.splitlines()
    # Where the override's lines land depends on the bundled template: `line N` is not pinned.
    unpinned = [re.sub(r"line \d+", "line N", line) for line in problems]
    assert unpinned[:5] == [
        f"{examples['cpu-debug-2node']}: partition debug allows at most 00:10:00; the job asks for 00:30:00: "
        "lower 'resources.time_limit' or choose another partition (limits of site testsite)",
        f"{examples['llama-lora-2node']}: bash -n: batch script, line N: syntax error near unexpected token `then'; line N: `if then'",
        f"{examples['qlora-1node']}: sbatch --test-only: allocation failure: Invalid partition name specified",
        f"{examples['qwen-full-zero3-4node']}: partition gpu allows at most 2 nodes; the job asks for 4: "
        "lower 'resources.nodes' or choose another partition (limits of site testsite)",
        f"{tmp_path}/sites/examples/broken.yaml: 'training.data' is required",
    ]
    # shellcheck's own findings, one line each: its parse errors in the one, the warning in the other.
    linted = unpinned[5:]
    parse_errors = [line for line in linted if line.startswith(f"{examples['llama-lora-2node']}: shellcheck: batch script, line N")]
    warned = sorted(line.split(": shellcheck: ")[0] for line in linted if line not in parse_errors
                    and line.endswith("warning: site_unused appears unused. Verify use (or export if used externally). [SC2034]"))
    assert parse_errors and len(parse_errors) + len(warned) == len(linted), linted
    assert warned == sorted([examples["hf-trainer-script-2node"], examples["qlora-1node"]])
    assert f"6 job(s), 3 rendered; bash -n, shellcheck, sbatch --test-only: {len(problems)} problem(s)" in result.stderr


def test_a_site_package_ships_its_profile_through_the_jobgen_sites_entry_point(tmp_path: Path, site: dict) -> None:
    # Laid out as pip installs a package: the package, and its dist-info naming the entry point.
    packages = tmp_path / "site-packages"
    write_yaml(packages / "mycluster_jobgen" / "sites" / "mycluster.yaml", {**PROFILE, "description": "From a package."})
    (packages / "mycluster_jobgen" / "__init__.py").write_text("")
    info = packages / "mycluster_jobgen-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mycluster-jobgen\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[jobgen.sites]\nmycluster = mycluster_jobgen\n")
    env = {**site, "PYTHONPATH": os.pathsep.join(filter(None, [str(packages), os.environ.get("PYTHONPATH")]))}

    rows = [line.split() for line in jobgen("sites", "list", env=env).stdout.splitlines()]
    assert ["mycluster", "slurm", f"{packages}/mycluster_jobgen/sites/mycluster.yaml", "(site", "package", "mycluster)"] in rows
    config = write_yaml(tmp_path / "job.yaml", {**JOB, "resources": {"gpus_per_node": 4}})
    result = jobgen("render", "--site", "mycluster", str(config), env=env)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=gpu" in result.stdout


def test_the_site_package_of_docs_admins_md_works_as_written(tmp_path: Path) -> None:
    # docs/example-site-package: a profile, a template override and an LSF scheduler plug-in.
    install_as_pip_does(REPO / "docs" / "example-site-package", tmp_path / "site-packages")
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site-packages"), os.environ.get("PYTHONPATH")])),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    check = jobgen("sites", "check", "mycluster", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"site mycluster, lsf: {len(EXAMPLES)} job(s), {len(EXAMPLES)} rendered; bash -n, shellcheck: 0 problem(s)" in check.stderr

    script = jobgen("render", "--site", "mycluster", str(EXAMPLES[0]), env=env).stdout
    assert "#BSUB -q debug" in script and "for lsf (site profile mycluster)" in script
    assert 'mapfile -t JOBGEN_HOSTS < <(awk \'!seen[$0]++\' "$LSB_DJOB_HOSTFILE")' in script
    assert "source /opt/mycluster/venvs/jobgen/bin/activate" in script  # the package's node.sh.j2 override

    # The Grid Engine plug-in beside it, written on paper: only its module, its template and one
    # entry point, and the script it renders is one bash and shellcheck accept.
    sge = jobgen("render", "--site", "mycluster", "-s", "sge", str(EXAMPLES[0]), env=env)
    assert sge.returncode == 0, sge.stderr
    assert "#$ -pe one-per-host 2" in sge.stdout and "#$ -q debug" in sge.stdout
    assert 'mapfile -t JOBGEN_HOSTS < <(awk \'{print $1}\' "$PE_HOSTFILE")' in sge.stdout
    assert "\nexit 99\n" in sge.stdout
    (tmp_path / "job.sh").write_text(sge.stdout)
    (tmp_path / "node.sh").write_text(node_script_of(sge.stdout))
    assert shell_findings(tmp_path / "job.sh", tmp_path / "node.sh") == ""
