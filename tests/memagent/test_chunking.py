from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.memagent.chunking import Chunks, chunk_context, kept_chunk_indices, tokenize_document


def _check_invariants(ids: list[int], c: Chunks, chunk_tokens: int, max_chunks: int) -> None:
    n_total = -(-len(ids) // chunk_tokens)
    assert c.total_tokens == len(ids)
    assert c.num_chunks_total == n_total
    assert len(c.chunks) == min(n_total, max_chunks) == len(c.kept_indices)
    assert c.kept_indices == sorted(set(c.kept_indices))
    assert all(0 <= k < n_total for k in c.kept_indices)
    for k, chunk in zip(c.kept_indices, c.chunks, strict=True):
        assert chunk == ids[k * chunk_tokens : (k + 1) * chunk_tokens]
        assert 0 < len(chunk) <= chunk_tokens
    # Counts add up; dropped tokens are exactly the tokens of the dropped chunks.
    assert len(c.chunks) + c.dropped_chunks == n_total
    assert sum(map(len, c.chunks)) + c.dropped_tokens == len(ids)
    dropped = [k for k in range(n_total) if k not in c.kept_indices]
    assert c.dropped_tokens == sum(len(ids[k * chunk_tokens : (k + 1) * chunk_tokens]) for k in dropped)
    assert c.truncated == (c.dropped_chunks > 0)


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    chunk_tokens=st.integers(1, 40),
    max_chunks=st.integers(1, 12),
    truncation=st.sampled_from(["head", "tail", "center"]),
)
def test_chunk_invariants_property(n, chunk_tokens, max_chunks, truncation):
    ids = [(7 * i + 3) % 1000 for i in range(n)]
    c = chunk_context(ids, chunk_tokens, max_chunks, truncation)
    _check_invariants(ids, c, chunk_tokens, max_chunks)
    n_total = c.num_chunks_total
    if n_total <= max_chunks:
        # Nothing dropped: the chunks concatenate back to the whole document.
        assert [t for ch in c.chunks for t in ch] == ids and not c.truncated
    elif truncation == "head":
        assert c.kept_indices == list(range(max_chunks))
    elif truncation == "tail":
        assert c.kept_indices == list(range(n_total - max_chunks, n_total))
    else:
        first, last = (max_chunks + 1) // 2, max_chunks // 2
        assert c.kept_indices[:first] == list(range(first))
        assert c.kept_indices[first:] == list(range(n_total - last, n_total))


@pytest.mark.parametrize(
    ("truncation", "expected"),
    [("head", [0, 1, 2, 3, 4]), ("tail", [5, 6, 7, 8, 9]), ("center", [0, 1, 2, 8, 9])],
)
def test_policies_on_ten_chunks(truncation, expected):
    ids = list(range(95))  # 10 chunks of 10, the last one of 5
    c = chunk_context(ids, 10, 5, truncation)
    assert c.kept_indices == expected
    assert c.num_chunks_total == 10 and c.dropped_chunks == 5 and c.truncated
    kept_tokens = sum(len(ch) for ch in c.chunks)
    assert c.dropped_tokens == 95 - kept_tokens
    assert kept_tokens == (50 if truncation == "head" else 45)


def test_center_keeps_first_half_rounded_up():
    assert kept_chunk_indices(10, 1, "center") == [0]
    assert kept_chunk_indices(10, 2, "center") == [0, 9]
    assert kept_chunk_indices(10, 3, "center") == [0, 1, 9]
    assert kept_chunk_indices(3, 3, "center") == [0, 1, 2]


def test_exact_multiple_and_short_document():
    c = chunk_context(list(range(8)), 4, 4)
    assert c.chunks == [[0, 1, 2, 3], [4, 5, 6, 7]] and not c.truncated
    c = chunk_context([5, 6], 512, 4)
    assert c.chunks == [[5, 6]] and c.num_chunks_total == 1


def test_empty_document_gives_zero_chunks():
    c = chunk_context([], 512, 4, "center")
    assert c.chunks == [] and c.kept_indices == []
    assert c.total_tokens == c.num_chunks_total == c.dropped_chunks == c.dropped_tokens == 0
    assert not c.truncated


def test_metadata_is_json_and_has_no_ids():
    c = chunk_context(list(range(1000, 1100)), 10, 3, "tail")
    meta = c.to_metadata()
    assert json.loads(json.dumps(meta)) == meta
    assert meta["truncation"] == "tail" and meta["truncated"] is True
    assert meta["kept_indices"] == [7, 8, 9] and meta["dropped_tokens"] == 70
    assert meta["chunk_lengths"] == [10, 10, 10] and meta["num_chunks"] == 3
    assert "chunks" not in meta and "1099" not in json.dumps(meta)


def test_chunks_is_frozen():
    c = chunk_context([1, 2, 3], 2, 2)
    with pytest.raises(AttributeError):
        c.total_tokens = 0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"chunk_tokens": 0, "max_chunks": 4}, "chunk_tokens"),
        ({"chunk_tokens": -3, "max_chunks": 4}, "chunk_tokens"),
        ({"chunk_tokens": 2.5, "max_chunks": 4}, "chunk_tokens"),
        ({"chunk_tokens": True, "max_chunks": 4}, "chunk_tokens"),
        ({"chunk_tokens": 8, "max_chunks": 0}, "max_chunks"),
        ({"chunk_tokens": 8, "max_chunks": None}, "max_chunks"),
        ({"chunk_tokens": 8, "max_chunks": 4, "truncation": "middle"}, "truncation"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        chunk_context([1, 2, 3], **kwargs)


def test_text_instead_of_ids_is_rejected():
    with pytest.raises(ValueError, match="ids"):
        chunk_context("some text", 4, 2)


def test_tokenize_document_adds_nothing_and_keeps_special_strings_as_text(tiny_tokenizer):
    text = "Paris is the capital of France. <|im_end|> é"
    ids = tokenize_document(tiny_tokenizer, text)
    assert tiny_tokenizer.decode(ids) == text
    # A document must not be able to inject the end-of-turn id.
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids
    assert tokenize_document(tiny_tokenizer, "") == []


# ---- real data: a HotpotQA dev context with the real Qwen3 tokenizer ------------------------------


def format_hotpot_context(record: dict) -> str:
    """SPEC §5 layout (unshuffled here): `Document i:` + title + newline + text, joined by blank lines."""
    docs = [f"{title}\n{''.join(sentences)}" for title, sentences in record["context"]]
    return "\n\n".join(f"Document {i}:\n{doc}" for i, doc in enumerate(docs, start=1))


def test_real_hotpot_context_with_qwen3(hotpot_dev_records, qwen3_tokenizer):
    records = [r for r in hotpot_dev_records if len(r["context"]) == 10][:20]
    assert len(records) == 20
    for record in records:
        text = format_hotpot_context(record)
        ids = tokenize_document(qwen3_tokenizer, text)
        # Same ids as a plain whole-text encoding (HotpotQA has no special-token strings), no BOS/EOS.
        assert ids == qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert not set(ids) & {151643, 151644, 151645}
        c = chunk_context(ids, 512, 4, "center")
        _check_invariants(ids, c, 512, 4)
        assert [len(ch) for ch in c.chunks[:-1]] == [512] * (len(c.chunks) - 1)
        if not c.truncated:
            assert [t for ch in c.chunks for t in ch] == ids
            # Byte-level BPE: the chunks decode back to the exact document.
            assert qwen3_tokenizer.decode([t for ch in c.chunks for t in ch]) == text


def test_real_first_record_boundaries(hotpot_dev_records, qwen3_tokenizer):
    text = format_hotpot_context(hotpot_dev_records[0])
    assert text.startswith("Document 1:\nEd Wood (film)\nEd Wood is a 1994 American")
    ids = tokenize_document(qwen3_tokenizer, text)
    assert 1024 < len(ids) <= 2048  # a 10-paragraph context: 3 or 4 chunks of 512, no truncation
    c = chunk_context(ids, 512, 4)
    assert not c.truncated and c.num_chunks_total == -(-len(ids) // 512)
    assert c.chunks[0] == ids[:512] and c.chunks[1] == ids[512:1024] and c.chunks[-1][-1] == ids[-1]
    # A longer read at small chunks does truncate, and center keeps both ends of the document.
    small = chunk_context(ids, 128, 4, "center")
    assert small.truncated and small.kept_indices[:2] == [0, 1]
    assert small.kept_indices[2:] == [small.num_chunks_total - 2, small.num_chunks_total - 1]
    assert qwen3_tokenizer.decode(small.chunks[0]).startswith("Document 1:\nEd Wood (film)")
    assert text.endswith(qwen3_tokenizer.decode(small.chunks[-1]))
