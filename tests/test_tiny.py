"""Tiny tokenizer and model built in code: what every test and the CPU demo load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memrl.tiny import (
    TinyModelError,
    build_tiny_model,
    build_tiny_tokenizer,
    make_tiny_model_command,
    save_tiny_model,
)

QWEN3_TOKENIZER = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets" / "qwen3-tokenizer"


def test_tokenizer_round_trips_text_and_has_the_chat_template():
    tok = build_tiny_tokenizer()
    text = "Document 1: Paris is the capital — naïve café \\boxed{Paris}"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_model_is_small_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected_next = torch.rand(1)
    torch.manual_seed(7)
    a = build_tiny_model(512, seed=0)
    assert torch.rand(1) == expected_next  # building did not consume the caller's random stream
    b, c = build_tiny_model(512, seed=0), build_tiny_model(512, seed=1)
    n_params = sum(p.numel() for p in a.parameters())
    assert 50_000 < n_params < 1_000_000
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.config.tie_word_embeddings and a.lm_head.weight is a.model.embed_tokens.weight
    assert a.config.head_dim == 16 and a.config.max_position_embeddings == 4096


@pytest.mark.parametrize("kwargs,match", [
    ({"hidden": 60, "heads": 8}, "multiple of heads"),
    ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
    ({"layers": 0}, "must all be > 0"),
])
def test_bad_shapes_are_named_errors(kwargs, match):
    with pytest.raises(TinyModelError, match=match):
        build_tiny_model(512, **kwargs)


def test_saved_folder_loads_with_auto_classes(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=5)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.apply_chat_template([{"role": "user", "content": "Which city?"}], tokenize=True,
                                  add_generation_prompt=True, enable_thinking=False, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reference = build_tiny_model(len(tok), layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=5,
                                 eos_token_id=tok.eos_token_id)
    with torch.no_grad():
        x = torch.tensor([ids])
        assert torch.allclose(model(x).logits, reference(x).logits, atol=1e-6)


def test_words_tokenizer_and_command(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "w", words=["paris", "london", "yes", "no"])
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.decode(tok.encode("paris yes", add_special_tokens=False)) == "paris yes"
    make_tiny_model_command(tmp_path / "cli", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    assert "parameters" in capsys.readouterr().out
    assert (tmp_path / "cli" / "model.safetensors").is_file() and (tmp_path / "cli" / "tokenizer.json").is_file()
    with pytest.raises(TinyModelError, match="does not exist"):
        save_tiny_model(tmp_path / "x", tokenizer_dir=tmp_path / "missing")


def test_a_folder_that_holds_files_is_kept_unless_overwrite(tmp_path):
    folder = save_tiny_model(tmp_path / "m", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=1)
    weights = (folder / "model.safetensors").read_bytes()
    with pytest.raises(TinyModelError, match="is not empty"):
        save_tiny_model(folder, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=2)
    assert (folder / "model.safetensors").read_bytes() == weights
    save_tiny_model(folder, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=2, overwrite=True)
    assert (folder / "model.safetensors").read_bytes() != weights


def test_real_qwen3_tokenizer_folder(tmp_path):
    if not QWEN3_TOKENIZER.is_dir():
        pytest.skip(f"real Qwen3 tokenizer not found at {QWEN3_TOKENIZER}")
    folder = save_tiny_model(tmp_path / "q", tokenizer_dir=QWEN3_TOKENIZER, layers=1, hidden=16, heads=2,
                             kv_heads=1, intermediate=32)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.vocab_size == len(tok) > 150_000
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True,
                                  enable_thinking=False, return_dict=False)
    assert "<think>\n\n</think>" in tok.decode(ids)  # Qwen3's own template, thinking off
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))
