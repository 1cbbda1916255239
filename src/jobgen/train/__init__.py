"""`jobgen-train`: the fine-tuning entry point that every rank runs under torchrun.

    torchrun ... -m jobgen.train --job RUN_DIR/job.yaml [--run-dir RUN_DIR]

Modules, one concept each: `data` (conversations, chat layout, batch order), `modeling` (model,
tokenizer, LoRA/Q-LoRA), `dsconfig` (DeepSpeed config), `distributed` (ranks, process group),
`checkpoint` (save/verify/find/load/prune), `stop` (signal flag), `metrics`, `exit_report`
(`RUN_DIR/trainer-exit.json`), `trainer` (the loop), `tiny` (a local tiny model for tests).

Paths: `training.model` and `training.data` (and `training.deepspeed_config`) are relative to the
working directory; `training.output_dir` is relative to the run directory.

Precision: on a GPU, the job's bf16/fp16/fp32 runs. On the CPU every run is fp32 (bf16 and fp16
requests are logged and run as fp32): CPU bf16 kernels are slow and DeepSpeed's CPU loss-scaling
paths are not what a CPU run is for (tests, demos, small jobs).

Environment variables:
- JOBGEN_PG_TIMEOUT_MINUTES (default 30): timeout of every collective, so a dead rank cannot
  leave the others waiting forever.
- JOBGEN_DEBUG_STEP_DELAY (seconds, default 0): testing aid; sleep after each optimizer step so a
  test or demo can interrupt a tiny model mid-training.
- JOBGEN_DEBUG_SAMPLE_LOG (default off): testing aid; with 1, each rank appends the ids of every
  micro-batch it trains on to OUTPUT_DIR/samples-rankR.jsonl.

Exit status: 0 completed or stopped (see `exit_report` for trainer-exit.json), 2 a user's
mistake (`jobgen-train: error: ...` on stderr, no traceback), 1 anything else.
"""
