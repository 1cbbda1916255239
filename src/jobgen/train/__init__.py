"""`jobgen-train`: the fine-tuning entry point that every rank runs under torchrun.

    torchrun ... -m jobgen.train --job RUN_DIR/job.yaml [--run-dir RUN_DIR]

Modules, one concept each: `data` (conversations, chat layout, batch order), `chat_template`
(which template a job trains in, and the assistant's part of it), `store` (the data tokenized
once into a memory-mapped store), `encode` (tokenizing in parallel for it), `samples` (text and
pretokenized records as tokens), `modeling` (model,
tokenizer, LoRA/Q-LoRA), `dsconfig` (DeepSpeed config), `distributed` (ranks, process group),
`checkpoint` (save/verify/find/load/prune), `best` (the best checkpoint by eval loss),
`background_save`, `stop` (signal flag), `metrics`, `exit_report` (`RUN_DIR/trainer-exit.json`),
`console` (where a rank's output goes), `memory` (will it fit), `prepare` (every rank's checks
before the process group), `schedule` (the LR schedule and the run's length), `trainer` (the loop), `probe`
(jobgen-probe), `torchrun` (jobgen-torchrun), `tiny` (a local tiny model for tests). Reading
the data files and the model reference is jobgen.job's.

May import jobgen.job and the run directory's names (jobgen.rundir.files, .metrics); never the
command line, the schedulers or the script.

Paths: `training.model` and `training.data` (and `training.deepspeed_config`) are relative to the
working directory; `training.output_dir` is relative to the run directory.

Precision: the job's bf16/fp16/fp32 runs as asked, on a GPU and on the CPU (all three train on
the CPU with DeepSpeed ZeRO-2 + LoRA; fp16 with DeepSpeed's loss scaling). On CPUs without
native bf16/fp16 kernels fp32 is usually the fastest; the trainer says so once and obeys the job.

A hub model staged in the node's Hugging Face cache (jobgen.job.hub_cache) loads with the hub
offline: `modeling.use_hub_cache` sets HF_HUB_OFFLINE=1 unless the job or the user set it.

Every setting is the job's: how long a rank waits in a collective before failing, for one, is
`launch.collective_timeout_minutes` (`jobgen schema` describes each field).

Environment variables, for tests and demos only (set where the job is submitted: the batch script
hands every exported JOBGEN_* variable on to the nodes, naming none of these):
- JOBGEN_DEBUG_STEP_DELAY (seconds, default 0): testing aid; sleep after each optimizer step so a
  test or demo can interrupt a tiny model mid-training.
- JOBGEN_DEBUG_SAMPLE_LOG (default off): testing aid; with 1, each rank appends the ids of every
  micro-batch it trains on to OUTPUT_DIR/samples-rankR.jsonl.

Exit status: 0 completed or stopped (see `exit_report` for trainer-exit.json), 2 a user's
mistake (`jobgen-train: error: ...` on stderr, no traceback), 1 anything else.
"""
