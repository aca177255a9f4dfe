"""Demonstrations of the synthetic memory task (memrl.data.synthetic) for the supervised warm start: the
memory/answer turns a reader that keeps the answer fact would write, built with MemAgent's own prompts
and chunks (so they are MemAgent's, and live here rather than in the data module)."""

from __future__ import annotations

import random
from typing import Any

from memrl.data.records import QuestionRecord
from memrl.data.synthetic import ATTRIBUTES, FACT_TOKENS, UNKNOWN, SyntheticTaskError, answer_text, fact_text
from memrl.memagent.prompts import encode_text, text_budget
from memrl.memagent.rollout import document_chunks


def demonstration_turns(record: QuestionRecord, tokenizer: Any, builder: Any, task_cfg: Any,
                        keep_prob: float, rng: random.Random,
                        unknown_answer: str = "guess") -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) of every turn of one demonstrated trajectory, built with the rollout's own
    `PromptBuilder` and chunks (`task_cfg`: the config's `task` section), so the warm start sees exactly the
    loop's prompts. At the answer chunk the memory keeps the answer fact with probability `keep_prob`, else
    stays "unknown". With no value in memory the answer is a random value of the attribute
    (`unknown_answer: guess`, right 1 time in 6) or "unknown" (`abstain`, never right).
    """
    if unknown_answer not in ("guess", "abstain"):
        raise SyntheticTaskError(f"unknown_answer must be 'guess' or 'abstain', got {unknown_answer!r}")
    meta = record.metadata
    per_chunk = meta["facts_per_chunk"]
    chunks = document_chunks(tokenizer, task_cfg, record.context)
    if task_cfg.chunk_tokens != FACT_TOKENS * per_chunk or chunks.truncated:
        raise SyntheticTaskError(f"task.chunk_tokens must be {FACT_TOKENS * per_chunk} and task.max_chunks "
                                 f">= {meta['num_chunks']} for record {record.id} (whole facts per chunk)")
    eos = tokenizer.eos_token_id
    facts = [tuple(f) for f in meta["facts"]]
    turns: list[tuple[list[int], list[int]]] = []
    memory_fact: tuple[str, str, str] | None = None
    memory_ids: list[int] | None = None
    for i, chunk_ids in enumerate(chunks.chunks):
        chunk_facts = facts[i * per_chunk:(i + 1) * per_chunk]
        if encode_text(tokenizer, " ".join(fact_text(*f) for f in chunk_facts)) != chunk_ids:
            raise SyntheticTaskError(f"record {record.id}: chunk {i} does not tokenize to whole facts; "
                                     "use task_tokenizer()")
        if i == meta["answer_chunk"] and rng.random() < keep_prob:
            memory_fact = facts[meta["answer_index"]]
        # The memory always restates the question's key and ends with the value or "unknown": the
        # decision sits at the value position, where the whole key is in context (a lookup a small
        # model learns far faster than deciding at the first token whether to write anything).
        fact = memory_fact or (meta["attribute"], meta["entity"], UNKNOWN)
        text = fact_text(*fact)
        prompt = builder.memory_prompt_ids(record.question, memory_ids, chunk_ids)
        response = encode_text(tokenizer, text)[: text_budget(task_cfg.memory_tokens)] + [eos]
        turns.append((prompt, response))
        memory_ids, _ = builder.cap_memory(response)
    if memory_fact:
        value = memory_fact[2]
    else:
        value = rng.choice(ATTRIBUTES[meta["attribute"]]) if unknown_answer == "guess" else UNKNOWN
    final = encode_text(tokenizer, answer_text(value))
    final_prompt = builder.final_prompt_ids(record.question, memory_ids)
    turns.append((final_prompt, final[: text_budget(task_cfg.final_tokens)] + [eos]))
    return turns
