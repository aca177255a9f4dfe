"""Shared fixtures. Real data lives in `<repo>/../shared` (never copied into the repo); fixtures that
need it skip with a reason when it is absent, so the suite passes without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = (REPO_ROOT / ".." / "shared").resolve()
QWEN3_TOKENIZER_DIR = SHARED_DIR / "assets" / "qwen3-tokenizer"
HOTPOT_DEV_FILE = SHARED_DIR / "data" / "hotpotqa" / "hotpot_dev_distractor_first200.json"


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """`<repo>/../shared` (may not exist; check before reading)."""
    return SHARED_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    """The real Qwen3 tokenizer (offline), or skip."""
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").is_file():
        pytest.skip(f"real Qwen3 tokenizer not found at {QWEN3_TOKENIZER_DIR}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER_DIR))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Byte-level BPE tiny tokenizer with a Qwen-style chat template. Shared: do not mutate it."""
    from memrl.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def hotpot_dev_records() -> list[dict]:
    """The first 200 official HotpotQA dev (distractor) records, or skip."""
    if not HOTPOT_DEV_FILE.is_file():
        pytest.skip(f"HotpotQA dev records not found at {HOTPOT_DEV_FILE}")
    return json.loads(HOTPOT_DEV_FILE.read_text())
