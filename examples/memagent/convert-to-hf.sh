#!/usr/bin/env bash
# Export a training checkpoint as a plain Hugging Face model folder.
# Variables: CKPT (iter_XXXXXXX folder, or a run root for its latest checkpoint), OUT.
set -euo pipefail
CKPT="${CKPT:?set CKPT to a checkpoint folder (RUN_ROOT/checkpoints/iter_XXXXXXX) or a run root}"
OUT="${OUT:?set OUT to the folder to write}"
exec "${MEMRL:-memrl}" convert-to-hf "$CKPT" "$OUT"
