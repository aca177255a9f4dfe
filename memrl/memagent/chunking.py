"""Cut a tokenized document into the chunks a MemAgent reads, one per memory turn (docs/design.md §1.1).

The document is tokenized once (`tokenize_document`) and chunked on ids, never re-tokenized from text.
Within the budget L = `max_chunks * chunk_tokens`, truncation first picks the document token ranges read
(`kept_token_spans`), which are then cut into consecutive chunks. Invariants (tested): spans are disjoint,
increasing, non-empty; every chunk is full but the last; `truncated == (dropped_tokens > 0)`; an empty
document has no chunks. `center` is MemAgent's (its verl fork's `postprocess_data`): range(10), C=4, M=2
reads [[0,1,2,3],[6,7,8,9]], cut across the join; `center_chunks` (whole chunks from both ends) is memrl's
first policy, kept to reproduce old runs.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

TruncationPolicy = Literal["head", "tail", "center", "center_chunks"]
TRUNCATION_POLICIES: tuple[str, ...] = get_args(TruncationPolicy)


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
        return {"total_tokens": self.total_tokens, "num_chunks": self.num_chunks,
                "num_chunks_total": self.num_chunks_total, "chunk_lengths": [len(c) for c in self.chunks],
                "dropped_chunks": self.dropped_chunks, "dropped_tokens": self.dropped_tokens,
                "truncation": self.truncation, "truncated": self.truncated,
                "kept_spans": [list(span) for span in self.kept_spans]}


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
    """Token ids of a document, no BOS/EOS, every added-token string read as plain text: documents are
    untrusted, and `split_special_tokens` covers only tokens marked special (Qwen3's `<think>`,
    `<tool_call>` are added, not special), so the backend runs with its added vocabulary removed. Slow
    tokenizers fall back to `split_special_tokens=True`."""
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
    """The document token ranges a policy reads, in order (policies: docs/design.md §1.1)."""
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


def chunk_context(ids: Sequence[int], chunk_tokens: int, max_chunks: int,
                  truncation: TruncationPolicy = "center") -> Chunks:
    """Consecutive chunks of at most `chunk_tokens` ids, truncated to `max_chunks` by `truncation` (module
    docstring); a ValueError names a bad argument."""
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
    return Chunks(chunks=chunks, total_tokens=total, num_chunks_total=num_total,
                  dropped_chunks=num_total - len(chunks), dropped_tokens=total - len(read),
                  truncation=truncation, kept_spans=spans)
