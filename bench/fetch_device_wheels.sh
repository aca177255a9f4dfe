#!/usr/bin/env bash
# Fetch, once and here (PyPI is reachable here, not on the device), the wheels memrl needs that the lent GPU
# machine's image lacks, into the git-ignored .whl/ folder that the device call carries (`carry: [".whl"]`).
# The image has torch, transformers, PyYAML, typer, tqdm, numpy, safetensors, tensorboard, matplotlib, httpx,
# psutil and pytest (the device tool's KINDS.md), but not pydantic: memrl.config imports it, so every step
# of bench/gpu.sh needs these. typing_extensions is carried too: pydantic needs a newer one than the image's
# may be. Versions are the ones the CPU install resolves, so the device runs what the tests ran.
# Usage: bash bench/fetch_device_wheels.sh [DEST] [PYTHON_VERSION]   (defaults .whl and 3.12, the device's)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.whl}"
PYVER="${2:-3.12}"
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0)
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two make the device's pip install stop
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
