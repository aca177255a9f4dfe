"""Tiny models and tokenizers built in code, for tests, the CPU demo and `memrl make-tiny-model`.

No download is needed: the tokenizer is a byte-level BPE trained here on a small built-in corpus
(so any text round-trips), or a word-level vocabulary when `words` is given; the chat template mimics
Qwen3's (`<|im_start|>role ... <|im_end|>`, an empty think block when `enable_thinking=False`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from memrl.errors import MemrlError


class TinyModelError(ValueError, MemrlError):
    """Tiny-model arguments that cannot work; the message says which to change."""


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

QWEN_STYLE_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

_CORPUS = """\
You are reading a long document one part at a time to answer a question. You keep a short memory.
Question: Which city is the capital of France? Your memory so far: No memory yet.
Next part of the document: Document 1: Paris is the capital and most populous city of France.
Rewrite your memory: keep what helps answer the question, add what this part contributes, drop the rest.
Reply with the updated memory only. Put your final answer in \\boxed{}, for example \\boxed{Paris}.
The Beatles were an English rock band formed in Liverpool in 1960. Were both films released in 1999?
yes no the a an of and in to is was for on with by as at from that which who when where what how
0 1 2 3 4 5 6 7 8 9 10 100 1000 January February March April May June July August September
"""


def build_tiny_tokenizer(words: list[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A small fast tokenizer with Qwen-style special tokens and chat template: byte-level BPE trained on a
    tiny built-in corpus (deterministic, lossless for any text), or with `words` a word-level vocabulary."""
    if words is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    else:
        vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "[UNK]"])}
        for w in words:
            vocab.setdefault(w, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]" if words is not None else None,
        # Every chat-template marker must be one special token, also for the word-level vocabulary
        # (whose pre-tokenizer would otherwise read "<|im_start|>user" as one unknown word).
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
    )
    fast.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    return fast


def build_tiny_model(vocab_size: int, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     intermediate: int = 128, seed: int = 0,
                     eos_token_id: int | None = None) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 causal LM (float32, eval mode, tied embeddings), identical for identical
    arguments; `hidden` must divide by `heads` and `heads` by `kv_heads`."""
    if vocab_size <= 0:
        raise TinyModelError(f"vocab_size must be > 0, got {vocab_size}")
    if min(layers, hidden, heads, kv_heads, intermediate) <= 0:
        raise TinyModelError("layers, hidden, heads, kv_heads and intermediate must all be > 0")
    if hidden % heads:
        raise TinyModelError(f"hidden ({hidden}) must be a multiple of heads ({heads}); change one of them")
    if heads % kv_heads:
        raise TinyModelError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}); change one of them")
    # No pad_token_id: it would make the (tied) embedding row of the pad token a zero, untrainable
    # padding_idx row. Padding is masked by attention, as for the real Qwen3 config.
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=eos_token_id, bos_token_id=None)
    # Seed only a private RNG scope: building a model must not move the caller's global torch RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model.float().eval()


def save_tiny_model(out: str | Path, tokenizer_dir: str | Path | None = None, layers: int = 2,
                    hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    seed: int = 0, words: list[str] | None = None, overwrite: bool = False) -> Path:
    """Write a Hugging Face model folder (weights, config, tokenizer with chat template) to `out`, new or
    empty unless `overwrite` (files of the same names replaced, others kept). The tokenizer is
    `tokenizer_dir`'s (the Qwen-style template added only when it has none), else `build_tiny_tokenizer(words)`."""
    out = Path(out)
    if not overwrite and out.is_dir() and any(out.iterdir()):  # it replaced a model's files without a word
        raise TinyModelError(f"{out} is not empty; pass a new or empty folder (or --overwrite to replace "
                             f"the files it would write)")
    if tokenizer_dir is not None:
        if not Path(tokenizer_dir).is_dir():
            raise TinyModelError(f"tokenizer folder {tokenizer_dir} does not exist; pass a folder with tokenizer.json")
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    else:
        tokenizer = build_tiny_tokenizer(words=words)
    model = build_tiny_model(len(tokenizer),  # len() counts added special tokens, which vocab_size may not
                             layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                             seed=seed, eos_token_id=tokenizer.eos_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def make_tiny_model_command(out: Path, tokenizer: Path | None = None, layers: int = 2, hidden: int = 64,
                            heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
                            overwrite: bool = False) -> None:
    """`memrl make-tiny-model`: `save_tiny_model`, then what it wrote."""
    path = save_tiny_model(out, tokenizer_dir=tokenizer, layers=layers, hidden=hidden, heads=heads,
                           kv_heads=kv_heads, intermediate=intermediate, seed=seed, overwrite=overwrite)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(str(path)).parameters())
    print(f"wrote {path} ({n_params:,} parameters, {layers} layers, hidden {hidden})")
