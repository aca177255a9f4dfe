#!/usr/bin/env bash
# GPU throughput check (generation and training on a random-initialised Qwen3-0.6B-shaped model, bf16).
# Needs torch with CUDA, transformers and memrl's dependencies; runs in a few minutes on one H100/H200.
# Usage: bash bench/gpu.sh [OUT_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 bench/gpu.py --out "${1:-bench/gpu_results.json}"
