#!/usr/bin/env bash
# benchmarks/gpu_finetune.py on a GPU machine that has torch, transformers and peft but no
# package registry: installs the rest from a folder of wheels made beforehand on a machine with
# one, for the GPU machine's Python:
#   pip wheel --no-deps -w WHEELS deepspeed . ; pip download --no-deps -d WHEELS --python-version 3.12 \
#     --only-binary=:all: bitsandbytes pydantic pydantic-core annotated-types typing-inspection submitit hjson \
#     liger-kernel ...
# Usage: benchmarks/gpu_run.sh WHEELS OUT [gpu_finetune.py options]
set -euo pipefail
wheels=$1 out=$2
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -m pip install --quiet --no-index --find-links "$wheels" deepspeed bitsandbytes pydantic submitit liger-kernel 2>&1 | tail -5
python3 -m pip install --quiet --no-index --no-deps --force-reinstall "$wheels"/jobgen-*.whl 2>&1 | tail -5
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 benchmarks/gpu_finetune.py --out "$out" "$@"
