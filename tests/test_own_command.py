"""A job that runs its own program (launch.command) instead of jobgen-train: validated and
rendered without a training section, started by torchrun on every rank, given the newest
complete checkpoint at each start, stopped by its signal; and the Hugging Face Trainer callback
that saves at the stop. Real runs on the local scheduler (no cluster needed)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import jobgen, node_script_of, shell_findings, tiny_model

VENV_PATH = f"{Path(sys.executable).parent}:{os.environ['PATH']}"


def write_job(folder: Path, launch: dict, **sections) -> Path:
    job = {"name": "own", "resources": {"nodes": 1, "gpus_per_node": 0, "time_limit": "00:10:00"},
           "launch": {"procs_per_node": 2, **launch}, **sections}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(job))
    return folder / "job.yaml"


FINETUNE = ["python", "finetune.py", "--deepspeed", "ds.json", "--note", "two words"]


def test_a_job_with_its_own_command_validates_and_renders_without_training(tmp_path: Path) -> None:
    config = write_job(tmp_path, {"command": FINETUNE, "resume_argument": "--resume_from_checkpoint {checkpoint}"})
    checked = jobgen("validate", "-s", "slurm", str(config), cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert "training" not in checked.stderr
    assert "runs its own program (python ...; launch.command)" in checked.stdout
    rendered = jobgen("render", "-s", "slurm", str(config), "-o", str(tmp_path / "job.sbatch"), cwd=tmp_path)
    assert rendered.returncode == 0 and "error" not in rendered.stderr, rendered.stderr
    script = (tmp_path / "job.sbatch").read_text()
    node = node_script_of(script)
    assert "jobgen_command=(python finetune.py --deepspeed ds.json --note 'two words')" in node
    assert 'jobgen_command+=(--resume_from_checkpoint "$JOBGEN_RESUME_CHECKPOINT")' in node
    assert 'JOBGEN_STOP_SIGNAL=TERM' in node and '"${jobgen_command[@]}"' in node
    (tmp_path / "node.sh").write_text(node)
    assert shell_findings(tmp_path / "job.sbatch", tmp_path / "node.sh") == ""


@pytest.mark.parametrize("launch, sections, message", [
    ({"command": []}, {}, "'launch.command' is []: needs the program and its arguments, e.g. [python, finetune.py]"),
    ({"command": "python train.py --lr 1e-4"}, {}, "give the program and its arguments as a list of words, e.g. command: [python, train.py, --lr, \"1e-4\"]"),
    ({"command": ["python", "t.py"]}, {"training": {"model": "m", "data": "d"}}, "training is for jobgen-train; a job with launch.command runs its own program"),
    ({"command": ["python", "t.py"], "entrypoint": "jobgen-train"}, {}, "launch.command and launch.entrypoint (jobgen-train) are both set"),
    ({"command": ["python", "t.py"], "resume_argument": "--resume"}, {}, "write {checkpoint} for its path"),
    ({"resume_argument": "--resume {checkpoint}"}, {"training": {"model": "m", "data": "d"}}, "launch.resume_argument is for a program of the job's own: set launch.command too"),
    ({"report_to": ["wandb"]}, {"training": {"model": "m", "data": "d"}}, "launch.report_to is for a program of the job's own: set launch.command too"),
    ({"command": ["python", "t.py"], "report_to": ["comet"]}, {}, "'launch.report_to.0' is 'comet': Input should be 'wandb' or 'mlflow'"),
    ({}, {}, "training is missing: give training.model and training.data for jobgen-train, or launch.command"),
])
def test_a_wrong_own_command_is_one_line_naming_the_field(tmp_path: Path, launch: dict, sections: dict, message: str) -> None:
    config = write_job(tmp_path, launch, **sections)
    result = jobgen("render", "-s", "slurm", str(config), "-o", "/dev/null", cwd=tmp_path)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# A program of the user's own, started by torchrun on every rank: it trains "steps", writes a
# checkpoint folder at each (complete once its trainer_state.json is there, as the Trainer's), and
# on its stop signal saves one at the step it is at and exits 0.
PLAIN_SCRIPT = r'''
import json, os, signal, sys, time
stop = []
signal.signal(signal.SIGUSR1, lambda *_: stop.append("SIGUSR1"))
rank, resume = int(os.environ["RANK"]), None
if "--resume" in sys.argv:
    resume = sys.argv[sys.argv.index("--resume") + 1]
start = json.load(open(os.path.join(resume, "trainer_state.json")))["global_step"] if resume else 0
print(f"rank {rank} of {os.environ['WORLD_SIZE']}: resume={resume} start={start}", flush=True)
for step in range(start + 1, 31):
    time.sleep(0.2)
    if rank == 0:
        folder = f"out/checkpoint-{step}"
        os.makedirs(folder, exist_ok=True)
        json.dump({"global_step": step, "max_steps": 30, "log_history": [{"loss": 1.0 / step, "step": step}]},
                  open(f"{folder}/trainer_state.json", "w"))
        with open("steps.log", "a") as log:
            log.write(f"{step}\n")
    if stop:
        print(f"rank {rank}: {stop[0]}: saved step {step}, exiting", flush=True)
        sys.exit(0)
'''


def test_own_program_gets_the_newest_complete_checkpoint_and_its_stop_signal(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PLAIN_SCRIPT)
    # A checkpoint being written when the last run was killed: newer, but without trainer_state.json.
    (tmp_path / "out" / "checkpoint-40").mkdir(parents=True)
    config = write_job(tmp_path, {"command": ["python", "train.py"], "stop_signal": "USR1",
                                  "resume_argument": "--resume {checkpoint}", "checkpoints": "out/checkpoint-*"})
    env = {**os.environ, "PATH": VENV_PATH}
    submit = [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"]
    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").exists():
        assert time.time() < deadline and first.poll() is None, first.stdout.read() if first.poll() is not None else "no step 3"
        time.sleep(0.2)
    # The batch shell alone, as a scheduler's time-limit warning reaches it: it writes the stop
    # file, and jobgen-torchrun sends the ranks SIGUSR1.
    os.kill(first.pid, signal.SIGINT)
    output, _ = first.communicate(timeout=120)
    run_dir = tmp_path / "runs" / "own"
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*node0.out")))
    assert "rank 0: SIGUSR1: saved step" in logs and "rank 1: SIGUSR1: saved step" in logs, logs
    assert "sent SIGUSR1 to the ranks" in logs
    first_segment = [json.loads(line) for line in (run_dir / "segments.jsonl").read_text().splitlines()][-1]
    assert first_segment["outcome"] not in ("failed", "completed"), (first_segment, output)
    stopped_at = int(first_segment["last_step"])
    assert stopped_at >= 3

    second = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*node0.out")))
    assert f"rank 0 of 2: resume={tmp_path}/out/checkpoint-{stopped_at} start={stopped_at}" in logs
    assert "checkpoint-40" not in logs  # the incomplete one is never passed
    steps = [int(line) for line in (tmp_path / "steps.log").read_text().split()]
    assert steps == list(range(1, 31)), steps  # every step once, in order
    status = jobgen("status", str(run_dir), cwd=tmp_path)
    assert "own program (launch.command) python train.py: jobgen cannot see its steps while it runs" in status.stdout
    assert "last loss 0.0333 at step 30/30" in status.stdout, status.stdout


def test_resume_from_a_chosen_checkpoint_of_the_own_program_sets_the_later_ones_aside(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PLAIN_SCRIPT)
    for step in (10, 20, 25):  # as a first run left them: 25 was being written when it was killed
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
        if step != 25:
            (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    config = write_job(tmp_path, {"command": ["python", "train.py"], "resume_argument": "--resume {checkpoint}",
                                  "checkpoints": "out/checkpoint-*"})
    wrong = jobgen("submit", "-s", "local", "--dry-run", "--resume-from", "25", str(config), cwd=tmp_path)
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
    assert (f"--resume-from: '25' is not a complete checkpoint of this program (the folders launch.checkpoints, "
            f"out/checkpoint-*, matches under {tmp_path} that hold trainer_state.json: checkpoint-10, checkpoint-20); "
            "give one of them") in wrong.stderr, wrong.stderr
    dry = jobgen("submit", "-s", "local", "--dry-run", "--resume-from", "checkpoint-10", str(config), cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert ("resuming from step 10 (launch.checkpoints); later checkpoints (checkpoint-20, checkpoint-25): "
            "would be set aside") in dry.stderr
    # Said again as the last line, under the script, where a terminal leaves its reader.
    assert dry.stderr.splitlines()[-1] == ("jobgen: dry run, nothing moved or submitted: resuming from step 10 "
                                           "(launch.checkpoints); later checkpoints (checkpoint-20, checkpoint-25): would be set aside")
    assert (tmp_path / "out" / "checkpoint-20").exists()  # a dry run moves nothing

    ran = jobgen("submit", "-s", "local", "--resume-from", "10", str(config), cwd=tmp_path, env={"PATH": VENV_PATH},
                 timeout=180)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    aside = list((tmp_path / "out" / "checkpoints-set-aside").glob("after-step-000010-*"))
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["checkpoint-20", "checkpoint-25"]
    logs = "".join(path.read_text() for path in sorted((tmp_path / "runs" / "own" / "logs").glob("*node0.out")))
    assert f"rank 0 of 2: resume={tmp_path}/out/checkpoint-10 start=10" in logs, logs
    assert [int(line) for line in (tmp_path / "steps.log").read_text().split()] == list(range(11, 31))


def test_a_run_upgraded_to_sealed_checkpoints_resumes_from_its_unsealed_ones_up_to_where_sealing_began(tmp_path: Path) -> None:
    # A run begun under a jobgen whose JobgenCallback did not seal: checkpoint-10 is complete
    # without the seal. Upgraded, its Trainer started at step 10 and said it seals from there; it
    # was lost while saving step 12 (trainer_state.json written, the seal not). The run must go on
    # from step 10, not from step 0 as when every unsealed checkpoint was taken as incomplete.
    (tmp_path / "train.py").write_text(PLAIN_SCRIPT)
    for step in (10, 12):
        (tmp_path / "out" / f"checkpoint-{step}").mkdir(parents=True)
        (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    run_dir = tmp_path / "runs" / "own"
    run_dir.mkdir(parents=True)
    (run_dir / "own-checkpoints-sealed").write_text("10\n")
    config = write_job(tmp_path, {"command": ["python", "train.py"], "resume_argument": "--resume {checkpoint}",
                                  "checkpoints": "out/checkpoint-*"})
    wrong = jobgen("submit", "-s", "local", "--dry-run", "--resume-from", "12", str(config), cwd=tmp_path)
    assert wrong.returncode != 0 and "Traceback" not in wrong.stderr
    assert "hold trainer_state.json: checkpoint-10); give one of them" in wrong.stderr, wrong.stderr
    ran = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*node0.out")))
    assert f"rank 0 of 2: resume={tmp_path}/out/checkpoint-10 start=10" in logs, logs
    assert [int(line) for line in (tmp_path / "steps.log").read_text().split()] == list(range(11, 31))


def test_a_local_run_shows_node_0s_output_and_each_rank_has_its_log(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text('import os, sys\nprint(f"rank {os.environ[\'RANK\']} says hello")\n'
                                       'print(f"rank {os.environ[\'RANK\']} warns", file=sys.stderr)\n')
    config = write_job(tmp_path, {"command": ["python", "train.py"], "procs_per_node": 1},
                       resources={"nodes": 2, "gpus_per_node": 0, "time_limit": "00:10:00"})
    ran = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    assert ran.returncode == 0, ran.stderr
    # The terminal: node 0's output (its one rank), not node 1's, which is in its own log.
    assert "rank 0 says hello" in ran.stderr and "rank 0 warns" in ran.stderr, ran.stderr
    assert "rank 1 says" not in ran.stderr
    run_dir = str(tmp_path / "runs" / "own")
    for rank in (0, 1):
        log = jobgen("logs", run_dir, "--rank", str(rank))
        assert log.returncode == 0, log.stderr
        assert f"rank {rank} says hello\nrank {rank} warns\n" in log.stdout and f"rank {1 - rank}" not in log.stdout
    assert "rank 1 says hello" in jobgen("logs", run_dir, "--node", "1").stdout  # the node logs keep every line


def test_a_command_not_on_the_node_is_one_line_in_its_log(tmp_path: Path) -> None:
    config = write_job(tmp_path, {"command": ["finetune-not-installed", "--x"]})
    result = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=120)
    assert result.returncode != 0
    log = "".join(path.read_text() for path in (tmp_path / "runs" / "own" / "logs").glob("*node0.out"))
    assert "launch.command: 'finetune-not-installed' is not on PATH: give its full path" in log, log
    assert "jobgen: launch.command failed:" in jobgen("logs", str(tmp_path / "runs" / "own")).stdout
    # Where the user looks: the node's own line on the terminal, last, and in `jobgen status`.
    said = result.stderr.splitlines()[-1]
    assert said.startswith("jobgen: node 0 (") and "launch.command: 'finetune-not-installed' is not on PATH" in said, result.stderr
    status = jobgen("status", str(tmp_path / "runs" / "own")).stdout
    assert f"failed: {said.removeprefix('jobgen: ')}" in status, status


def test_the_trainer_callback_saves_and_stops_at_the_step_a_signal_arrives_in(tmp_path: Path) -> None:
    """One process, the real Trainer on the tiny model: SIGUSR1 during step 3 (as jobgen-torchrun
    sends it) gives checkpoint-3, complete, and training ends there instead of at step 12."""
    tiny = tmp_path / "tiny"
    tiny_model(tiny)
    script = tmp_path / "train.py"
    script.write_text(f'''
import os, signal, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments
import jobgen.train.hf
assert "transformers" in sys.modules and "deepspeed" not in sys.modules
from jobgen.train.hf import JobgenCallback
tokenizer = AutoTokenizer.from_pretrained("{tiny}/model")
ids = tokenizer(["the cat is blue"] * 64, padding="max_length", max_length=16)["input_ids"]
dataset = [{{"input_ids": row, "labels": row}} for row in ids]
class SignalAtStep3(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:  # the third step begins
            os.kill(os.getpid(), signal.SIGUSR1)
args = TrainingArguments(output_dir="{tmp_path}/out", max_steps=12, save_steps=100, report_to=[], use_cpu=True,
                         per_device_train_batch_size=2)
trainer = Trainer(model=AutoModelForCausalLM.from_pretrained("{tiny}/model"), args=args, train_dataset=dataset,
                  callbacks=[JobgenCallback(), SignalAtStep3()])
trainer.train()
print("ended at step", trainer.state.global_step)
''')
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "JOBGEN_RUN_DIR": ""})
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "jobgen: stop requested (SIGUSR1): saving checkpoint-3 and stopping" in ran.stdout
    assert "ended at step 3" in ran.stdout
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == ["checkpoint-3"]
    assert (tmp_path / "out" / "checkpoint-3" / "trainer_state.json").exists()


def test_importing_the_callback_module_imports_neither_transformers_nor_deepspeed() -> None:
    code = "import sys, jobgen.train.hf; print('transformers' in sys.modules, 'deepspeed' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["False", "False"]


def test_after_training_the_callback_has_a_gloo_process_group_destroyed_before_the_interpreter_ends(tmp_path: Path) -> None:
    # A Trainer never destroys its process group; gloo's threads can then abort the interpreter's
    # finalization (SIGABRT) on a rank of a complete run, seen on the test clusters. What an
    # earlier atexit handler (run after the callback's) sees is what finalization would meet.
    code = f'''
import atexit, torch.distributed as dist
atexit.register(lambda: print("at exit, process group:", dist.is_initialized()))
dist.init_process_group("gloo", init_method="file://{tmp_path}/group", rank=0, world_size=1)
from jobgen.train.hf import JobgenCallback
JobgenCallback(run_dir=str("{tmp_path}")).on_train_end(None, None, None)
print("training ended")
'''
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split("\n")[:2] == ["training ended", "at exit, process group: False"], ran.stdout


def test_after_training_the_callback_has_the_stop_signals_ignored_while_the_interpreter_ends(tmp_path: Path) -> None:
    # A rank that read the stop file saved and returned before jobgen-torchrun's SIGTERM came: while
    # Python finalizes, the signal's default action would kill it (a failed node, seen in the example's
    # test). What an earlier atexit handler (run after the callback's) sees is what finalization meets.
    code = f'''
import atexit, signal
atexit.register(lambda: print("at exit:", [signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGUSR1)]))
from jobgen.train.hf import JobgenCallback
JobgenCallback(run_dir=str("{tmp_path}")).on_train_end(None, None, None)
'''
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "at exit: [True, True]\n", ran.stdout


# A stand-in for a rank whose file system is slow: rank 1 takes 60 s to begin writing its
# rng_state_1.pth of checkpoint-4 (in the first run only), as a rank on a loaded network file system can. Everything else
# is the real Trainer, its real save order, a real kill.
SLOW_RNG_SAVE_OF_RANK_1 = '''import sys, time
import transformers

_save_rng_state = transformers.Trainer._save_rng_state


def slow_on_rank_1(self, output_dir):
    if self.args.process_index == 1 and self.state.global_step == 4 and "--resume_from_checkpoint" not in sys.argv:
        time.sleep(60)
    _save_rng_state(self, output_dir)


transformers.Trainer._save_rng_state = slow_on_rank_1
'''


def test_a_trainer_checkpoint_whose_ranks_have_not_all_saved_is_not_resumed_from_slow_rank_stand_in(tmp_path: Path) -> None:
    # transformers' _save_checkpoint: rank 0 writes trainer_state.json (launch.checkpoint_complete_file)
    # right after its own rng_state_0.pth, with no barrier for the others'. A run lost in that window
    # left a checkpoint jobgen took as complete; the resumed rank 1 found no RNG file, said so at INFO
    # level and went on with another random stream.
    from jobgen.rundir.files import batch_log_job_id
    from tests.own_scripts import FINETUNE, logged
    from tests.processes import signal_all, with_environment
    from tests.test_slurm_requeue import wait_for

    tiny = tiny_model(tmp_path / "tiny")
    (tmp_path / "train.py").write_text(SLOW_RNG_SAVE_OF_RANK_1 + FINETUNE)
    (tmp_path / "out").mkdir()
    write_job(tmp_path, {"command": ["python", "train.py", str(tiny), "out"], "checkpoints": "out/checkpoint-*",
                         "resume_argument": "--resume_from_checkpoint {checkpoint}"},
              environment={"variables": {"EXTRA_ARGS": json.dumps({"save_steps": 2})}})
    env = {**os.environ, "PATH": VENV_PATH}
    submit = [sys.executable, "-m", "jobgen.cli", "submit", "-s", "local", "job.yaml"]
    first = subprocess.Popen(submit, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    checkpoint = tmp_path / "out" / "checkpoint-4"
    deadline = time.time() + 240
    while not (checkpoint / "trainer_state.json").exists():
        assert time.time() < deadline and first.poll() is None, first.stdout.read() if first.poll() is not None else "no step 4"
        time.sleep(0.2)
    # The window: rank 0's part and trainer_state.json are there, rank 1's RNG state is not. The
    # machine is lost now: every process of the run killed at once.
    assert (checkpoint / "rng_state_0.pth").exists() and not (checkpoint / "rng_state_1.pth").exists()
    run_dir = tmp_path / "runs" / "own"
    job_id = next(name for p in (run_dir / "logs").glob("*.out") if (name := batch_log_job_id(p.name)))
    signal_all(with_environment("JOBGEN_JOB_ID", job_id) + [first.pid], signal.SIGKILL)
    first.communicate(timeout=60)
    wait_for(lambda: not with_environment("JOBGEN_JOB_ID", job_id), f"every process of {job_id} gone", 30)
    second = subprocess.run(submit, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("*.out")))
    assert f"jobgen: resuming from {tmp_path}/out/checkpoint-2 (launch.resume_argument)" in logs, logs[-3000:]
    assert logged(tmp_path)[-1]["step"] == 12
    sealed = sorted(int(p.parent.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*/jobgen-sealed"))
    assert sealed and all(step % 2 == 0 for step in sealed), sealed


# A program of the user's that checkpoints with accelerate's save_state (2 ranks on gloo): a save
# at steps 2 and 4 (folders numbered by save count: checkpoint_0, checkpoint_1), then, with
# MARK=COMPLETE, a completion file written after every rank has saved, as the guide says; it fails
# after step 4 unless it resumed.
ACCELERATE_SCRIPT = r'''import os, sys
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="out", automatic_checkpoint_naming=True))
model = accelerator.prepare(torch.nn.Linear(4, 4))
resume = sys.argv[sys.argv.index("--resume") + 1] if "--resume" in sys.argv else None
if resume:
    accelerator.load_state(resume)
    accelerator.project_configuration.iteration = int(resume.rsplit("_", 1)[1]) + 1
    print(f"rank {accelerator.process_index}: resumed from {resume}", flush=True)
    sys.exit(0)
for step in (1, 2, 3, 4):
    if step % 2 == 0:
        saved = accelerator.save_state()
        accelerator.wait_for_everyone()
        if accelerator.is_main_process and os.environ.get("MARK"):
            open(os.path.join(saved, os.environ["MARK"]), "w").close()
sys.exit(1)  # a failure after step 4: the next submit resumes
'''


def test_accelerate_save_state_checkpoints_are_refused_in_one_line_until_a_completion_file_is_set(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(ACCELERATE_SCRIPT)
    launch = {"command": ["python", "train.py"], "checkpoints": "out/checkpoints/checkpoint_*",
              "resume_argument": "--resume {checkpoint}"}
    config = write_job(tmp_path, launch)
    first = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    assert first.returncode != 0 and (tmp_path / "out" / "checkpoints" / "checkpoint_1" / "random_states_1.pkl").exists()
    again = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    log = jobgen("logs", str(tmp_path / "runs" / "own")).stdout + again.stdout + again.stderr
    assert again.returncode != 0
    assert re.search(r"jobgen: launch.checkpoints matches out/checkpoints/checkpoint_[01], saved by accelerate's save_state, "
                     r"which writes no trainer_state.json \(launch.checkpoint_complete_file\)", log), log
    assert "set launch.checkpoint_complete_file: COMPLETE" in log and "resumed from" not in log

    # Done as the line says (the old checkpoints moved away): the next run's checkpoints are
    # complete, and the one after resumes from the newest.
    (tmp_path / "out").rename(tmp_path / "out-unmarked")
    config = write_job(tmp_path, {**launch, "checkpoint_complete_file": "COMPLETE"}, environment={"variables": {"MARK": "COMPLETE"}})
    jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    resumed = jobgen("submit", "-s", "local", str(config), cwd=tmp_path, env={"PATH": VENV_PATH}, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    log = jobgen("logs", str(tmp_path / "runs" / "own")).stdout
    assert f"rank 1: resumed from {tmp_path}/out/checkpoints/checkpoint_1" in log, log
