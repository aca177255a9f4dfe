#!/usr/bin/env bash
# Prepare the fixed data of the recipes into $DATA_DIR: 1,000 HotpotQA training ids (frozen order),
# 500 disjoint held-out ids, RULER-HQA eval_50/200/800, each folder with a SHA-256 manifest.
#
#   DATA_DIR=/data/mem-agent bash examples/memagent/prepare-data.sh
#
# Offline: HOTPOT_FILE=/path/hotpot_train_v1.1.json RULER_DIR=/path/with/eval_N.json files.
# Pass@k selection: PASS_COUNTS=counts.json (from a Pass@k run over a candidate set prepared with the
# same SEED; the held-out ids do not change).
set -euo pipefail

DATA_DIR="${DATA_DIR:-data}"
HOTPOT_FILE="${HOTPOT_FILE:-}"      # local official HotpotQA JSON; empty = hub (pinned revision)
RULER_DIR="${RULER_DIR:-}"          # local folder with eval_{N}.json; empty = hub (pinned revision)
NUM_TRAIN="${NUM_TRAIN:-1000}"
NUM_HELDOUT="${NUM_HELDOUT:-500}"
SEED="${SEED:-42}"
PASS_COUNTS="${PASS_COUNTS:-}"
PASS_K="${PASS_K:-8}"
LENGTHS="${LENGTHS:-50 200 800}"
SKIP_RULER="${SKIP_RULER:-0}"
MEMRL="${MEMRL:-memrl}"

hotpot_args=(--out "$DATA_DIR" --num-train "$NUM_TRAIN" --num-heldout "$NUM_HELDOUT" --seed "$SEED")
[[ -n "$HOTPOT_FILE" ]] && hotpot_args+=(--from-file "$HOTPOT_FILE")
[[ -n "$PASS_COUNTS" ]] && hotpot_args+=(--pass-counts "$PASS_COUNTS" --pass-k "$PASS_K")
$MEMRL prepare-data hotpotqa "${hotpot_args[@]}"

if [[ "$SKIP_RULER" != "1" ]]; then
  read -r -a lengths <<< "$LENGTHS"
  ruler_args=(--out "$DATA_DIR" --lengths "${lengths[@]}")
  [[ -n "$RULER_DIR" ]] && ruler_args+=(--from-dir "$RULER_DIR")
  $MEMRL prepare-data ruler-hqa "${ruler_args[@]}"
fi
echo "prepared data in $DATA_DIR"
