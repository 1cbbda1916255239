"""`resources.spare_nodes: K`: the job asks for nodes + K and trains on `nodes` of them; a node
range (`nodes: "2-4"`) goes on with fewer nodes of its allocation. What the script does after a
hang is proven on the real cluster (test_slurm_spare_nodes.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen


def _job(tmp_path: Path, **resources) -> Path:
    job = {
        "name": "spares",
        "resources": {"nodes": 2, "gpus_per_node": 0, **resources},
        "launch": {"procs_per_node": 2},
        "training": {"model": "m", "data": "d", "per_device_batch_size": 2},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _render(path: Path) -> str:
    result = jobgen("render", "-s", "slurm", str(path))
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_a_job_with_spares_asks_slurm_for_them_and_starts_its_step_on_the_trained_nodes_only(tmp_path):
    script = _render(_job(tmp_path, spare_nodes=2))
    assert "#SBATCH --nodes=4\n" in script
    assert 'srun --nodes="$NNODES" --nodelist="$(IFS=,; echo "${JOBGEN_HOSTS[*]}")" --ntasks="$NNODES"' in script
    plain = _render(_job(tmp_path))
    assert "#SBATCH --nodes=2\n" in plain and "--nodelist" not in plain and "jobgen_choose_hosts" not in plain
    # A node that goes down does not end the job with spares (Slurm's default would): only then.
    assert "#SBATCH --no-kill\n" in script and "--no-kill" not in plain


def _choose(script: str, allocated: list[str], excluded: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    """The script's own host choice, run on an allocation and an excluded-nodes file."""
    body = script[script.index("jobgen_choose_hosts() {"):]
    body = body[: body.index("\n}\n") + 3]
    (run_dir / "excluded-nodes").write_text("".join(f"{node}\n" for node in excluded))
    program = (f"JOBGEN_RUN_DIR={run_dir}; jobgen_allocated=({' '.join(allocated)}); JOBGEN_HOSTS=(before)\n{body}"
               'jobgen_choose_hosts; echo "$?|${JOBGEN_HOSTS[*]}|${jobgen_spares[*]}"')
    return subprocess.run(["bash", "-c", program], capture_output=True, text=True)


@pytest.mark.parametrize("excluded,trained,spares", [
    ([], "n1 n2", "n3 n4"),
    (["n2"], "n1 n3", "n4"),  # a spare in the bad node's place, the node ranks in allocation order
    (["n1", "n3"], "n2 n4", ""),
])
def test_the_trained_nodes_are_the_first_not_excluded_and_the_rest_wait(tmp_path, excluded, trained, spares):
    chosen = _choose(_render(_job(tmp_path, spare_nodes=2)), ["n1", "n2", "n3", "n4"], excluded, tmp_path)
    assert chosen.stdout.strip() == f"0|{trained}|{spares}", chosen.stderr


@pytest.mark.parametrize("excluded,outcome", [
    (["n2"], "0|n1 n3 n4|"),  # a node range shrinks within its allocation, down to its smallest count
    (["n1", "n4"], "0|n2 n3|"),
    (["n1", "n2", "n3"], "1|before|"),
])
def test_a_node_range_goes_on_with_the_healthy_nodes_while_they_are_enough(tmp_path, excluded, outcome):
    path = _job(tmp_path, nodes="2-4")
    job = yaml.safe_load(path.read_text())
    job["training"]["global_batch_size"] = 48
    path.write_text(yaml.safe_dump(job))
    chosen = _choose(_render(path), ["n1", "n2", "n3", "n4"], excluded, tmp_path)
    assert chosen.stdout.strip() == outcome, chosen.stderr


def test_without_requeue_a_node_range_restarts_nowhere_and_its_script_is_plain(tmp_path):
    path = _job(tmp_path, nodes="2-4")
    job = yaml.safe_load(path.read_text())
    job["training"]["global_batch_size"] = 48
    job["requeue"] = {"enabled": False}
    path.write_text(yaml.safe_dump(job))
    script = _render(path)
    assert "jobgen_choose_hosts" not in script and "--nodelist" not in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_with_no_spare_left_the_choice_fails_and_the_hosts_stay_as_they_were(tmp_path):
    chosen = _choose(_render(_job(tmp_path, spare_nodes=1)), ["n1", "n2", "n3"], ["n1", "n2"], tmp_path)
    assert chosen.stdout.strip() == "1|before|", chosen.stderr


@pytest.mark.parametrize("resources,requeue,message", [
    ({"nodes": "2-3", "spare_nodes": 1}, {}, "resources.spare_nodes: a job with spare nodes trains on one node count, "
     "not a range (2-3); give resources.nodes one count, such as 2"),
    ({"spare_nodes": 1}, {"enabled": False}, "resources.spare_nodes: a spare takes a failed node's place when the job "
     "restarts, which requeue.enabled: false turns off; enable requeue or drop spare_nodes"),
    ({"spare_nodes": -1}, {}, "resources.spare_nodes"),
])
def test_spares_that_cannot_work_are_refused_naming_the_field(tmp_path, resources, requeue, message):
    path = _job(tmp_path, **resources)
    job = yaml.safe_load(path.read_text())
    job["requeue"] = requeue
    path.write_text(yaml.safe_dump(job))
    result = jobgen("render", "-s", "slurm", str(path))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("scheduler,request_line", [("pbs", "#PBS -l select=3:ncpus=2:mpiprocs=1\n"),
                                                     ("torque", "#PBS -l nodes=3:ppn=2\n")])
def test_pbs_and_torque_ask_for_the_spares_and_start_each_node_on_its_host(tmp_path, scheduler, request_line):
    result = jobgen("render", "-s", scheduler, str(_job(tmp_path, spare_nodes=1)))
    assert result.returncode == 0, result.stderr
    assert request_line in result.stdout
    # pbsdsh -n takes a host's index in the node file, which is not its rank once a spare trains.
    by_index = 'pbsdsh -n "$(jobgen_allocation_index "${JOBGEN_HOSTS[rank]}")" --'
    assert (by_index in result.stdout) == (scheduler == "pbs")
    assert subprocess.run(["bash", "-n"], input=result.stdout, text=True).returncode == 0


def test_a_local_run_refuses_spares(tmp_path):
    result = jobgen("render", "-s", "local", str(_job(tmp_path, spare_nodes=1)))
    assert result.returncode == 2
    assert ("resources.spare_nodes: local jobs cannot keep spare nodes (Slurm, PBS Pro and Torque jobs can); drop "
            "spare_nodes to run it here") in result.stderr, result.stderr


@pytest.mark.parametrize("scheduler", ["pbs", "torque"])
@pytest.mark.parametrize("own,up,excluded,chosen", [
    # The node file's full names, pbsnodes' short ones: the bad node stays out, the others are asked for by pbsnodes' name.
    (["n1.cluster.local", "n2.cluster.local"], ["n1", "n2", "n3"], ["n2.cluster.local"], "n1 n3"),
    (["n1", "n2"], ["n1.cluster.local", "n2.cluster.local", "n3.cluster.local"], ["n2"], "n1.cluster.local n3.cluster.local"),
    (["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.2", "10.0.0.3"], ["10.0.0.2"], "10.0.0.1 10.0.0.3"),  # addresses whole
    (["n1", "n2"], ["n1", "n2"], ["n2"], "n1"),  # too few: the script says so
])
def test_a_continuation_matches_node_file_and_pbsnodes_names_by_their_short_name(tmp_path, scheduler, own, up, excluded, chosen):
    """PBS names a host in the node file one way and in pbsnodes maybe another
    (node01.cluster.local, node01): the continuation's hosts, chosen by the script's own function."""
    job = yaml.safe_load(_job(tmp_path).read_text())
    job["resources"]["time_limit"] = "01:00:00"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = jobgen("render", "-s", scheduler, str(tmp_path / "job.yaml"))
    assert result.returncode == 0, result.stderr
    body = result.stdout[result.stdout.index("jobgen_continuation_hosts() {"):]
    body = body[: body.index("\n}\n") + 3]
    (tmp_path / "excluded-nodes").write_text("".join(f"{node}\n" for node in excluded))
    program = f"set -o pipefail; JOBGEN_RUN_DIR={tmp_path}\n{body}" + 'jobgen_continuation_hosts 2 "$(printf "%s\\n" {})" {} | paste -sd" "'.format(
        " ".join(up), " ".join(own))
    shown = subprocess.run(["bash", "-c", program], capture_output=True, text=True)
    assert (shown.returncode, shown.stdout.strip(), shown.stderr) == (0, chosen, "")
