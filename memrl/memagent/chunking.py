"""Cut a tokenized document into the chunks a MemAgent reads, one per memory turn (SPEC §1.1).

The document is tokenized **once** (`tokenize_document`) and chunked on token ids, so chunk boundaries
are exact and no chunk is ever re-tokenized from text (PITFALLS "Text round trips").

Invariants of `chunk_context(ids, chunk_tokens, max_chunks, truncation)` (asserted by the tests):
- the document splits into `num_chunks_total = ceil(len(ids) / chunk_tokens)` consecutive chunks; chunk
  `k` is `ids[k * chunk_tokens : (k + 1) * chunk_tokens]`, every one full except possibly the last;
- at most `max_chunks` are kept, in document order; `kept_indices` names them, and
  `chunks[j] == ids[kept_indices[j] * chunk_tokens : ...]`, so the kept chunks concatenated equal the
  corresponding slices of `ids`;
- `len(chunks) + dropped_chunks == num_chunks_total` and
  `sum(map(len, chunks)) + dropped_tokens == total_tokens == len(ids)`;
- an empty document gives zero chunks (the rollout goes straight to the final turn).

Truncation policies, when `num_chunks_total > max_chunks` (N = num_chunks_total, M = max_chunks):
- `head`:   keep chunks 0 .. M-1 (the beginning of the document);
- `tail`:   keep chunks N-M .. N-1 (the end);
- `center`: keep the first ceil(M/2) chunks and the last floor(M/2) chunks, dropping the middle of the
  document; e.g. N=10, M=5 keeps 0, 1, 2, 8, 9. The short last chunk, if any, is among the kept ones
  whenever floor(M/2) >= 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

TruncationPolicy = Literal["head", "tail", "center"]
TRUNCATION_POLICIES: tuple[str, ...] = ("head", "tail", "center")


@dataclass(frozen=True)
class Chunks:
    """The chunks kept from one document, and a record of what truncation dropped."""

    chunks: list[list[int]]
    total_tokens: int
    num_chunks_total: int
    dropped_chunks: int
    dropped_tokens: int
    truncation: str
    kept_indices: list[int]

    @property
    def truncated(self) -> bool:
        return self.dropped_chunks > 0

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
            "kept_indices": list(self.kept_indices),
        }


def tokenize_document(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a document: no BOS/EOS added, and special-token strings read as plain text.

    `split_special_tokens=True` matters for untrusted text: a document that literally contains
    "<|im_end|>" must not inject the real end-of-turn id into a prompt.
    """
    if not isinstance(text, str):
        raise TypeError(f"tokenize_document: text must be a str, got {type(text).__name__}")
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a chunk size is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def kept_chunk_indices(num_chunks_total: int, max_chunks: int, truncation: str) -> list[int]:
    """Indices (in document order) of the chunks a policy keeps out of `num_chunks_total`."""
    if num_chunks_total <= max_chunks:
        return list(range(num_chunks_total))
    if truncation == "head":
        return list(range(max_chunks))
    if truncation == "tail":
        return list(range(num_chunks_total - max_chunks, num_chunks_total))
    first = (max_chunks + 1) // 2  # ceil(M/2) from the beginning
    last = max_chunks // 2  # floor(M/2) from the end
    return list(range(first)) + list(range(num_chunks_total - last, num_chunks_total))


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
    num_total = -(-total // chunk_tokens)  # ceil division; 0 for an empty document
    kept = kept_chunk_indices(num_total, max_chunks, truncation)
    chunks = [ids[k * chunk_tokens : (k + 1) * chunk_tokens] for k in kept]
    kept_tokens = sum(len(c) for c in chunks)
    return Chunks(
        chunks=chunks,
        total_tokens=total,
        num_chunks_total=num_total,
        dropped_chunks=num_total - len(kept),
        dropped_tokens=total - kept_tokens,
        truncation=truncation,
        kept_indices=kept,
    )
