#!/usr/bin/env bash
# The seed's Qwen3-0.6B MemAgent training run (recipes/qwen3-0.6b-hotpotqa.yaml), a thin wrapper over
# `memrl train`. Variables: MODEL_PATH (a local folder or Qwen/Qwen3-0.6B), DATA_DIR (from
# prepare-data.sh), RUN_ROOT, NUM_ROLLOUT, LOAD_PATH (checkpoint to resume), START_ROLLOUT_ID.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-0.6B}"
DATA_DIR="${DATA_DIR:-data}"
RUN_ROOT="${RUN_ROOT:-runs/qwen3-0.6b-memagent}"
NUM_ROLLOUT="${NUM_ROLLOUT:-125}"
MEMRL="${MEMRL:-memrl}"
args=(train --recipe recipes/qwen3-0.6b-hotpotqa.yaml --run-root "$RUN_ROOT"
      --set "model.path=$MODEL_PATH" --set "data.dir=$DATA_DIR" --set "train.num_rollout=$NUM_ROLLOUT")
if [ "$MODEL_PATH" != "Qwen/Qwen3-0.6B" ]; then args+=(--set "model.revision=null"); fi
if [ -n "${LOAD_PATH:-}" ]; then args+=(--load "$LOAD_PATH"); fi
if [ -n "${START_ROLLOUT_ID:-}" ]; then args+=(--start-rollout-id "$START_ROLLOUT_ID"); fi
exec $MEMRL "${args[@]}" "$@"
