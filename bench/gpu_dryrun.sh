#!/usr/bin/env bash
# A CPU stand-in for the lent GPU machine, to check bench/gpu.sh before spending device time on it: a venv
# with only what the device image has that memrl uses (transformers 5.17.0, PyYAML, typer, tqdm, numpy,
# safetensors, tensorboard, matplotlib, huggingface_hub, psutil, httpx, pytest; no pydantic, no project
# install: PYTHONPATH as on the device), plus the wheels bench/fetch_device_wheels.sh fetches, installed by
# bench/gpu.sh itself; then `bash bench/gpu.sh --smoke` to the end. Differences from the device, said
# plainly: CPU torch 2.13.0 (the one this machine has on disk) instead of CUDA torch 2.11, Python 3.11
# instead of 3.12 (so the wheels are fetched for 3.11 into their own folder).
# Usage: bash bench/gpu_dryrun.sh [OUT_DIR]     (default /tmp/memrl_gpu_dryrun; venv in /tmp/memrl_device_venv)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-/tmp/memrl_gpu_dryrun}"
VENV=/tmp/memrl_device_venv
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q torch==2.13.0 transformers==5.17.0 pyyaml typer tqdm numpy safetensors \
    tensorboard matplotlib huggingface_hub psutil httpx pytest pytest-timeout
  # today's typer pulls pydantic in; the image's typer does not (its package list has no pydantic)
  "$VENV/bin/python" -m pip uninstall -q -y pydantic pydantic-core
fi
if "$VENV/bin/python" -c "import pydantic" 2>/dev/null; then
  echo "bench/gpu_dryrun.sh: $VENV has pydantic, which the device image lacks; delete the venv and rerun" >&2
  exit 2
fi
WHEELS=/tmp/memrl_wheels_py311
bash bench/fetch_device_wheels.sh "$WHEELS" 3.11 >/dev/null
rm -rf "$DIR"
PYTHON="$VENV/bin/python" MEMRL_WHEELS="$WHEELS" bash bench/gpu.sh --smoke --budget-s 600 --out "$DIR"
echo "dry run done: $DIR/gpu.json"
