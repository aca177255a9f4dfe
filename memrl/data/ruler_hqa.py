"""RULER-HQA (docs/design.md §5): read the published `eval_{N}.json` files, and build sets of the same shape
offline. In 12800/25600 `context` is a list of indices into a pool the repository does not ship. Every
record returned or written has a string `context`, a non-empty `input`, non-empty string `answers` and
integer `num_docs` / `index` (else a `DataError`); extra fields stay.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memrl.data.hotpotqa import HotpotExample, Paragraph, derived_seed, format_documents, paragraph_document
from memrl.data.records import (
    OFFLINE,
    DataError,
    QuestionRecord,
    check_unique_ids,
    read_json_list,
    require_module,
    verify_if_manifest,
)
from memrl.errors import MemrlError
from memrl.io import atomic_write_json

RULER_REPO = "BytedTsinghua-SIA/hotpotqa"
RULER_REVISION = "27275ff4fee67ac0acb6478e405e7ac07efbdc1a"
RULER_LENGTHS = (50, 200, 800)
# How `build_ruler_set` lays out a question's documents (see its docstring): memrl's own, or the official
# builder's (MemAgent taskutils/memory_data/different_docs_eval.py), for reproducing the published files.
RULER_LAYOUTS = ("memrl", "official")
OFFICIAL_SHUFFLE_SEED = 4  # the official builder shuffles every question with a fresh random.Random(4)


class RulerBuildError(ValueError, MemrlError):
    """A RULER-style set cannot be built as asked (pool too small, N too small); says what to change."""


def ruler_filename(num_docs: int) -> str:
    return f"eval_{num_docs}.json"


def download_ruler_file(num_docs: int, revision: str = RULER_REVISION, cache_dir: str | None = None) -> Path:
    hub = require_module("huggingface_hub", "downloading RULER-HQA from the hub", "hub", OFFLINE)
    return Path(hub.hf_hub_download(repo_id=RULER_REPO, filename=ruler_filename(num_docs), repo_type="dataset",
                                    revision=revision, cache_dir=cache_dir))


# ---------------------------------------------------------------------------------------------- reading

def load_pool(pool: str | Path | Sequence[Any]) -> list[str]:
    """Documents of an index-list context: a JSON list (or a path to one) whose items are formatted
    documents (`"{title}\\n{text}"`), `{"title", "text"}` objects or `[title, sentences]` pairs."""
    source: Any = "document pool"
    if isinstance(pool, str | Path):
        source = Path(pool)
        try:
            pool = json.loads(source.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(source, f"cannot read the document pool: {e}") from e
    if not isinstance(pool, list | tuple):
        raise DataError(source, f"the document pool must be a JSON list, got {type(pool).__name__}")
    documents = []
    for i, doc in enumerate(pool):
        if isinstance(doc, str):
            documents.append(doc)
        elif isinstance(doc, dict) and isinstance(doc.get("title"), str) and isinstance(doc.get("text"), str):
            documents.append(doc["title"] + "\n" + doc["text"])
        elif isinstance(doc, list | tuple) and len(doc) == 2 and isinstance(doc[0], str):
            body = doc[1] if isinstance(doc[1], str) else "".join(doc[1]) if isinstance(doc[1], list) else None
            if body is None:
                raise DataError(source, "document must be [title, text or sentences]", i, field="pool")
            documents.append(paragraph_document(doc[0], body))
        else:
            raise DataError(source, "document must be a string, {title, text} or [title, sentences]", i, field="pool")
    return documents


def _materialize(indices: list[Any], pool: list[str] | None, error: Callable[..., DataError]) -> str:
    if pool is None:
        raise error("context is a list of document indices; pass the document pool it indexes "
                    "(--pool FILE, a JSON list of documents)", field="context")
    for pos, i in enumerate(indices):
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(pool):
            raise error(f"item {pos} = {i!r} is not an index into the pool of {len(pool)} documents",
                        field="context")
    return format_documents([pool[i] for i in indices])


def normalize_ruler_record(raw: Any, source: Any, index: int, pool: list[str] | None = None) -> dict[str, Any]:
    """Validate one record; an index-list context is replaced by its text. Extra fields are kept."""
    if not isinstance(raw, dict):
        raise DataError(source, f"expected a JSON object, got {type(raw).__name__}", index)
    error = partial(DataError, source, index=index, record_id=raw.get("id", raw.get("index")))
    for name in ("num_docs", "index"):
        if not isinstance(raw.get(name), int) or isinstance(raw.get(name), bool):
            raise error(f"must be an integer, got {raw.get(name)!r}", field=name)
    if not isinstance(raw.get("input"), str) or not raw["input"].strip():
        raise error(f"must be a non-empty question string, got {raw.get('input')!r}"[:200], field="input")
    answers = raw.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise error(f"must be a non-empty list of strings, got {answers!r}"[:200], field="answers")
    context = raw.get("context")
    if isinstance(context, str):
        return dict(raw)
    if not isinstance(context, list):
        raise error(f"must be a string or a list of document indices, got {type(context).__name__}",
                    field="context")
    if len(context) != raw["num_docs"]:
        raise error(f"lists {len(context)} documents but num_docs is {raw['num_docs']}", field="context")
    return {**raw, "context": _materialize(context, pool, error)}


def read_ruler_file(path: str | Path, pool: str | Path | Sequence[Any] | None = None,
                    verify: bool = True) -> list[dict[str, Any]]:
    """Normalized records of an `eval_{N}.json` file (verified against its folder's manifest if any)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file does not exist")
    if verify:
        verify_if_manifest(path)
    rows = read_json_list(path, "records")
    documents = load_pool(pool) if pool is not None else None
    return [normalize_ruler_record(raw, path, i, documents) for i, raw in enumerate(rows)]


def load_ruler_file(path: str | Path, pool: str | Path | Sequence[Any] | None = None,
                    verify: bool = True) -> list[QuestionRecord]:
    """RULER-HQA records as QuestionRecords: id = the record's `id` if it has one, else its `index`."""
    path = Path(path)
    records = []
    for row in read_ruler_file(path, pool, verify):
        extra = {k: v for k, v in row.items() if k not in ("context", "input", "answers", "id")}
        records.append(QuestionRecord(id=str(row.get("id", row["index"])), question=row["input"],
                                      answers=list(row["answers"]), context=row["context"],
                                      metadata={"source": "ruler_hqa", "file": path.name, **extra}))
    check_unique_ids(records, path)
    return records


def write_ruler_file(path: str | Path, records: Sequence[dict[str, Any]]) -> int:
    """Records as one compact JSON list, written atomically; returns the count."""
    atomic_write_json(path, list(records), indent=None)
    return len(records)


# ---------------------------------------------------------------------------------------------- building

def _distinct_paragraphs(examples: Sequence[HotpotExample]) -> list[Paragraph]:
    """Every paragraph of the pool once, by title, in first-seen order (one Wikipedia article = one title)."""
    seen: dict[str, tuple[str, ...]] = {}
    for example in examples:
        for title, sentences in example.paragraphs:
            seen.setdefault(title, sentences)
    return list(seen.items())


def _distinct_texts(examples: Sequence[HotpotExample]) -> list[Paragraph]:
    """Every paragraph once by its document text, sorted by that text (the official `sorted(set(...))`): one
    title with two texts (an article excerpted differently in two questions) is two documents."""
    seen: dict[str, Paragraph] = {}
    for example in examples:
        for title, sentences in example.paragraphs:
            seen.setdefault(paragraph_document(title, sentences), (title, sentences))
    return [seen[text] for text in sorted(seen)]


def _own_and_fillers(example: HotpotExample, own: list[Paragraph], paragraphs: list[Paragraph], num_docs: int,
                     key: Callable[[Paragraph], str], rng: random.Random) -> list[Paragraph]:
    """`num_docs` documents: the question's own paragraphs (gold first when `num_docs` is below their count),
    then distinct paragraphs of the pool in draw order, none whose `key` is an own paragraph's (all of them
    are in the pool)."""
    gold = [p for p in own if p[0] in example.gold_titles]
    if num_docs < len(gold):
        raise RulerBuildError(f"num_docs = {num_docs} is below the {len(gold)} gold paragraphs of question "
                              f"{example.id!r}; ask for more documents")
    kept = own if len(own) <= num_docs else gold + [p for p in own if p not in gold][:num_docs - len(gold)]
    excluded = {key(p) for p in own}
    need, available = num_docs - len(kept), len(paragraphs) - len(excluded)
    if need > available:
        raise RulerBuildError(f"the pool has only {available} distinct paragraphs outside question "
                              f"{example.id!r}'s own, {need} are needed for num_docs = {num_docs}; "
                              f"build from a larger pool (more questions) or ask for fewer documents")
    # Draw a few extra indices so that, after dropping the question's own paragraphs, `need` remain.
    drawn = rng.sample(range(len(paragraphs)), min(len(paragraphs), need + len(excluded)))
    return kept + [paragraphs[i] for i in drawn if key(paragraphs[i]) not in excluded][:need]


def _memrl_documents(example: HotpotExample, paragraphs: list[Paragraph], num_docs: int,
                     seed: int) -> tuple[list[Paragraph], list[int], int]:
    """memrl's layout: (documents, gold positions, shuffle seed); one seeded draw and shuffle per question."""
    shuffle_seed = derived_seed(seed, example.id)
    rng = random.Random(shuffle_seed)
    documents = _own_and_fillers(example, _distinct_paragraphs([example]), paragraphs, num_docs,
                                 lambda p: p[0], rng)
    rng.shuffle(documents)
    positions = [pos for pos, (title, _) in enumerate(documents, start=1) if title in example.gold_titles]
    return documents, positions, shuffle_seed


def _official_documents(example: HotpotExample, paragraphs: list[Paragraph], num_docs: int,
                        seed: int) -> tuple[list[Paragraph], list[int], int]:
    """The official layout (different_docs_eval.py): own paragraphs + fillers of other texts, then a fresh
    `random.Random(4).shuffle`, so every question of one length lands on the same "Document N" slots; a
    pool of exactly `num_docs` documents is used whole. The official fillers come from a process pool's
    global RNG (not reproducible); here from `random.Random(derived_seed(seed, id))`."""
    own = list(example.paragraphs)
    if num_docs == len(paragraphs):
        documents = list(paragraphs)
    else:
        rng = random.Random(derived_seed(seed, example.id))
        documents = _own_and_fillers(example, own, paragraphs, num_docs, lambda p: paragraph_document(*p), rng)
    random.Random(OFFICIAL_SHUFFLE_SEED).shuffle(documents)
    # Gold by paragraph, not title: a filler may be another version of a gold title's article.
    gold = [p for p in own if p[0] in example.gold_titles]
    positions = [pos for pos, p in enumerate(documents, start=1) if p in gold]
    return documents, positions, OFFICIAL_SHUFFLE_SEED


def build_ruler_set(examples: Sequence[HotpotExample], num_docs: int, seed: int, *,
                    pool: Sequence[HotpotExample] | None = None, layout: str = "memrl") -> list[dict[str, Any]]:
    """RULER-HQA-style records with `num_docs` documents per question: its own paragraphs (gold first if
    `num_docs` is below their count), filled up with paragraphs of the other questions of `pool`. Layout
    "memrl": distinct titles, drawn and shuffled per question, so gold positions vary (docs/design.md,
    pitfall "Fixed document shuffle"); "official": `_official_documents`. gold_positions are 1-based."""
    if layout not in RULER_LAYOUTS:
        raise RulerBuildError(f"layout = {layout!r}; use one of {', '.join(RULER_LAYOUTS)}")
    if num_docs < 1:
        raise RulerBuildError(f"num_docs = {num_docs}; ask for at least 1 document per question")
    source = [*examples] if pool is None else [*pool, *examples]
    paragraphs = _distinct_paragraphs(source) if layout == "memrl" else _distinct_texts(source)
    lay_out = _memrl_documents if layout == "memrl" else _official_documents
    out = []
    for index, example in enumerate(tqdm(examples, desc=f"build ruler {num_docs}", unit="q", leave=False,
                                         disable=len(examples) < 2000)):
        documents, gold_positions, shuffle_seed = lay_out(example, paragraphs, num_docs, seed)
        out.append({
            "context": format_documents([paragraph_document(t, s) for t, s in documents]),
            "input": example.question, "answers": [example.answer], "num_docs": num_docs, "index": index,
            "id": example.id, "gold_positions": gold_positions, "seed": seed, "shuffle_seed": shuffle_seed,
        })
    return out
