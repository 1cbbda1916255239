"""jobgen-probe: check a job's wiring in seconds, before spending GPU hours on it.

Run in place of jobgen-train (`launch.entrypoint: jobgen-probe`). Every rank writes what it was
given (RANK, LOCAL_RANK, WORLD_SIZE, NODE_RANK, MASTER_ADDR, host, the CPUs it may run on, LOADEDMODULES,
the socket interfaces) to
RUN_DIR/probe/rank-R.json, then one all_reduce of rank+1 over every rank proves they reach each
other: the sum must be W(W+1)/2. Rank 0 reports the outcome in trainer-exit.json, as the trainer does.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

REPORTED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT",
            "JOBGEN_JOB_ID", "JOBGEN_RESTART_COUNT", "SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_NODEID", "PBS_JOBID",
            "CUDA_VISIBLE_DEVICES", "LOADEDMODULES", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jobgen-probe", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, type=Path, help="RUN_DIR/job.yaml")
    args = parser.parse_args(argv)
    from jobgen.train.lifeline import die_with_torchrun

    die_with_torchrun()
    run_dir = args.job.resolve().parent

    import torch
    import torch.distributed as dist

    from jobgen.train.__main__ import load_job
    from jobgen.train.distributed import place
    from jobgen.errors import UserError
    from jobgen.train.exit_report import ExitReport, write_exit_report, write_json_atomically

    started = time.time()
    try:
        job = load_job(str(args.job))
        # The job's device, as jobgen-train would have it: a GPU job without usable CUDA fails here too.
        placement = place(job.resources.gpus_per_node, int(os.environ.get("LOCAL_RANK", "0")), job.training.precision)
    except UserError as exc:
        print(f"jobgen-probe: error: {exc}", file=sys.stderr, flush=True)
        if os.environ.get("RANK", "0") == "0":
            write_exit_report(str(run_dir), ExitReport(reason="failed", message=str(exc)))
        return 2
    backend, device = placement.backend, placement.device
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(total)
    expected = world * (world + 1) / 2
    record = {name: os.environ.get(name) for name in REPORTED}
    # The CPUs this rank may run on: a task bound to fewer CPUs than the job asked for keeps ranks on one core.
    record.update(cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None)
    record.update(hostname=socket.gethostname(), backend=backend, device=str(device),
                  gpu=torch.cuda.get_device_name(device) if placement.cuda else None, all_reduce_sum=total.item(), expected_sum=expected)
    write_json_atomically(str(run_dir / "probe" / f"rank-{rank}.json"), record)
    print(f"jobgen-probe: rank {rank}/{world} node {record['NODE_RANK']} on {record['SLURMD_NODENAME'] or record['hostname']}: "
          f"all_reduce {total.item():g} (expected {expected:g})", flush=True)
    dist.barrier()
    ok = total.item() == expected
    if rank == 0:
        write_exit_report(str(run_dir), ExitReport(
            reason="completed" if ok else "failed", train_seconds=time.time() - started,
            message=f"{world} ranks reached each other" if ok else f"all_reduce gave {total.item()}, expected {expected}",
        ))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
