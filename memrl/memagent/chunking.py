"""Cut a tokenized document into the chunks a MemAgent reads, one per memory turn (docs/design.md §1.1).

The document is tokenized **once** (`tokenize_document`) and chunked on token ids, so chunk boundaries
are exact and no chunk is ever re-tokenized from text (docs/design.md, pitfall "Text round trips").

A document of N = `len(ids)` tokens is read within a budget of L = `max_chunks * chunk_tokens` tokens.
Truncation first chooses which document tokens are read (`kept_spans`, half-open token ranges in
document order), then the tokens read are cut into consecutive chunks of `chunk_tokens`.

Invariants of `chunk_context(ids, chunk_tokens, max_chunks, truncation)` (asserted by the tests):
- `kept_spans` are disjoint, increasing, non-empty ranges of `[0, N)`; the chunks concatenated equal
  `ids[s:e]` of every span concatenated, and every chunk is full except possibly the last;
- at most `max_chunks` chunks; a document that fits (N <= L) is read whole: one span `(0, N)`;
- `num_chunks_total = ceil(N / chunk_tokens)` (the chunks of the whole document),
  `dropped_chunks = num_chunks_total - len(chunks)`, `dropped_tokens = N - tokens read`, and
  `truncated == (dropped_tokens > 0) == (dropped_chunks > 0)`;
- an empty document gives zero chunks (the rollout goes straight to the final turn).

Truncation policies, when N > L (M = max_chunks, C = chunk_tokens):
- `head`:   read tokens [0, L): the first M chunks;
- `tail`:   read the last M chunks of the document's chunking, [(ceil(N/C) - M) * C, N) (the last chunk
  may be short, so fewer than L tokens can be read);
- `center`: MemAgent's token-level policy (its verl fork's `postprocess_data(truncation="center")`):
  read the first and the last floor(L/2) tokens,
  then cut full chunks across the join; on range(10), C=4, M=2 that is [[0,1,2,3],[6,7,8,9]]. The
  budget is used in full (L tokens, or L-1 when L is odd), and a chunk may straddle the join;
- `center_chunks`: memrl's first policy, by whole chunks of the document's chunking: the first
  ceil(M/2) and the last floor(M/2) chunks (N=10 chunks, M=5 keeps chunks 0, 1, 2, 8, 9). The short
  last chunk, when kept, leaves the budget part-used; kept for reproducing runs made with it.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

TruncationPolicy = Literal["head", "tail", "center", "center_chunks"]
TRUNCATION_POLICIES: tuple[str, ...] = ("head", "tail", "center", "center_chunks")


@dataclass(frozen=True)
class Chunks:
    """The chunks kept from one document, and a record of what truncation dropped."""

    chunks: list[list[int]]
    total_tokens: int
    num_chunks_total: int
    dropped_chunks: int
    dropped_tokens: int
    truncation: str
    kept_spans: list[tuple[int, int]]

    @property
    def truncated(self) -> bool:
        return self.dropped_tokens > 0

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    def to_metadata(self) -> dict[str, Any]:
        """A JSON-friendly summary for `Trajectory.metadata` (the token ids themselves are left out)."""
        return {
            "total_tokens": self.total_tokens,
            "num_chunks": self.num_chunks,
            "num_chunks_total": self.num_chunks_total,
            "chunk_lengths": [len(c) for c in self.chunks],
            "dropped_chunks": self.dropped_chunks,
            "dropped_tokens": self.dropped_tokens,
            "truncation": self.truncation,
            "truncated": self.truncated,
            "kept_spans": [list(span) for span in self.kept_spans],
        }


# One added-token-free copy of each tokenizer's backend, built on first use (copying the vocabulary
# takes ~1 s for Qwen3's 151k tokens; a rollout tokenizes thousands of documents).
_PLAIN_BACKENDS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_PLAIN_BACKENDS_LOCK = threading.Lock()  # rollout threads (the pipeline's producer, eval) share the cache


def _plain_backend(tokenizer: Any) -> Any | None:
    """The tokenizer's Rust backend with its added vocabulary removed, or None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    with _PLAIN_BACKENDS_LOCK:
        plain = _PLAIN_BACKENDS.get(tokenizer)
        if plain is None:
            from tokenizers import Tokenizer

            spec = json.loads(backend.to_str())
            spec["added_tokens"] = []
            spec["truncation"] = spec["padding"] = None
            plain = _PLAIN_BACKENDS[tokenizer] = Tokenizer.from_str(json.dumps(spec))
        return plain


def tokenize_document(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a document: no BOS/EOS added, and every added-token string read as plain text.

    Documents are untrusted: one that literally contains "<|im_end|>", "</think>" or "<tool_call>" must
    not inject those tokens' real ids into a prompt. `split_special_tokens=True` covers only the tokens
    marked special; Qwen3's `<think>`, `<tool_call>` and `<|fim_*|>` are added but not special, so the
    text is encoded by the tokenizer's model alone (normalizer, pre-tokenizer, BPE) with its added
    vocabulary removed: exactly the ids of ordinary text. Slow (Python) tokenizers fall back to
    `split_special_tokens=True`.
    """
    if not isinstance(text, str):
        raise TypeError(f"tokenize_document: text must be a str, got {type(text).__name__}")
    plain = _plain_backend(tokenizer)
    if plain is not None:
        return list(plain.encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a chunk size is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def kept_token_spans(total_tokens: int, chunk_tokens: int, max_chunks: int, truncation: str) -> list[tuple[int, int]]:
    """The document token ranges a policy reads, in order (see the module docstring)."""
    budget = max_chunks * chunk_tokens
    if total_tokens <= budget:
        return [(0, total_tokens)] if total_tokens else []
    if truncation == "head":
        return [(0, budget)]
    num_total = -(-total_tokens // chunk_tokens)
    if truncation == "tail":
        return [((num_total - max_chunks) * chunk_tokens, total_tokens)]
    if truncation == "center":
        half = budget // 2  # a budget of 1 token has no halves: read it from the head
        return [(0, half), (total_tokens - half, total_tokens)] if half else [(0, budget)]
    first = (max_chunks + 1) // 2  # center_chunks: ceil(M/2) whole chunks from the beginning ...
    last = max_chunks // 2  # ... and floor(M/2) from the end
    spans = [(0, first * chunk_tokens)]
    if last:
        spans.append(((num_total - last) * chunk_tokens, total_tokens))
    return spans


def chunk_context(
    ids: Sequence[int],
    chunk_tokens: int,
    max_chunks: int,
    truncation: TruncationPolicy = "center",
) -> Chunks:
    """Consecutive chunks of at most `chunk_tokens` ids, truncated to `max_chunks` by `truncation`.

    See the module docstring for the exact invariants and policies. Raises ValueError naming the
    argument when `chunk_tokens` or `max_chunks` is not a positive int or `truncation` is unknown.
    """
    _check_positive_int("chunk_tokens", chunk_tokens)
    _check_positive_int("max_chunks", max_chunks)
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation must be one of {', '.join(TRUNCATION_POLICIES)}, got {truncation!r}")
    if isinstance(ids, str | bytes):
        raise ValueError("ids must be a sequence of token ids, not text; tokenize it with tokenize_document")
    ids = [int(i) for i in ids]

    total = len(ids)
    spans = kept_token_spans(total, chunk_tokens, max_chunks, truncation)
    read = [t for start, end in spans for t in ids[start:end]]
    chunks = [read[k : k + chunk_tokens] for k in range(0, len(read), chunk_tokens)]
    num_total = -(-total // chunk_tokens)  # ceil division; 0 for an empty document
    return Chunks(
        chunks=chunks,
        total_tokens=total,
        num_chunks_total=num_total,
        dropped_chunks=num_total - len(chunks),
        dropped_tokens=total - len(read),
        truncation=truncation,
        kept_spans=spans,
    )
