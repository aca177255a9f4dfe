#!/usr/bin/env bash
# GPU throughput check on a lent device, made to succeed in one shot there (bench/README.md "GPU"): the
# GPU-only tests, generation rows (dynamic / static / graphs) and training rows on a random-initialised
# Qwen3-0.6B-shaped model in bf16, then the rollout schedules (async vs lockstep). bench/gpu.py runs every
# step, records each row or its error, and rewrites the JSON after every row, so any one failure costs
# that row only; --budget-s skips what would no longer fit.
#
# The device image has no pydantic and no network: bench/fetch_device_wheels.sh fetches the missing wheels
# here into .whl/ (carried with the call); where pydantic is missing, this script installs them with
# --no-index into a temporary folder, then checks the imports in seconds before anything expensive starts.
#
# Usage: bash bench/gpu.sh [--smoke] [--budget-s S] [--out DIR]
#   results: DIR/gpu.json and DIR/gpu.log; DIR defaults to $OUT (the device tool's folder that comes back)
#   when it is set, else bench/results/latest. --smoke: tiny model, CPU when there is no GPU (checks the
#   script itself in a minute or two). MEMRL_WHEELS names another wheel folder (default .whl).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=() BUDGET=420 DIR="${OUT:-bench/results/latest}"
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=(--smoke) ;;
    --budget-s) BUDGET="$2"; shift ;;
    --out) DIR="$2"; shift ;;
    *) echo "bench/gpu.sh: unknown argument '$1' (expected --smoke, --budget-s S, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
WHEELS="${MEMRL_WHEELS:-.whl}"
if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="$(mktemp -d /tmp/memrl_site.XXXXXX)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "bench/gpu.sh: installing the carried wheels from $WHEELS failed" >&2; exit 3; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
# Seconds, not the machine: a missing package or an import error ends the run here.
timeout 120 "$PY" -c "import torch, transformers, pydantic, memrl.config, memrl.engines.hf, memrl.train.actor
print('imports ok: torch', torch.__version__, 'transformers', transformers.__version__, 'pydantic',
      pydantic.VERSION, 'cuda', torch.cuda.is_available())" \
  || { echo "bench/gpu.sh: the import check failed (see above); run bench/fetch_device_wheels.sh here and carry .whl" >&2
       exit 3; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" bench/gpu.py "${SMOKE[@]}" --budget-s "$BUDGET" --out "$DIR/gpu.json" 2>&1 | tee "$DIR/gpu.log"
