#!/usr/bin/env bash
# Paired long-document evaluation of the base model, the other framework's (VIME) checkpoint and ours
# (ReLax), under identical conditions (docs/design.md §6-7: recipes/ruler-hqa-eval.yaml, same data, tokenizer,
# prompts, sampling and seed), then `memrl compare` per length with the 3 pp sub_EM check.
#
#   BASE_MODEL_PATH=/data/models/Qwen3-0.6B \
#   VIME_MODEL_PATH=/data/checkpoints/vime-hf \
#   RELAX_MODEL_PATH=/data/checkpoints/mem-agent-relax-hf \
#   TOKENIZER_PATH=/data/models/Qwen3-0.6B \
#   DATA_DIR=/data/mem-agent \
#   RESULTS_DIR=/data/results/vime-vs-relax \
#   LENGTHS="50 200 800" \
#   bash examples/memagent/run-paired-eval.sh
#
# Layout: RESULTS_DIR/eval_N/{base,vime,relax}/ (results.jsonl, summary.json) and
# RESULTS_DIR/eval_N/comparison/ (report.md, comparison.png, comparison.json). Rerunning resumes.
# Exit status: 0 when every length passes abs(sub_EM_relax - sub_EM_vime) <= MAX_SUB_EM_DIFF pp,
# 1 when a threshold fails, 2 when results cannot be compared (the message says what differs).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"

: "${BASE_MODEL_PATH:?set BASE_MODEL_PATH (base model folder)}"
: "${VIME_MODEL_PATH:?set VIME_MODEL_PATH (VIME checkpoint, Hugging Face folder)}"
: "${RELAX_MODEL_PATH:?set RELAX_MODEL_PATH (our checkpoint, Hugging Face folder)}"
TOKENIZER_PATH="${TOKENIZER_PATH:-$BASE_MODEL_PATH}"
DATA_DIR="${DATA_DIR:-data}"
RESULTS_DIR="${RESULTS_DIR:-results/paired}"
LENGTHS="${LENGTHS:-50 200 800}"
RECIPE="${RECIPE:-$REPO/recipes/ruler-hqa-eval.yaml}"
MAX_SUB_EM_DIFF="${MAX_SUB_EM_DIFF:-3}"
EXTRA_ARGS="${EXTRA_ARGS:-}"          # passed to every `memrl eval`, e.g. "--limit 16"
MEMRL="${MEMRL:-memrl}"

names=(base vime relax)
paths=("$BASE_MODEL_PATH" "$VIME_MODEL_PATH" "$RELAX_MODEL_PATH")
read -r -a lengths <<< "$LENGTHS"
read -r -a extra <<< "$EXTRA_ARGS"

status=0
for n in "${lengths[@]}"; do
  data="$DATA_DIR/ruler_hqa/eval_$n.json"
  out="$RESULTS_DIR/eval_$n"
  for i in "${!names[@]}"; do
    echo "== eval_$n: ${names[$i]} (${paths[$i]})"
    $MEMRL eval --model "${paths[$i]}" --tokenizer "$TOKENIZER_PATH" --recipe "$RECIPE" \
      --data "$data" --out "$out/${names[$i]}" "${extra[@]}"
  done
  echo "== eval_$n: compare"
  rc=0
  $MEMRL compare "$out/base" "$out/vime" "$out/relax" --name base --name vime --name relax \
    --pair vime,relax --max-abs-diff "sub_em=$MAX_SUB_EM_DIFF" --out "$out/comparison" || rc=$?
  if (( rc > status )); then status=$rc; fi
done
exit "$status"
