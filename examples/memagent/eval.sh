#!/usr/bin/env bash
# Evaluate one model with the MemAgent memory loop (the training loop, one sample per question):
# RULER-HQA eval_{N}.json for each N in LENGTHS (TASK=ruler, the default) or the HotpotQA held-out
# questions (TASK=heldout). One results folder per data file: results.jsonl + summary.json.
#
#   MODEL_PATH=/data/models/Qwen3-0.6B DATA_DIR=/data/mem-agent RESULTS_DIR=/data/results/base \
#   bash examples/memagent/eval.sh
#
# A served model instead of a local one: SERVER_URL=http://127.0.0.1:8000 TOKENIZER_PATH=/data/models/Qwen3-0.6B
# (vLLM, SGLang or `memrl serve`). Rerunning the same command resumes an interrupted evaluation.
# EXTRA_ARGS go to `memrl eval` as they are, e.g. EXTRA_ARGS="--limit 16 --set eval.concurrency=8".
# Relative paths are read from the current directory; the recipes are this repository's.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"

MODEL_PATH="${MODEL_PATH:-}"
SERVER_URL="${SERVER_URL:-}"
TOKENIZER_PATH="${TOKENIZER_PATH:-}"
DATA_DIR="${DATA_DIR:-data}"
RESULTS_DIR="${RESULTS_DIR:-results}"
TASK="${TASK:-ruler}"                # ruler | heldout
LENGTHS="${LENGTHS:-50 200 800}"
EXTRA_ARGS="${EXTRA_ARGS:-}"
MEMRL="${MEMRL:-memrl}"

if [[ -n "$MODEL_PATH" && -n "$SERVER_URL" ]] || [[ -z "$MODEL_PATH" && -z "$SERVER_URL" ]]; then
  echo "set exactly one of MODEL_PATH (local model folder) or SERVER_URL (served model)" >&2
  exit 2
fi
if [[ -n "$SERVER_URL" && -z "$TOKENIZER_PATH" ]]; then
  echo "SERVER_URL needs TOKENIZER_PATH: prompts are built as token ids on this side" >&2
  exit 2
fi

model_args=()
[[ -n "$MODEL_PATH" ]] && model_args+=(--model "$MODEL_PATH")
[[ -n "$SERVER_URL" ]] && model_args+=(--server-url "$SERVER_URL")
[[ -n "$TOKENIZER_PATH" ]] && model_args+=(--tokenizer "$TOKENIZER_PATH")
read -r -a extra <<< "$EXTRA_ARGS"

case "$TASK" in
  ruler)
    RECIPE="${RECIPE:-$REPO/recipes/ruler-hqa-eval.yaml}"
    read -r -a lengths <<< "$LENGTHS"
    for n in "${lengths[@]}"; do
      $MEMRL eval "${model_args[@]}" --recipe "$RECIPE" --data "$DATA_DIR/ruler_hqa/eval_$n.json" \
        --out "$RESULTS_DIR/ruler_hqa_$n" "${extra[@]}"
    done
    ;;
  heldout)
    RECIPE="${RECIPE:-$REPO/recipes/qwen3-0.6b-hotpotqa.yaml}"  # the short training settings (512/128/4)
    $MEMRL eval "${model_args[@]}" --recipe "$RECIPE" --data "$DATA_DIR/hotpotqa_heldout.jsonl" \
      --out "$RESULTS_DIR/heldout" "${extra[@]}"
    ;;
  *)
    echo "TASK must be ruler or heldout, got '$TASK'" >&2
    exit 2
    ;;
esac
echo "results in $RESULTS_DIR"
