"""HotpotQA questions a short MemAgent reading can answer, and demonstrations of that reading for `memrl sft`
(why a small model needs both: docs/real-model.md). Both are decided by the gold answer only:
- `answerable`: the gold answer occurs in a sentence of the chunks the rollout actually reads;
- `demonstration`: the trajectory a reader that keeps the answer would write, as text (`{"turns": [{"prompt",
  "response"}]}`, what `memrl sft --data` reads), the prompts filled from the rollout's own templates and chunks;
- `answer_memory_record`: the question with a memory holding the answer in place of its document, for GRPO on
  the final turn alone (memrl.memagent.final_turn).
"""

from __future__ import annotations

import random
import re
from typing import Any

from memrl.data.hotpotqa import derived_seed
from memrl.data.records import QuestionRecord
from memrl.memagent.prompts import encode_text, fill_template, input_text, layout_memory_template, text_budget
from memrl.memagent.reward import gold_in_text
from memrl.memagent.rollout import document_chunks
from memrl.memagent.settings import MemAgentSettings
from memrl.scoring import gold_list, normalize_answer

NOTHING_YET = "Nothing about the answer yet."
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def chunk_texts(record: QuestionRecord, tokenizer: Any, cfg: MemAgentSettings) -> list[str]:
    """The decoded chunks the rollout reads of `record` (after its truncation)."""
    return [tokenizer.decode(c) for c in document_chunks(tokenizer, cfg, record.context).chunks]


def _gold_sentence(text: str, golds: list[str]) -> str | None:
    """The first sentence (or line) of `text` that holds a gold answer as whole words (HotpotQA normalisation),
    None if none. Yes/no answers never do: the word "no" in a document does not answer a comparison."""
    golds = [g for g in golds if normalize_answer(g) not in ("yes", "no")]
    for sentence in _SENTENCE_END.split(text):
        if golds and gold_in_text(sentence, golds):
            return sentence.strip()
    return None


def answerable(record: QuestionRecord, tokenizer: Any, cfg: MemAgentSettings) -> bool:
    """Whether a gold answer occurs in one sentence of a chunk the rollout reads."""
    golds = gold_list(record.answers)
    return any(_gold_sentence(text, golds) for text in chunk_texts(record, tokenizer, cfg))


def _fit(text: str, tokenizer: Any, cfg: MemAgentSettings, gold: str) -> str:
    """`text` as a memory turn's response the rollout would take whole: at most `text_budget(memory_tokens)`
    ids as `memrl sft` encodes it (it appends the stop token), cut from the front when the gold answer
    would otherwise be cut off. Decoded ids can encode to more ids: one fewer is kept until it fits."""
    ids, budget = encode_text(tokenizer, text), text_budget(cfg.memory_tokens)
    if len(ids) <= budget:
        return text
    for keep in range(budget, 0, -1):
        head = tokenizer.decode(ids[:keep])
        fitted = head if gold_in_text(head, [gold]) else tokenizer.decode(ids[-keep:]).strip()
        if len(encode_text(tokenizer, fitted)) <= budget:
            return fitted
    return ""


def demonstration(record: QuestionRecord, tokenizer: Any, cfg: MemAgentSettings) -> dict[str, list[dict[str, str]]]:
    """One demonstrated trajectory of `record`: memory turns over the rollout's chunks, then the final turn.

    A memory turn keeps the chunk's sentence with the answer, else repeats the memory so far (the filler
    before it), each cut to what the rollout passes on whole (`_fit`); the final turn boxes the first gold."""
    golds = gold_list(record.answers)
    question = input_text(cfg, record.question)
    memory, turns = None, []
    for text in chunk_texts(record, tokenizer, cfg):
        prompt = fill_template(layout_memory_template(cfg), question=question, chunk=text,
                       memory=memory if memory is not None else cfg.no_memory_text)
        sentence = _gold_sentence(text, golds)
        if sentence is not None:
            memory = _fit(sentence, tokenizer, cfg, golds[0])
        elif memory is None:
            memory = _fit(NOTHING_YET, tokenizer, cfg, golds[0])
        turns.append({"prompt": prompt, "response": memory})
    # An empty memory is passed on as empty, as the rollout does; only a document of no chunks has none yet.
    final = fill_template(cfg.final_template, question=question,
                          memory=memory if memory is not None else cfg.no_memory_text)
    turns.append({"prompt": final, "response": "\\boxed{" + golds[0] + "}"})
    return {"turns": turns}


def answer_memory(record: QuestionRecord, tokenizer: Any, cfg: MemAgentSettings, rng: random.Random) -> str | None:
    """A memory holding the answer, shaped like the reader's own (which copy a run of the document's lines):
    the document's sentences from up to two before the first that holds a gold answer (`rng` draws how many)
    through that one, cut to what a memory turn passes on (`_fit`), else that sentence alone; None when no
    sentence of the document holds one (a yes/no answer never does) or neither cut keeps it."""
    golds = gold_list(record.answers)
    sentences = [s.strip() for s in _SENTENCE_END.split(input_text(cfg, record.context)) if s.strip()]
    hit = next((i for i, s in enumerate(sentences) if _gold_sentence(s, golds)), None)
    if hit is None:
        return None
    start = rng.randint(max(0, hit - 2), hit)
    for text in (" ".join(sentences[start:hit + 1]), sentences[hit]):
        memory = _fit(text, tokenizer, cfg, golds[0])
        if gold_in_text(memory, golds):
            return memory
    return None


def answer_memory_record(record: QuestionRecord, tokenizer: Any, cfg: MemAgentSettings,
                         seed: int) -> QuestionRecord | None:
    """`record` for `memrl.memagent.final_turn:FinalTurnTask`: its context replaced by `answer_memory` (drawn by
    `seed` and the record's id, so a rerun builds the same), None when it has none."""
    rng = random.Random(derived_seed(seed, record.id))
    memory = answer_memory(record, tokenizer, cfg, rng)
    if memory is None:
        return None
    return QuestionRecord(record.id, record.question, list(record.answers), memory,
                          {**record.metadata, "memory_of": "answer_memory"})
