"""The long evaluation path on real text: `prepare-data build-ruler` from the shipped HotpotQA dev records, then
`memrl eval` through recipes/ruler-hqa-eval.yaml (2048-token chunks, 1024-token memory, 256-token answers,
up to 64 chunks) with a tiny random model on the real Qwen3 tokenizer. Random weights never stop, so every
memory runs to its 1,024-token cap: the most expensive prompts the recipe can build.

Measured cost (docs/demo.md, "Real text at length"): 50 documents = 4-5 chunks, 200 documents = 14-15."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memrl.config import load_config
from memrl.data.hotpotqa import SHIPPED_FILES

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "ruler-hqa-eval.yaml"
# `from conftest import ...` would find whichever conftest module pytest imported first (tests/engines has
# its own): the shared tokenizer's path is spelled out here, as tests/conftest.py spells it.
QWEN3_TOKENIZER_DIR = (REPO / ".." / "shared").resolve() / "assets" / "qwen3-tokenizer"
HOTPOT_DEV_FILE = SHIPPED_FILES["dev"]  # the HotpotQA records memrl ships


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ruler_eval_runs_end_to_end_on_real_text(tmp_path):
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"real Qwen3 tokenizer not found at {QWEN3_TOKENIZER_DIR}")
    import torch
    from transformers import AutoTokenizer

    from memrl.data.prepare import build_ruler_command
    from memrl.eval.runner import eval_command, load_eval_data
    from memrl.memagent.chunking import tokenize_document
    from memrl.tiny import save_tiny_model

    torch.set_num_threads(1)
    recipe = load_config(RECIPE)
    paths = build_ruler_command(HOTPOT_DEV_FILE, tmp_path / "data", [50], limit=2)
    data = next(p for p in paths.values() if str(p).endswith("eval_50.json"))
    model = save_tiny_model(tmp_path / "tiny", tokenizer_dir=QWEN3_TOKENIZER_DIR)
    summary = eval_command(str(model), None, RECIPE, data, tmp_path / "out", limit=2, progress=False)
    assert summary["total"] == 2 and summary["failed"] == 0
    tok = AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER_DIR))
    records = load_eval_data(data)[:2]
    lines = {line["id"]: line
             for line in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert set(lines) == {record.id for record in records}
    r = recipe.task
    for record in records:
        line, tokens = lines[record.id], len(tokenize_document(tok, record.context))
        # Read whole (50 documents fit in 64 chunks), one memory turn per 2048-token chunk, memory capped.
        assert line["num_chunks"] == -(-line["document_tokens"] // r.chunk_tokens) >= 3
        assert line["document_tokens"] == tokens
        assert not line["document_truncated"] and line["turns"] == line["num_chunks"] + 1
        assert max(line["memory_lengths"]) <= r.memory_tokens

