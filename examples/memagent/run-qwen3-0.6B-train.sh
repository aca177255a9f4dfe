#!/usr/bin/env bash
# The seed's Qwen3-0.6B MemAgent training run (recipes/qwen3-0.6b-hotpotqa.yaml), a thin wrapper over
# `memrl train`. Variables: MODEL_PATH (a local folder or Qwen/Qwen3-0.6B), DATA_DIR (from
# prepare-data.sh), RUN_ROOT, NUM_ROLLOUT, LOAD_PATH (checkpoint to resume), START_ROLLOUT_ID, RECIPE.
# Relative paths are read from the current directory, as in the other scripts. Arguments go to
# `memrl train` as they are, e.g. `--set train.save_interval=10`.
#
#   NUM_ROLLOUT=2 RUN_ROOT=runs/smoke bash examples/memagent/run-qwen3-0.6B-train.sh   # a 2-step smoke run
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
MODEL_PATH="${MODEL_PATH:-Qwen/Qwen3-0.6B}"
DATA_DIR="${DATA_DIR:-data}"
RUN_ROOT="${RUN_ROOT:-runs/qwen3-0.6b-memagent}"
NUM_ROLLOUT="${NUM_ROLLOUT:-125}"
RECIPE="${RECIPE:-$REPO/recipes/qwen3-0.6b-hotpotqa.yaml}"
MEMRL="${MEMRL:-memrl}"
args=(train --recipe "$RECIPE" --run-root "$RUN_ROOT"
      --set "model.path=$MODEL_PATH" --set "data.dir=$DATA_DIR" --set "train.num_rollout=$NUM_ROLLOUT")
if [ "$MODEL_PATH" != "Qwen/Qwen3-0.6B" ]; then args+=(--set "model.revision=null"); fi
if [ -n "${LOAD_PATH:-}" ]; then args+=(--load "$LOAD_PATH"); fi
if [ -n "${START_ROLLOUT_ID:-}" ]; then args+=(--start-rollout-id "$START_ROLLOUT_ID"); fi
exec $MEMRL "${args[@]}" "$@"
