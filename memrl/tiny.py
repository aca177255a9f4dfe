"""Tiny models and tokenizers built in code, for tests, the CPU demo and `memrl make-tiny-model`.

No download is needed: the tokenizer is a byte-level BPE trained here on a small built-in corpus
(so any text round-trips), or a word-level vocabulary when `words` is given; the chat template mimics
Qwen3's (`<|im_start|>role ... <|im_end|>`, an empty think block when `enable_thinking=False`).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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
    """A small fast tokenizer with Qwen-style special tokens and chat template.

    Default: byte-level BPE trained on a tiny built-in corpus (deterministic, lossless for any text).
    With `words`: a word-level vocabulary (whitespace/punctuation split), for tasks made of known words.
    """
    if words is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
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
    )
    fast.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    return fast


def save_tiny_tokenizer(out: str | Path, **kwargs) -> PreTrainedTokenizerFast:
    tok = build_tiny_tokenizer(**kwargs)
    tok.save_pretrained(str(out))
    return tok
