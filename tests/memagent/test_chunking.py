from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.memagent.chunking import TRUNCATION_POLICIES, Chunks, chunk_context, tokenize_document


def _check_invariants(ids: list[int], c: Chunks, chunk_tokens: int, max_chunks: int) -> None:
    n_total = -(-len(ids) // chunk_tokens)
    assert c.total_tokens == len(ids)
    assert c.num_chunks_total == n_total
    assert len(c.chunks) <= max_chunks
    # Spans: disjoint, increasing, non-empty, inside the document; the chunks read exactly them.
    for start, end in c.kept_spans:
        assert 0 <= start < end <= len(ids)
    for (_, end), (start, _) in zip(c.kept_spans, c.kept_spans[1:], strict=False):
        assert end < start
    read = [t for start, end in c.kept_spans for t in ids[start:end]]
    assert [t for ch in c.chunks for t in ch] == read
    assert all(len(ch) == chunk_tokens for ch in c.chunks[:-1]) and all(0 < len(ch) for ch in c.chunks)
    # Counts add up.
    assert len(c.chunks) + c.dropped_chunks == n_total
    assert len(read) + c.dropped_tokens == len(ids)
    assert c.truncated == (c.dropped_tokens > 0) == (c.dropped_chunks > 0)
    if len(ids) <= chunk_tokens * max_chunks:
        assert c.kept_spans == ([(0, len(ids))] if ids else []) and not c.truncated


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(0, 300),
    chunk_tokens=st.integers(1, 40),
    max_chunks=st.integers(1, 12),
    truncation=st.sampled_from(TRUNCATION_POLICIES),
)
def test_chunk_invariants_property(n, chunk_tokens, max_chunks, truncation):
    ids = [(7 * i + 3) % 1000 for i in range(n)]
    c = chunk_context(ids, chunk_tokens, max_chunks, truncation)
    _check_invariants(ids, c, chunk_tokens, max_chunks)
    budget, n_total = chunk_tokens * max_chunks, c.num_chunks_total
    if n <= budget:
        assert [t for ch in c.chunks for t in ch] == ids
    elif truncation == "head":
        assert c.kept_spans == [(0, budget)]
    elif truncation == "tail":
        assert c.kept_spans == [((n_total - max_chunks) * chunk_tokens, n)] and len(c.chunks) == max_chunks
    elif truncation == "center":
        # MemAgent / verl `postprocess_data(truncation="center")`: ids[:L//2] + ids[-(L//2):], then chunks.
        half = budget // 2
        reference = ids[:half] + ids[-half:] if half else ids[:budget]
        assert [t for ch in c.chunks for t in ch] == reference
        assert len(c.chunks) == -(-len(reference) // chunk_tokens) <= max_chunks
    else:
        first, last = (max_chunks + 1) // 2, max_chunks // 2
        doc_chunks = [ids[k : k + chunk_tokens] for k in range(0, n, chunk_tokens)]
        assert c.chunks == doc_chunks[:first] + (doc_chunks[n_total - last:] if last else [])


def test_center_is_memagents_token_level_policy():
    # The two examples: MemAgent reads 2,048 of 2,058 tokens at 512 x 4 (whole chunks read 1,546).
    assert chunk_context(list(range(10)), 4, 2, "center").chunks == [[0, 1, 2, 3], [6, 7, 8, 9]]
    c = chunk_context(list(range(2058)), 512, 4, "center")
    assert sum(map(len, c.chunks)) == 2048 and [len(ch) for ch in c.chunks] == [512] * 4
    assert c.kept_spans == [(0, 1024), (1034, 2058)] and c.dropped_tokens == 10 and c.dropped_chunks == 1
    # A chunk may straddle the join: 3 chunks of 4, L/2 = 6.
    assert chunk_context(list(range(20)), 4, 3, "center").chunks == [[0, 1, 2, 3], [4, 5, 14, 15], [16, 17, 18, 19]]


def test_center_chunks_keeps_whole_chunks():
    c = chunk_context(list(range(2058)), 512, 4, "center_chunks")
    assert sum(map(len, c.chunks)) == 1546 and c.kept_spans == [(0, 1024), (1536, 2058)]
    assert chunk_context(list(range(10)), 4, 2, "center_chunks").chunks == [[0, 1, 2, 3], [8, 9]]


@pytest.mark.parametrize(
    ("truncation", "spans", "kept_tokens"),
    [("head", [(0, 50)], 50), ("tail", [(50, 95)], 45), ("center", [(0, 25), (70, 95)], 50),
     ("center_chunks", [(0, 30), (80, 95)], 45)],
)
def test_policies_on_ten_chunks(truncation, spans, kept_tokens):
    ids = list(range(95))  # 10 chunks of 10, the last one of 5
    c = chunk_context(ids, 10, 5, truncation)
    assert c.kept_spans == spans
    assert c.num_chunks_total == 10 and c.truncated
    assert sum(len(ch) for ch in c.chunks) == kept_tokens and c.dropped_tokens == 95 - kept_tokens
    assert c.dropped_chunks == 10 - len(c.chunks)


def test_exact_multiple_and_short_document():
    c = chunk_context(list(range(8)), 4, 4)
    assert c.chunks == [[0, 1, 2, 3], [4, 5, 6, 7]] and not c.truncated
    c = chunk_context([5, 6], 512, 4)
    assert c.chunks == [[5, 6]] and c.num_chunks_total == 1


def test_empty_document_gives_zero_chunks():
    c = chunk_context([], 512, 4, "center")
    assert c.chunks == [] and c.kept_spans == []
    assert c.total_tokens == c.num_chunks_total == c.dropped_chunks == c.dropped_tokens == 0
    assert not c.truncated


def test_metadata_is_json_and_has_no_ids():
    c = chunk_context(list(range(1000, 1100)), 10, 3, "tail")
    meta = c.to_metadata()
    assert json.loads(json.dumps(meta)) == meta
    assert meta["truncation"] == "tail" and meta["truncated"] is True
    assert meta["kept_spans"] == [[70, 100]] and meta["dropped_tokens"] == 70
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


def test_no_added_token_of_qwen3_can_be_injected_by_a_document(qwen3_tokenizer):
    added = qwen3_tokenizer.added_tokens_decoder  # id -> AddedToken: <|im_end|>, <think>, <tool_call>, <|fim_*|> ...
    assert {"<think>", "</think>", "<tool_call>", "<|fim_prefix|>", "<|im_end|>"} <= {t.content for t in added.values()}
    text = "a </think> b " + " ".join(t.content for t in added.values()) + " end"
    ids = tokenize_document(qwen3_tokenizer, text)
    assert not set(ids) & set(added), sorted(set(ids) & set(added))
    assert 151668 not in tokenize_document(qwen3_tokenizer, "a </think> b")
    assert qwen3_tokenizer.decode(ids) == text  # read as the characters it is made of


# ---- real data: a HotpotQA dev context with the real Qwen3 tokenizer ------------------------------


def format_hotpot_context(record: dict) -> str:
    """docs/design.md §5 layout (unshuffled here): `Document i:` + title + newline + text, joined by blank lines."""
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
        assert sum(map(len, c.chunks)) == min(len(ids), 2048)  # the whole budget is read (MemAgent)
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
    assert small.truncated and small.kept_spans == [(0, 256), (len(ids) - 256, len(ids))]
    assert qwen3_tokenizer.decode(small.chunks[0]).startswith("Document 1:\nEd Wood (film)")
    assert text.endswith(qwen3_tokenizer.decode(small.chunks[-1]))
