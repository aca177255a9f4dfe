"""The MemAgent memory loop (docs/design.md §1): one coroutine per trajectory, token ids end to end.

    chunk_context(document) -> for each chunk i: prompt(question, memory_{i-1}, chunk_i) -> memory_i
                            -> final prompt(question, memory_final) -> answer

Trajectories never wait for each other (pitfall "Lockstep turns"); the engine batches whatever requests
wait. Each turn is `RolloutContext.sample_turn`'s, exactly what was sampled; the memory passed on is the
response's ids, stop tokens stripped and cut to `memory_tokens`. A generation error marks the trajectory
`failed`, never the batch. Before each chunk after the first the task says whether to keep reading
(`MemAgentTask.keep_reading`, default: always); one that stops may have sampled the final turn itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from memrl.memagent.chunking import Chunks, chunk_context, tokenize_document
from memrl.memagent.prompts import PromptBuilder, encode_text, input_text
from memrl.memagent.settings import MemAgentSettings
from memrl.rollout import GroupSlot, RolloutContext
from memrl.scoring import THINK_END, gold_spans
from memrl.task import load_task
from memrl.types import Trajectory


def memory_after_think(tokenizer: Any, memory_ids: list[int]) -> list[int]:
    """The official memory update (`extract_solution`): `response.split("</think>")[-1].strip()`, split on the
    decoded text as the official code does, whether `</think>` was sampled as its one token (Qwen3) or as
    pieces (`</`, `think`, `>`), yet kept in ids: the sampled ids after the token where the text's last
    `</think>` ends, whitespace-only tokens dropped at both ends. Re-encoded text only where a token at
    either end mixes text with whitespace or with the end of `</think>`."""
    text = tokenizer.decode(memory_ids)
    count = text.count(THINK_END)
    if not count:
        return memory_ids
    # The fewest leading ids whose text holds every `</think>`: a prefix decodes to a prefix of the text.
    lo, hi = 1, len(memory_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if tokenizer.decode(memory_ids[:mid]).count(THINK_END) >= count else (mid + 1, hi)
    tail = memory_ids[lo:]
    stripped = text[text.rindex(THINK_END) + len(THINK_END):].strip()
    lo, hi = 0, len(tail)
    while lo < hi and not tokenizer.decode(tail[lo:lo + 1]).strip():
        lo += 1
    while hi > lo and not tokenizer.decode(tail[hi - 1:hi]).strip():
        hi -= 1
    return tail[lo:hi] if tokenizer.decode(tail[lo:hi]) == stripped else encode_text(tokenizer, stripped)


def passed_memory(builder: PromptBuilder, turn: Any) -> tuple[list[int], bool]:
    """The memory a memory turn passes on and whether it was cut: its response re-cut to `memory_tokens`, with
    `memory_after_think` only what follows its last </think> (the turn keeps every sampled id for training)."""
    memory_ids, recut = builder.cap_memory(turn.response_ids)
    if builder.cfg.memory_after_think:
        memory_ids = memory_after_think(builder.tokenizer, memory_ids)
    return memory_ids, recut


async def run_trajectory(ctx: RolloutContext, group: GroupSlot, k: int, chunks: Chunks, task: Any) -> Trajectory:
    """Sample k of `group`: read `chunks` turn by turn into a bounded memory, asking `task.keep_reading` before
    each chunk after the first, then answer from question + memory alone (`ctx.sample_turn`: seeds, stop ids,
    an engine error as a failed trajectory), unless keep_reading stopped with the final turn sampled."""
    cfg, builder, question = ctx.config.task, builder_of(ctx), group.record.question
    memory_ids: list[int] | None = None  # None = the fixed "no memory yet" text
    memory_lengths: list[int] = []
    memory_truncations = 0
    traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k, turns=[],
                      metadata={"chunks": chunks.to_metadata()})

    def memory_metadata() -> Trajectory:
        traj.metadata.update(memory_lengths=memory_lengths, memory_truncations=memory_truncations)
        return traj

    for i, chunk in enumerate(chunks.chunks):
        if i and not await task.keep_reading(ctx, group, traj):
            traj.metadata["stopped_reading"] = True
            if traj.status == "failed" or traj.turns[-1].kind == "final":  # it sampled the answer, or failed
                traj.metadata["final_memory_length"] = len(memory_ids or []) if traj.status != "failed" else None
                return memory_metadata()
            break
        turn = await ctx.sample_turn(group, traj, "memory", builder.memory_prompt_ids(question, memory_ids, chunk),
                                     cfg.memory_tokens)
        if turn is None:
            return memory_metadata()
        memory_ids, recut = passed_memory(builder, turn)  # it always replaces the old one, even when empty
        memory_truncations += int(recut or turn.finish_reason == "length")
        memory_lengths.append(len(memory_ids))
    del chunks  # release the document before the final turn: it sees question + memory only

    turn = await ctx.sample_turn(group, traj, "final", builder.final_prompt_ids(question, memory_ids),
                                 cfg.final_tokens)
    if turn is not None:
        traj.metadata["final_memory_length"] = len(memory_ids or [])
    return memory_metadata()


# Characters of chunk text kept on each side of a gold answer found in it (what `memrl view` shows).
GOLD_EXCERPT_CHARS = 80


def chunk_gold_hits(tokenizer: Any, chunks: Chunks, golds: Sequence[str]) -> list[list[list[Any]]]:
    """Per chunk, one `[gold index, occurrences, excerpt, start, end]` per gold found (`gold_spans`; logs
    keep no chunk text), `start:end` the first occurrence within the excerpt. Once per question, in the
    gold-search thread: ~10 ms of CPU per 4 x 2048-token document (Qwen3), 1.3 s for a step of 128 groups,
    which on the event loop came before the engine's first request."""
    hits = []
    for chunk in chunks.chunks:
        text = tokenizer.decode(chunk, skip_special_tokens=True)
        first: dict[int, tuple[int, int]] = {}
        counts: dict[int, int] = {}
        for g, start, end in gold_spans(text, golds):
            first.setdefault(g, (start, end))
            counts[g] = counts.get(g, 0) + 1
        row = []
        for g, (start, end) in first.items():
            lo, hi = max(0, start - GOLD_EXCERPT_CHARS), end + GOLD_EXCERPT_CHARS
            row.append([g, counts[g], text[lo:hi], start - lo, end - lo])
        hits.append(row)
    return hits


# One thread runs the gold search of every group and eval question: it holds the GIL while it works, and
# one such thread takes far less time from the event loop (and the engine's thread) than a pool would.
_GOLD_SEARCH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memrl-gold-search")


def chunk_gold_hits_later(tokenizer: Any, chunks: Chunks, golds: Sequence[str]) -> asyncio.Future:
    """`chunk_gold_hits` in the gold-search thread, off the event loop; await it where it is recorded."""
    return asyncio.get_running_loop().run_in_executor(_GOLD_SEARCH, chunk_gold_hits, tokenizer, chunks, list(golds))


def document_chunks(tokenizer: Any, cfg: MemAgentSettings, context: str) -> Chunks:
    """Tokenize a document once and cut it into the chunks every sample of the group reads."""
    ids = tokenize_document(tokenizer, input_text(cfg, context))
    return chunk_context(ids, cfg.chunk_tokens, cfg.max_chunks, cfg.truncation)


def builder_of(ctx: RolloutContext) -> PromptBuilder:
    """The context's chat-template prompt builder (stop ids included), built once per context."""
    if "builder" not in ctx.scratch:
        ctx.scratch["builder"] = PromptBuilder(ctx.tokenizer, ctx.config.task)
    return ctx.scratch["builder"]


async def generate_group(ctx: RolloutContext, group: GroupSlot, n: int,
                         on_done: Callable[[Trajectory], None] | None = None, task: Any = None) -> list[Trajectory]:
    """`n` independent trajectories of one question: one GRPO group, named and seeded by `group` (its slot
    keeps group ids and seeds distinct when a batch holds the same question twice). `task` (default: the
    configured one) decides whether each sample keeps reading."""
    record, task = group.record, task if task is not None else load_task(ctx.config)
    chunks = document_chunks(ctx.tokenizer, ctx.config.task, record.context)
    gold_hits = chunk_gold_hits_later(ctx.tokenizer, chunks, record.answers)  # while the group generates

    async def one(k: int) -> Trajectory:
        traj = await run_trajectory(ctx, group, k, chunks, task)
        traj.metadata.update(question_id=record.id, question=record.question, golds=list(record.answers),
                             chunk_golds=await gold_hits)
        traj.reward = ctx.reward(traj, record.answers)
        if on_done is not None:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(k) for k in range(n))))


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """MemAgent's own statistics of a rollout step: memory and answer lengths, truncations (of memory
    turns, answers and documents); the framework adds counts, reward and tokens (`finish_rollout`)."""
    ok = [t for t in trajectories if t.status != "failed"]
    if not ok:
        return {}
    metrics: dict[str, float] = {}
    mem = [t for tr in ok for t in tr.turns if t.kind == "memory"]
    fin = [t for tr in ok for t in tr.turns if t.kind == "final"]
    if mem:
        metrics["response_length/memory_mean"] = sum(t.response_length for t in mem) / len(mem)
        metrics["truncation/memory_rate"] = sum(t.metadata.get("memory_truncations", 0) for t in ok) / len(mem)
    if fin:
        metrics["response_length/final_mean"] = sum(t.response_length for t in fin) / len(fin)
        metrics["truncation/final_rate"] = sum(t.status == "truncated" for t in ok) / len(ok)
    metrics["truncation/document_rate"] = sum(bool(t.metadata.get("chunks", {}).get("truncated")) for t in ok) / len(ok)
    return metrics
