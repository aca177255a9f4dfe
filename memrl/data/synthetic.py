"""The synthetic long-document memory task of `memrl demo` / `demo-long` (the rules: docs/demo.md).

A document is 1..`max_chunks` chunks of `facts_per_chunk` facts like "the color of bram is teal ."; no
(attribute, entity) pair occurs twice in one. With `task_tokenizer` every word is one token, so
`chunk_tokens = FACT_TOKENS * facts_per_chunk` puts whole facts in every chunk. Training, held-out and
long-document sets come from separate seeded streams: adding one never changes another (pinned by a test).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memrl.data.manifest import write_manifest
from memrl.data.records import QuestionRecord, write_jsonl
from memrl.errors import MemrlError

ENTITIES = ["bram", "cora", "dax", "elin", "finn", "gale", "hugo", "ida", "jora", "kai", "lena", "milo"]
ATTRIBUTES: dict[str, list[str]] = {
    "color": ["teal", "amber", "crimson", "ivory", "olive", "violet"],
    "city": ["oslo", "lima", "cairo", "perth", "quito", "tunis"],
    "pet": ["otter", "falcon", "lizard", "rabbit", "parrot", "beetle"],
    "food": ["plum", "lentil", "walnut", "pepper", "radish", "mango"],
    "tool": ["hammer", "chisel", "trowel", "ladle", "wrench", "spindle"],
}
FACT_TOKENS = 7  # "the {attribute} of {entity} is {value} ."
BOX_OPEN, BOX_CLOSE = "\\boxed{", "}"
# Template words of the toy recipe (recipes/toy.yaml) and the chat template's role names.
TEMPLATE_WORDS = ["user", "assistant", "system", "question", "memory", "text", "answer", ":", "nothing", "yet",
                  "what", "is", "the", "of", "?", ".", "unknown"]
UNKNOWN = "unknown"  # the value a memory holds until the answer fact is seen
RELATED_CAPACITY = (len(ATTRIBUTES) - 1) + (len(ENTITIES) - 1)  # distractors sharing entity or attribute


class SyntheticTaskError(ValueError, MemrlError):
    """Task parameters that cannot make a valid document; the message says what to change."""


def task_words() -> list[str]:
    """The word-level vocabulary: every word of the task and of the toy recipe's templates, in fixed order."""
    values = [v for vs in ATTRIBUTES.values() for v in vs]
    return [*TEMPLATE_WORDS, *ENTITIES, *ATTRIBUTES, *values, BOX_OPEN, BOX_CLOSE]


def task_tokenizer() -> Any:
    from memrl.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer(words=task_words())


def fact_text(attribute: str, entity: str, value: str) -> str:
    return f"the {attribute} of {entity} is {value} ."


def question_text(attribute: str, entity: str) -> str:
    return f"what is the {attribute} of {entity} ?"


def answer_text(value: str) -> str:
    return f"{BOX_OPEN} {value} {BOX_CLOSE}"


@dataclass(frozen=True)
class TaskSpec:
    """Size of the task; `filler=True` pads every document to `max_chunks` chunks (`make_padded_record`)."""

    max_chunks: int = 3
    facts_per_chunk: int = 3
    filler: bool = False

    @property
    def chunk_tokens(self) -> int:
        return FACT_TOKENS * self.facts_per_chunk

    def check(self) -> None:
        if self.max_chunks < 1 or self.facts_per_chunk < 1:
            raise SyntheticTaskError(f"max_chunks ({self.max_chunks}) and facts_per_chunk ({self.facts_per_chunk}) "
                                     "must both be >= 1")
        if self.filler:
            return  # filler facts are unbounded; related distractors are capped by make_padded_record
        if self.max_chunks * self.facts_per_chunk - 1 > RELATED_CAPACITY:
            raise SyntheticTaskError(f"a document of {self.max_chunks} x {self.facts_per_chunk} facts needs more "
                                     f"distractors than the {RELATED_CAPACITY} available; lower max_chunks or "
                                     "facts_per_chunk")


def _related_distractors(rng: random.Random, attribute: str, entity: str, value: str,
                         count: int) -> list[tuple[str, str, str]]:
    """`count` distractors: same entity + other attribute, or same attribute + other entity (a coin decides
    which, while both kinds remain); a same-attribute distractor never has the answer's value."""
    same_entity = rng.sample([a for a in ATTRIBUTES if a != attribute], len(ATTRIBUTES) - 1)
    same_attribute = rng.sample([e for e in ENTITIES if e != entity], len(ENTITIES) - 1)
    facts = []
    for _ in range(count):
        if same_entity and (not same_attribute or rng.random() < 0.5):
            a = same_entity.pop()
            facts.append((a, entity, rng.choice(ATTRIBUTES[a])))
        else:
            facts.append((attribute, same_attribute.pop(),
                          rng.choice([v for v in ATTRIBUTES[attribute] if v != value])))
    return facts


def _draw_key(rng: random.Random) -> tuple[str, str, str]:
    """The question's (attribute, entity, value)."""
    attribute = rng.choice(list(ATTRIBUTES))
    entity = rng.choice(ENTITIES)
    return attribute, entity, rng.choice(ATTRIBUTES[attribute])


def _record(record_id: str, key: tuple[str, str, str], facts: list[tuple[str, str, str]], answer_index: int,
            facts_per_chunk: int, **extra: Any) -> QuestionRecord:
    attribute, entity, value = key
    return QuestionRecord(
        id=record_id, question=question_text(attribute, entity), answers=[value],
        context=" ".join(fact_text(*f) for f in facts),
        metadata={"task": "synthetic-memory", "attribute": attribute, "entity": entity,
                  "facts": [list(f) for f in facts], "answer_index": answer_index,
                  "answer_chunk": answer_index // facts_per_chunk, "num_chunks": len(facts) // facts_per_chunk,
                  "facts_per_chunk": facts_per_chunk, **extra},
    )


def make_record(rng: random.Random, spec: TaskSpec, record_id: str) -> QuestionRecord:
    """One question and its document, drawn from `rng`."""
    spec.check()
    if spec.filler:
        return make_padded_record(rng, spec, record_id)
    attribute, entity, value = key = _draw_key(rng)
    num_chunks = rng.randint(1, spec.max_chunks)
    num_facts = num_chunks * spec.facts_per_chunk
    facts = _related_distractors(rng, attribute, entity, value, num_facts - 1)
    answer_index = rng.randrange(num_facts)
    facts.insert(answer_index, key)
    return _record(record_id, key, facts, answer_index, spec.facts_per_chunk)


# ---- long documents: the short task padded with unrelated facts (`memrl demo-long`) ---------------------------


def make_long_record(rng: random.Random, record_id: str, *, num_chunks: int, position: float,
                     facts_per_chunk: int = 3, related: int = 8) -> QuestionRecord:
    """A document of exactly `num_chunks` chunks, the answering fact at `position` (0 = first fact, 1 = last).

    At most `related` facts are the short task's distractors; every other fact is filler sharing neither
    entity nor attribute with the question (as RULER pads with unrelated documents), so a longer document
    is harder only by its length. Filler keys run through the unrelated pairs in a seeded order before any
    repeats."""
    if num_chunks < 1 or facts_per_chunk < 1:
        raise SyntheticTaskError(f"num_chunks ({num_chunks}) and facts_per_chunk ({facts_per_chunk}) must be >= 1")
    if not 0.0 <= position <= 1.0:
        raise SyntheticTaskError(f"position must be in [0, 1] (0 = first fact, 1 = last), got {position}")
    if not 0 <= related <= RELATED_CAPACITY:
        raise SyntheticTaskError(f"related must be in [0, {RELATED_CAPACITY}] (the distractors sharing the entity "
                                 f"or the attribute), got {related}")
    attribute, entity, value = key = _draw_key(rng)
    num_facts = num_chunks * facts_per_chunk
    num_related = min(related, num_facts - 1)
    others = _related_distractors(rng, attribute, entity, value, num_related)
    unrelated = [(a, e) for a in ATTRIBUTES if a != attribute for e in ENTITIES if e != entity]
    pool: list[tuple[str, str]] = []
    for _ in range(num_facts - 1 - num_related):
        if not pool:
            pool = rng.sample(unrelated, len(unrelated))
        a, e = pool.pop()
        others.append((a, e, rng.choice(ATTRIBUTES[a])))
    rng.shuffle(others)
    answer_index = round(position * (num_facts - 1))
    others.insert(answer_index, key)
    return _record(record_id, key, others, answer_index, facts_per_chunk,
                   answer_position=position, related_distractors=num_related,
                   filler_facts=num_facts - 1 - num_related)


# A padded document's related distractors, drawn uniformly: few, so a document has 1.2 filler chunks before
# its first fact with the question's attribute on average (1-4 related: 0.4, too few; measured on 3,000
# documents, docs/demo.md).
PADDED_RELATED = (0, 2)


def make_padded_record(rng: random.Random, spec: TaskSpec, record_id: str) -> QuestionRecord:
    """A short document padded with filler: exactly `max_chunks` chunks, `PADDED_RELATED` related distractors,
    the answering fact at any index, so that committing at the first memory turn is punished (docs/demo.md)."""
    num_facts = spec.max_chunks * spec.facts_per_chunk
    related = rng.randint(min(PADDED_RELATED[0], num_facts - 1), min(PADDED_RELATED[1], num_facts - 1))
    # make_long_record puts the answer at round(position * (num_facts - 1)): an index drawn uniformly.
    position = rng.randrange(num_facts) / (num_facts - 1) if num_facts > 1 else 0.0
    return make_long_record(rng, record_id, num_chunks=spec.max_chunks, position=position,
                            facts_per_chunk=spec.facts_per_chunk, related=related)


def make_length_set(n: int, num_chunks: int, seed: int = 0, *, facts_per_chunk: int = 3, related: int = 8,
                    exclude: set[tuple[str, str]] | frozenset = frozenset()) -> list[QuestionRecord]:
    """`n` held-out questions of `num_chunks` chunks, question i's answer at (i + 0.5) / n of its document,
    deterministic by (num_chunks, seed); a draw in `exclude` (the training set) is redrawn at that position."""
    rng = random.Random(f"memrl-synthetic:length:{num_chunks}:{seed}")
    records = []
    for i in range(n):
        while True:
            record = make_long_record(rng, f"len{num_chunks}-{i:05d}", num_chunks=num_chunks,
                                      position=(i + 0.5) / n, facts_per_chunk=facts_per_chunk, related=related)
            if (record.question, record.context) not in exclude:
                break
        records.append(record)
    return records


def make_records(n: int, spec: TaskSpec, seed: int, prefix: str) -> list[QuestionRecord]:
    rng = random.Random(f"memrl-synthetic:{prefix}:{seed}")
    return [make_record(rng, spec, f"{prefix}-{i:05d}") for i in range(n)]


def make_splits(num_train: int, num_heldout: int, spec: TaskSpec, seed: int = 0
                ) -> tuple[list[QuestionRecord], list[QuestionRecord]]:
    """Training and held-out questions from two seeded streams; a held-out draw equal to a training record
    (possible only for tiny documents) is replaced by the stream's next draw."""
    train = make_records(num_train, spec, seed, "train")
    seen = {(r.question, r.context) for r in train}
    rng = random.Random(f"memrl-synthetic:heldout:{seed}")
    heldout: list[QuestionRecord] = []
    while len(heldout) < num_heldout:
        record = make_record(rng, spec, f"heldout-{len(heldout):05d}")
        if (record.question, record.context) not in seen:
            heldout.append(record)
    return train, heldout


# ---- `memrl prepare-data synthetic` ----------------------------------------------------------------------
def prepare_synthetic(out: str | Path, *, num_train: int = 2000, num_heldout: int = 200, max_chunks: int = 3,
                      facts_per_chunk: int = 3, seed: int = 0, filler: bool = False) -> dict[str, Path]:
    """Write synthetic_train.jsonl / synthetic_heldout.jsonl and a SHA-256 manifest to `out`."""
    out = Path(out)
    spec = TaskSpec(max_chunks=max_chunks, facts_per_chunk=facts_per_chunk, filler=filler)
    train, heldout = make_splits(num_train, num_heldout, spec, seed)
    paths = {"train": out / "synthetic_train.jsonl", "heldout": out / "synthetic_heldout.jsonl"}
    counts = {paths["train"].name: write_jsonl(paths["train"], train),
              paths["heldout"].name: write_jsonl(paths["heldout"], heldout)}
    write_manifest(out, counts, "memrl prepare-data synthetic",
                   {"task": "synthetic-memory", "num_train": num_train, "num_heldout": num_heldout,
                    "max_chunks": max_chunks, "facts_per_chunk": facts_per_chunk, "seed": seed,
                    "filler": filler, "chunk_tokens": spec.chunk_tokens})
    return paths

