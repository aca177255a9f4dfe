"""HotpotQA (distractor) from the pinned hub dataset or a local official JSON (docs/design.md §5): parse
to `HotpotExample`, build per-question contexts, choose held-out then training ids. A context's paragraphs
are shuffled per question with `derived_seed(seed, id)`: one global shuffle would pin gold paragraphs to the
same positions. Held-out ids are drawn by seed from all ids, never from any model's answers.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tqdm import tqdm

from memrl.data.records import (
    OFFLINE,
    DataError,
    QuestionRecord,
    check_unique_ids,
    checked_id,
    read_json_list,
    read_jsonl_lines,
    require_module,
)
from memrl.errors import MemrlError

HOTPOTQA_REPO = "hotpotqa/hotpot_qa"
HOTPOTQA_CONFIG = "distractor"
HOTPOTQA_REVISION = "1908d6afbbead072334abe2965f91bd2709910ab"
Paragraph = tuple[str, tuple[str, ...]]  # (title, sentences)
# 300 official records shipped with memrl (CC BY-SA 4.0; attribution and sha256 in the folder's README.md), so a
# fresh clone has real HotpotQA text: what `memrl demo-real` prepares its questions from.
SHIPPED_DIR = Path(__file__).resolve().parent / "hotpotqa_records"
SHIPPED_FILES = {"dev": SHIPPED_DIR / "hotpot_dev_distractor_first200.json.gz",
                 "train": SHIPPED_DIR / "hotpot_train_sample100.json.gz"}


class SelectionError(ValueError, MemrlError):
    """Id selection cannot be done as asked (too few ids, bad pass counts); the message says what to change."""


@dataclass(frozen=True)
class HotpotExample:
    id: str
    question: str
    answer: str
    type: str
    level: str
    supporting_facts: tuple[tuple[str, int], ...]
    paragraphs: tuple[Paragraph, ...]  # in source order

    @property
    def gold_titles(self) -> set[str]:
        return {title for title, _ in self.supporting_facts}


# ---------------------------------------------------------------------------------------------- parsing

def _paragraph(item: Any, pos: int, error: Callable[..., DataError]) -> Paragraph:
    if not isinstance(item, list | tuple) or len(item) != 2:
        raise error(f"paragraph {pos} must be [title, sentences]", field="context")
    title, sentences = item
    if not isinstance(title, str) or not isinstance(sentences, list | tuple) or \
            not all(isinstance(s, str) for s in sentences):
        raise error(f"paragraph {pos} must be a title string and a list of sentence strings", field="context")
    return title, tuple(sentences)


def _fact(item: Any, pos: int, error: Callable[..., DataError]) -> tuple[str, int]:
    if not isinstance(item, list | tuple) or len(item) != 2:
        raise error(f"fact {pos} must be [title, sentence index]", field="supporting_facts")
    title, sent_id = item
    if not isinstance(title, str) or not isinstance(sent_id, int) or isinstance(sent_id, bool):
        raise error(f"fact {pos} must be (title string, sentence index), got {[title, sent_id]!r}",
                    field="supporting_facts")
    return title, sent_id


def _example(raw: dict, record_id: str, paragraphs: Sequence[Any], facts: Sequence[Any],
             error: Callable[..., DataError]) -> HotpotExample:
    """The example of `raw` whose (title, sentences) and (title, sentence index) pairs are `paragraphs`
    and `facts`, each checked in turn (both formats share these rules)."""
    parsed = tuple(_paragraph(item, pos, error) for pos, item in enumerate(paragraphs))
    parsed_facts = tuple(_fact(item, pos, error) for pos, item in enumerate(facts))

    def text(name: str, optional: bool = False) -> str:
        value = raw.get(name, "" if optional else None)
        if not isinstance(value, str) or (not optional and not value.strip()):
            raise error(f"must be a non-empty string, got {value!r}"[:200], field=name)
        return value

    return HotpotExample(id=record_id, question=text("question"), answer=text("answer"), type=text("type", True),
                         level=text("level", True), supporting_facts=parsed_facts, paragraphs=parsed)


def parse_official_record(raw: Any, source: Any, index: int) -> HotpotExample:
    """One record of the official JSON: {_id, question, answer, supporting_facts:[[title, sent_id]...],
    context:[[title, [sentence...]]...], type, level}."""
    record_id = checked_id(raw, "_id", source, index)
    error = partial(DataError, source, index=index, record_id=record_id)
    context, facts = raw.get("context"), raw.get("supporting_facts")
    if not isinstance(context, list) or not context:
        raise error("must be a non-empty list of [title, sentences]", field="context")
    if not isinstance(facts, list):
        raise error("must be a list of [title, sentence index]", field="supporting_facts")
    return _example(raw, record_id, context, facts, error)


def parse_hub_record(raw: Any, source: Any, index: int) -> HotpotExample:
    """One row of the hub dataset: {id, question, answer, type, level,
    supporting_facts:{title:[...], sent_id:[...]}, context:{title:[...], sentences:[[...]...]}}."""
    record_id = checked_id(raw, "id", source, index)
    error = partial(DataError, source, index=index, record_id=record_id)
    context, facts = raw.get("context"), raw.get("supporting_facts")
    if not isinstance(context, dict) or not isinstance(context.get("title"), list) \
            or not isinstance(context.get("sentences"), list) \
            or len(context["title"]) != len(context["sentences"]) or not context["title"]:
        raise error("must be {title: [...], sentences: [[...]...]} of equal, non-zero lengths", field="context")
    if not isinstance(facts, dict) or not isinstance(facts.get("title"), list) \
            or not isinstance(facts.get("sent_id"), list) or len(facts["title"]) != len(facts["sent_id"]):
        raise error("must be {title: [...], sent_id: [...]} of equal lengths", field="supporting_facts")
    return _example(raw, record_id, list(zip(context["title"], context["sentences"], strict=True)),
                    list(zip(facts["title"], facts["sent_id"], strict=True)), error)


def parse_hotpot_record(raw: Any, source: Any, index: int) -> HotpotExample:
    """Either format: official records carry `_id`, hub rows carry `id` and dict-shaped context."""
    if isinstance(raw, dict) and "_id" not in raw and "id" in raw:
        return parse_hub_record(raw, source, index)
    return parse_official_record(raw, source, index)


def parse_hotpot_records(rows: Iterable[Any], source: Any, total: int | None = None,
                         positions: Sequence[int] | None = None) -> list[HotpotExample]:
    """Parse rows of either format; duplicate ids are a `DataError` (id lists must be unambiguous). Errors
    name a row by `positions[i]` (the `Line`s of a JSONL file), else by its index."""
    examples = [parse_hotpot_record(raw, source, positions[index] if positions is not None else index)
                for index, raw in enumerate(tqdm(rows, total=total, desc="parse hotpotqa", unit="q", leave=False,
                                                 disable=total is not None and total < 5000))]
    check_unique_ids(examples, source, positions)
    return examples


def load_hotpotqa_file(path: str | Path) -> list[HotpotExample]:
    """A local copy: the official JSON list, also gzip-compressed (`.json.gz`), or a JSON list / JSONL of
    hub-format rows."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file does not exist; pass the official HotpotQA JSON (e.g. hotpot_train_v1.1.json)")
    if path.suffix == ".jsonl":
        numbered = read_jsonl_lines(path)
        return parse_hotpot_records([raw for _, raw in numbered], path, total=len(numbered),
                                    positions=[line for line, _ in numbered])
    rows = read_json_list(path, "question records")
    return parse_hotpot_records(rows, path, total=len(rows))


def load_hotpotqa_hub(split: str = "train", revision: str = HOTPOTQA_REVISION,
                      cache_dir: str | None = None) -> list[HotpotExample]:
    """Download (or reuse the cache of) the pinned hub dataset; needs the optional `datasets` package."""
    datasets = require_module("datasets", "downloading HotpotQA from the hub", "hub", OFFLINE)
    rows = datasets.load_dataset(HOTPOTQA_REPO, HOTPOTQA_CONFIG, split=split, revision=revision,
                                 cache_dir=cache_dir)
    return parse_hotpot_records(rows, f"hub:{HOTPOTQA_REPO}@{revision}[{split}]", total=len(rows))


# ---------------------------------------------------------------------------------------------- contexts

def derived_seed(seed: int, tag: str) -> int:
    """A 64-bit seed from a base seed and a tag (a question id, "heldout", ...), stable unlike hash()."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{tag}".encode()).digest()[:8], "big")


def paragraph_document(title: str, sentences: Sequence[str]) -> str:
    return title + "\n" + "".join(sentences)


def format_documents(documents: Sequence[str]) -> str:
    """`Document 1:\\n{doc}\\n\\nDocument 2:\\n{doc}...` (the RULER-HQA layout)."""
    return "\n\n".join(f"Document {i}:\n{doc}" for i, doc in enumerate(documents, start=1))


def shuffled_context(example: HotpotExample, seed: int) -> tuple[str, list[int]]:
    """The question's own paragraphs in a per-question seeded order; returns (context, gold_positions)."""
    order = list(range(len(example.paragraphs)))
    random.Random(derived_seed(seed, example.id)).shuffle(order)
    paragraphs = [example.paragraphs[i] for i in order]
    gold = example.gold_titles
    positions = [pos for pos, (title, _) in enumerate(paragraphs, start=1) if title in gold]
    return format_documents([paragraph_document(t, s) for t, s in paragraphs]), positions


def to_question_record(example: HotpotExample, seed: int) -> QuestionRecord:
    context, gold_positions = shuffled_context(example, seed)
    return QuestionRecord(
        id=example.id, question=example.question, answers=[example.answer], context=context,
        metadata={"source": "hotpotqa", "type": example.type, "level": example.level,
                  "num_docs": len(example.paragraphs), "gold_positions": gold_positions,
                  "seed": seed, "shuffle_seed": derived_seed(seed, example.id),
                  "supporting_facts": [list(f) for f in example.supporting_facts]})


# ---------------------------------------------------------------------------------------------- id lists

def _draw(ids: Iterable[str], num: int, seed: int, tag: str, what: str, too_few: str) -> list[str]:
    """`num` ids drawn by `derived_seed(seed, tag)` from `ids`, sorted first so the input order does not
    matter; the drawn order is the frozen one. `too_few` ends the error: where the ids are, what to change."""
    pool = sorted(set(ids))
    if num > len(pool):
        raise SelectionError(f"asked for {num} {what} ids but only {len(pool)} questions {too_few}")
    return random.Random(derived_seed(seed, tag)).sample(pool, num)


def select_heldout(all_ids: Iterable[str], num: int, seed: int) -> list[str]:
    return _draw(all_ids, num, seed, "heldout", "held-out", "are in the data; lower --num-heldout")


def select_by_seed(candidates: Iterable[str], num: int, seed: int) -> list[str]:
    return _draw(candidates, num, seed, "train", "training",
                 "remain after the held-out set; lower --num-train or --num-heldout")


def select_by_pass_counts(pass_counts: dict[str, int], k: int, num: int, *, seed: int | None = None) -> list[str]:
    """The first `num` ids whose pass count c satisfies 0 < c < k (neither always nor never solved), in the
    candidates' order or shuffled by `seed`; counts must be integers in [0, k]."""
    if k < 2:
        raise SelectionError(f"pass-k = {k}: with k < 2 no question is solved strictly between 0 and k times")
    for qid, count in pass_counts.items():
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= k:
            raise SelectionError(f"pass count of {qid!r} is {count!r}; counts must be integers in [0, {k}] "
                                 f"(is --pass-k right?)")
    eligible = [qid for qid, count in pass_counts.items() if 0 < count < k]
    if len(eligible) < num:
        raise SelectionError(f"only {len(eligible)} of {len(pass_counts)} candidates have 0 < passes < {k}; "
                             f"need {num}: lower --num-train or run Pass@{k} over more candidates")
    if seed is not None:
        random.Random(derived_seed(seed, "pass-train")).shuffle(eligible)
    return eligible[:num]


def read_pass_counts(path: str | Path, k: int | None = None) -> tuple[dict[str, int], int | None]:
    """(counts, the file's k or None) of `{id: count}` or our recorded `{"k": k, "pass_counts": {...}}`; a
    recorded k other than `k` is an error."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(path, f"cannot read pass counts: {e}") from e
    file_k = None
    if isinstance(raw, dict) and isinstance(raw.get("pass_counts"), dict):
        file_k = raw.get("k")
        raw = raw["pass_counts"]
    if not isinstance(raw, dict):
        raise DataError(path, "pass counts must be a JSON object {question id: number of passes}")
    if k is not None and file_k is not None and file_k != k:
        raise DataError(path, f"the file records k = {file_k} but --pass-k is {k}; pass --pass-k {file_k}")
    return dict(raw), file_k


def read_id_list(path: str | Path) -> list[str]:
    """One id per line (our `train_ids.txt` / `heldout_ids.txt`)."""
    return [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
