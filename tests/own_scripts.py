"""Training scripts of a user's own, for the tests that run them as launch.command on a real
scheduler (tests/test_slurm_own_command.py, tests/test_pbs_own_command.py): each writes one line
per trained step, {"step", "loss"}, to OUT/steps.jsonl on rank 0, and sleeps STEP_DELAY s a step
so that a test can stop it mid-run."""

from __future__ import annotations

import json
from pathlib import Path

# A Hugging Face Trainer on the tiny model with JobgenCallback: python train.py TINY OUT.
FINETUNE = r'''import json, os, sys, time

from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

from jobgen.train.hf import JobgenCallback

tiny, out = sys.argv[1], sys.argv[2]
resume = sys.argv[sys.argv.index("--resume_from_checkpoint") + 1] if "--resume_from_checkpoint" in sys.argv else None
tokenizer = AutoTokenizer.from_pretrained(f"{tiny}/model")
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
texts = [" ".join(turn["value"] for turn in record["conversations"]) for record in json.load(open(f"{tiny}/data.json"))]
encoded = tokenizer(texts, truncation=True, max_length=32, padding="max_length")
dataset = [{"input_ids": ids, "attention_mask": mask, "labels": ids}
           for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"])]


class SlowAndLogged(TrainerCallback):
    """Slows each step (so the test can preempt mid-run) and logs each step's loss once, on rank 0."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("STEP_DELAY", "0")))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            with open(f"{out}/steps.jsonl", "a") as log:
                log.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


args = TrainingArguments(output_dir=out, max_steps=12, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to=[], use_cpu=True, seed=1,
                         **{"save_steps": 100, "dataloader_num_workers": 0, **json.loads(os.environ.get("EXTRA_ARGS", "{}"))})
model = AutoModelForCausalLM.from_pretrained(f"{tiny}/model")
trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[JobgenCallback(), SlowAndLogged()])
trainer.train(resume_from_checkpoint=resume)
'''


# A plain DDP training that handles SIGTERM itself: at each step's end the ranks agree on a stop
# (one all-reduce: the signal reaches them at different moments), rank 0 saves model, optimizer
# and step into checkpoint-N, COMPLETE last, and every rank exits 0. A step's batch is drawn from
# (step, rank), so a resumed run sees the batches an uninterrupted one would.
# The stop tests hold it in each phase of its life and wait for the phase's marker: OUT/PHASE-R
# gets a line each time rank R enters it: started (before torch is imported: no handler yet),
# handler, saving (rank 0 inside a save, SAVE_DELAY s long), exiting (its steps done and not
# stopped, the default action of SIGTERM back, as Python's finalization puts it, then EXIT_DELAY s
# of teardown); a step done is a line of steps.jsonl. NAME_R delays rank R alone. SAVE_EVERY saves
# every so many steps too (0: only at a stop); STEPS is how many it trains.
PLAIN_DDP = r'''import json, os, signal, sys, time
out, rank = sys.argv[1], int(os.environ["RANK"])
def mark(phase):
    with open(os.path.join(out, f"{phase}-{rank}"), "a") as marker:
        marker.write("\n")
def wait(name):
    time.sleep(float(os.environ.get(f"{name}_{rank}", os.environ.get(name, "0"))))
mark("started")
wait("START_DELAY")
import torch
import torch.distributed as dist

stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
mark("handler")
wait("INIT_DELAY")
dist.init_process_group("gloo")
world = dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if "--resume" in sys.argv:
    state = torch.load(os.path.join(sys.argv[sys.argv.index("--resume") + 1], "state.pt"))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    start = state["step"]
every = int(os.environ.get("SAVE_EVERY", "0"))
asked = torch.tensor([0])
for step in range(start + 1, int(os.environ.get("STEPS", "12")) + 1):
    batch = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=batch)
    loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    if rank == 0:
        with open(os.path.join(out, "steps.jsonl"), "a") as log:
            log.write(json.dumps({"step": step, "loss": mean.item() / world}) + "\n")
    wait("STEP_DELAY")
    asked = torch.tensor([1 if stop else 0])
    dist.all_reduce(asked, op=dist.ReduceOp.MAX)
    if asked.item() or (every and step % every == 0):
        if rank == 0:
            mark("saving")
            # exist_ok: a save a stop cut short left its folder, without COMPLETE, to be done again.
            folder = os.path.join(out, f"checkpoint-{step}")
            os.makedirs(folder, exist_ok=True)
            wait("SAVE_DELAY")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                       os.path.join(folder, "state.pt"))
            open(os.path.join(folder, "COMPLETE"), "w").close()
            if asked.item():
                print(f"rank 0: SIGTERM: saved checkpoint-{step}", flush=True)
        dist.barrier()
    if asked.item():
        break
# Every rank past its last collective, then out without torch's teardown of gloo: that teardown
# aborted now and then ("terminate called without an active exception", SIGABRT), with the group
# destroyed after a barrier too (torch 2.13 on 2 loaded CPUs: 2 of 4 runs once, and once in CI),
# and jobgen rightly calls a rank killed by a signal a failure of the program (a program that does so
# is tests/test_slurm_own_command.py's ABORT_AFTER_LAST_STEP); this one is about resuming.
dist.barrier()
signal.signal(signal.SIGTERM, signal.SIG_DFL)
if not asked.item():  # its steps done, not stopped: the teardown a stop can still meet
    mark("exiting")
    wait("EXIT_DELAY")
sys.stdout.flush()
os._exit(0)
'''
# The plain program's run is preempted once at each moment of its life, a segment each: before
# its first step (its SIGTERM handler not yet in place), mid-step, inside a save, and while it
# exits (its handler put back to the default). The scheduler signals every process of the job at
# once; before, a stop at the first or the last moment killed a rank and the job ended FAILED.
# The marker each waits for (OUT/PHASE-0 gains a line; steps.jsonl a step).
PREEMPTED_AT = (("before its first step", "started-0"), ("mid-step", "steps.jsonl"),
                ("inside a save", "saving-0"), ("while it exits", "exiting-0"))
HELD_IN_EACH_PHASE = {"START_DELAY": 3, "SAVE_EVERY": 3, "SAVE_DELAY": 4, "EXIT_DELAY": 10}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


# What each script needs in launch besides command and checkpoints (out/checkpoint-*).
SCRIPTS = {
    "hf-trainer": (FINETUNE, {"resume_argument": "--resume_from_checkpoint {checkpoint}"}),
    "plain-ddp": (PLAIN_DDP, {"resume_argument": "--resume {checkpoint}", "checkpoint_complete_file": "COMPLETE"}),
}


def command(script: str, tiny: Path) -> list[str]:
    return ["python", "train.py", str(tiny), "out"] if script == "hf-trainer" else ["python", "train.py", "out"]


def write_script(folder: Path, script: str) -> None:
    (folder / "train.py").write_text(SCRIPTS[script][0])
    (folder / "out").mkdir()


def logged(folder: Path) -> list[dict]:
    """The steps the script logged in FOLDER/out, in order."""
    path = folder / "out" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
