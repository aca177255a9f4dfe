#!/usr/bin/env bash
# GPU throughput check (generation and training on a random-initialised Qwen3-0.6B-shaped model, bf16),
# then the rollout schedules (async vs lockstep) on the GPU with the engine's default decode path there
# (static-shape KV slots + CUDA graphs). Needs torch with CUDA, transformers and memrl's dependencies;
# a few minutes on one H100/H200.
# Usage: bash bench/gpu.sh [OUT_JSON]      the GPU run (results JSON, default bench/gpu_results.json)
#        bash bench/gpu.sh --smoke         the generation rows on a tiny model (CPU without a GPU) and a
#                                          quick rollout comparison: checks the script, in a minute or two
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--smoke" ]; then
  "$PY" bench/gpu.py --smoke --out "${2:-/tmp/memrl_gpu_smoke.json}"
  "$PY" bench/rollout.py --quick --questions 4 --samples 2 --static-kv on
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "== GPU-only engine tests (CUDA graphs + weight sync, CUDA log-probs) =="
"$PY" -m pytest -q -p no:cacheprovider tests/engines/test_static_decode.py tests/engines/test_hf.py -k cuda \
  || echo "GPU engine tests FAILED (see above); the benchmarks still run"
"$PY" bench/gpu.py --out "${1:-bench/gpu_results.json}"
echo "== rollout schedules on the GPU (bench/rollout.py --device cuda) =="
"$PY" bench/rollout.py --device cuda --questions 64 --samples 8 --repeats 3
