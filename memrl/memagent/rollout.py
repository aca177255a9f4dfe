"""The MemAgent memory loop (docs/design.md §1): one coroutine per trajectory, token ids end to end.

    chunk_context(document) -> for each chunk i: prompt(question, memory_{i-1}, chunk_i) -> memory_i
                            -> final prompt(question, memory_final) -> answer in \\boxed{}

Why one coroutine per trajectory: trajectories never wait for each other (no lockstep across a batch,
docs/design.md, pitfall "Lockstep turns"); the engine batches whatever requests are waiting at the moment.
Each turn stores exactly what was sampled (prompt ids, response ids, log-probs); the memory passed on is
the response's token ids, stop tokens stripped and re-cut to `memory_tokens`, never re-tokenized text.
A generation error marks the trajectory `failed` with its message; it never kills the batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm.auto import tqdm

from memrl.config import Config, RolloutConfig
from memrl.engines.base import Engine, GenerationRequest, GenerationResult
from memrl.memagent.chunking import Chunks, chunk_context, tokenize_document
from memrl.memagent.prompts import PromptBuilder, input_text
from memrl.types import RolloutOutput, Trajectory, Turn


class QuestionLike(Protocol):
    id: str
    question: str
    answers: list[str]
    context: str


def request_seed(base_seed: int, *parts: Any) -> int:
    """A stable per-request seed: the same (question, sample, turn) samples the same way on every run."""
    digest = hashlib.sha256(":".join(str(p) for p in (base_seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class RolloutContext:
    """Everything a generate function needs besides the questions."""

    engine: Engine
    tokenizer: Any
    config: Config
    rollout_id: int = 0
    reward_function: Callable[[Trajectory, list[str]], float] | None = None
    progress: bool = True
    # Position of this batch's first question in the step's whole batch: a rollout worker that serves a
    # slice keeps the group ids and seeds the whole batch would have in one process.
    slot_offset: int = 0
    builder: PromptBuilder = field(init=False)

    def __post_init__(self) -> None:
        self.builder = PromptBuilder(self.tokenizer, self.config.rollout)


async def _generate_one(engine: Engine, request: GenerationRequest) -> GenerationResult:
    try:
        (result,) = await engine.generate([request])
    except Exception as e:  # an engine should report errors as results; never let one kill the batch
        return GenerationResult.failed(f"{type(e).__name__}: {e}")
    return result


def _turn(index: int, kind: str, prompt_ids: list[int], result: GenerationResult, max_tokens: int) -> Turn:
    return Turn(
        index=index, kind=kind, prompt_ids=prompt_ids, response_ids=list(result.output_ids),
        rollout_log_probs=list(result.log_probs), loss_mask=[1] * len(result.output_ids),
        finish_reason=result.finish_reason, max_tokens=max_tokens,
    )


async def run_trajectory(
    engine: Engine,
    builder: PromptBuilder,
    cfg: RolloutConfig,
    question: str,
    chunks: Chunks,
    *,
    trajectory_id: str,
    group_id: str,
    sample_index: int,
    seed_key: str,
) -> Trajectory:
    """Read `chunks` turn by turn into a bounded memory, then answer from question + memory alone."""
    stop_ids = builder.stop_token_ids
    turns: list[Turn] = []
    memory_ids: list[int] | None = None  # None = the fixed "no memory yet" text
    memory_lengths: list[int] = []
    memory_truncations = 0
    traj = Trajectory(trajectory_id=trajectory_id, group_id=group_id, sample_index=sample_index, turns=turns,
                      metadata={"chunks": chunks.to_metadata(), "answer_extractor": cfg.answer_extractor})

    def fail(message: str) -> Trajectory:
        traj.status, traj.error = "failed", message
        traj.metadata.update(memory_lengths=memory_lengths, memory_truncations=memory_truncations)
        return traj

    def ask(prompt: list[int], max_tokens: int, turn: int) -> Awaitable[GenerationResult]:
        seed = request_seed(cfg.seed, seed_key, sample_index, turn)  # same (question, sample, turn): same draw
        return _generate_one(engine, GenerationRequest(prompt, max_tokens, cfg.temperature, cfg.top_p, stop_ids,
                                                       seed=seed))

    for i, chunk in enumerate(chunks.chunks):
        prompt = builder.memory_prompt_ids(question, memory_ids, chunk)
        result = await ask(prompt, cfg.memory_tokens, i)
        if result.finish_reason == "error" or not result.output_ids:
            return fail(f"memory turn {i}: {result.error or 'engine returned no tokens'}")
        turns.append(_turn(i, "memory", prompt, result, cfg.memory_tokens))
        # The new memory always replaces the old one, even when empty; re-cut to memory_tokens.
        memory_ids, recut = builder.cap_memory(result.output_ids)
        memory_truncations += int(recut or result.finish_reason == "length")
        memory_lengths.append(len(memory_ids))
    del chunks  # release the document before the final turn: it sees question + memory only

    final_index = len(turns)
    prompt = builder.final_prompt_ids(question, memory_ids)
    result = await ask(prompt, cfg.final_tokens, final_index)
    if result.finish_reason == "error" or not result.output_ids:
        return fail(f"final turn: {result.error or 'engine returned no tokens'}")
    turns.append(_turn(final_index, "final", prompt, result, cfg.final_tokens))
    answer_ids = [t for t in result.output_ids if t not in stop_ids]
    traj.answer = builder.tokenizer.decode(answer_ids, skip_special_tokens=True)
    traj.status = "complete" if result.finish_reason == "stop" else "truncated"
    traj.metadata.update(memory_lengths=memory_lengths, memory_truncations=memory_truncations,
                         final_memory_length=len(memory_ids or []))
    return traj


def document_chunks(tokenizer: Any, cfg: RolloutConfig, context: str) -> Chunks:
    """Tokenize a document once and cut it into the chunks every sample of the group reads."""
    ids = tokenize_document(tokenizer, input_text(cfg, context))
    return chunk_context(ids, cfg.chunk_tokens, cfg.max_chunks, cfg.truncation)


async def generate_group(ctx: RolloutContext, record: QuestionLike, n_samples: int | None = None,
                         on_done: Callable[[Trajectory], None] | None = None, slot: int | None = None) -> list[Trajectory]:
    """`n_samples` independent trajectories of one question: one GRPO group (group id = question + step).

    `slot` (the question's position in the step's batch) keeps group ids and seeds distinct when a batch
    holds the same question twice (a batch that wraps around the end of the data set).
    """
    cfg = ctx.config.rollout
    n = n_samples or cfg.n_samples
    chunks = document_chunks(ctx.tokenizer, cfg, record.context)
    key = f"{ctx.rollout_id}:{record.id}" if slot is None else f"{ctx.rollout_id}:{slot}:{record.id}"
    group_id = f"r{key}"

    async def one(k: int) -> Trajectory:
        traj = await run_trajectory(ctx.engine, ctx.builder, cfg, record.question, chunks,
                                    trajectory_id=f"{group_id}:s{k}", group_id=group_id, sample_index=k,
                                    seed_key=key)
        traj.metadata.update(question_id=record.id, golds=list(record.answers))
        if ctx.reward_function is not None:
            traj.reward = 0.0 if traj.status == "failed" else float(ctx.reward_function(traj, list(record.answers)))
        if on_done is not None:
            on_done(traj)
        return traj

    return list(await asyncio.gather(*(one(k) for k in range(n))))


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Reward, length and truncation statistics of one rollout step (failed trajectories counted apart)."""
    ok = [t for t in trajectories if t.status != "failed"]
    metrics: dict[str, float] = {"trajectories/total": float(len(trajectories)),
                                 "trajectories/failed": float(len(trajectories) - len(ok))}
    if not ok:
        return metrics
    mem = [t for tr in ok for t in tr.turns if t.kind == "memory"]
    fin = [t for tr in ok for t in tr.turns if t.kind == "final"]
    rewards = [t.reward for t in ok if t.reward is not None]
    if rewards:
        metrics["reward/mean"] = sum(rewards) / len(rewards)
    metrics["turns/mean"] = sum(len(t.turns) for t in ok) / len(ok)
    if mem:
        metrics["response_length/memory_mean"] = sum(t.response_length for t in mem) / len(mem)
        metrics["truncation/memory_rate"] = sum(t.metadata.get("memory_truncations", 0) for t in ok) / len(mem)
    if fin:
        metrics["response_length/final_mean"] = sum(t.response_length for t in fin) / len(fin)
        metrics["truncation/final_rate"] = sum(t.status == "truncated" for t in ok) / len(ok)
    metrics["truncation/document_rate"] = sum(bool(t.metadata.get("chunks", {}).get("truncated")) for t in ok) / len(ok)
    metrics["tokens/generated"] = float(sum(t.response_length for tr in ok for t in tr.turns))
    return metrics


async def generate_rollout(ctx: RolloutContext, records: Sequence[QuestionLike]) -> RolloutOutput:
    """The built-in `generate_function`: every group of the step at once, no group waiting for another.

    A group with a failed trajectory is left out of training (GRPO needs the whole group) and reported
    in `dropped`; `train_row_count` is the exact number of rows the kept trajectories expand to.
    """
    start = time.perf_counter()
    bar = tqdm(total=len(records) * ctx.config.rollout.n_samples, desc=f"rollout {ctx.rollout_id}",
               unit="traj", disable=not ctx.progress, leave=False)
    try:
        groups = await asyncio.gather(*(generate_group(ctx, r, on_done=lambda _t: bar.update(), slot=ctx.slot_offset + k)
                                        for k, r in enumerate(records)))
    finally:
        bar.close()
    kept = [t for g in groups if all(t.status != "failed" for t in g) for t in g]
    dropped = [t for g in groups if any(t.status == "failed" for t in g) for t in g]
    metrics = rollout_metrics([t for g in groups for t in g])
    metrics["groups/dropped"] = float(sum(any(t.status == "failed" for t in g) for g in groups))
    metrics["time/generate_s"] = time.perf_counter() - start
    return RolloutOutput(trajectories=kept, metrics=metrics,
                         train_row_count=sum(len(t.turns) for t in kept), dropped=dropped)


def generate_rollout_sync(ctx: RolloutContext, records: Sequence[QuestionLike]) -> RolloutOutput:
    return asyncio.run(generate_rollout(ctx, records))
