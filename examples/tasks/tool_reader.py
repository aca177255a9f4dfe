"""A reader that searches instead of reading every chunk: the model writes a search query, BM25 (bm25s)
finds the document's best passages, they join the conversation as a user message, and the model answers
(or searches again, up to `task.max_searches`). A task in one file, named by `plugins.task`
(docs/custom-tasks.md); the framework is unchanged by it.

One masked row per trajectory, not one row per call: the whole exchange is one `final` turn that
`ctx.extend_turn` grows, the passages spliced in as tokens the policy did not sample (loss mask 0). So the
trainer scores every query and the answer in the very context they were sampled in (no prompt rebuilt,
nothing re-tokenized), forwards the shared start of the conversation once instead of once per call, and the
framework's 1:1 converter, reward and views serve it as they are. One row per call would suit calls that
need their own reward or credit; this task rewards only the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from memrl.config import TaskSettings
from memrl.data.records import require_module
from memrl.rollout import GroupSlot, RolloutContext
from memrl.scoring import extract_boxed
from memrl.task import Task
from memrl.types import Trajectory

PROMPT = ("Answer the question from a document you cannot see. Write a short search query and end your "
          "message: the passages it finds come back to you. Then put your answer in \\boxed{{}}, or search "
          "again.\n\nQuestion: {question}")
RESULTS = "Passages found for your query:\n\n{passages}"
PLACEHOLDER = "\x00query\x00"  # stands for the sampled query while the template renders the results message


class ToolReaderSettings(TaskSettings):
    passage_tokens: int = Field(128, gt=0, description="Tokens of each passage the document is split into.")
    top_k: int = Field(2, gt=0, description="Passages one search returns.")
    max_searches: int = Field(1, ge=1, description="Searches before the answer must come.")


class ToolReaderTask(Task):
    Settings = ToolReaderSettings

    def max_response_tokens(self, cfg: Any) -> int:
        """Trained tokens of one row: each query and the answer (the passages are not trained)."""
        return (cfg.task.max_searches + 1) * cfg.task.final_tokens

    def chat(self, ctx: RolloutContext, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False,
                                                 enable_thinking=ctx.config.task.enable_thinking, **kwargs)

    def passages(self, ctx: RolloutContext, group: GroupSlot) -> tuple[list[str], Any]:
        """The record's document in `passage_tokens` pieces and their BM25 index, built once per group."""
        if group.key not in ctx.scratch:
            bm25s = require_module("bm25s", "the tool reader's search", "examples")
            ids = ctx.tokenizer.encode(group.record.context, add_special_tokens=False)
            size = ctx.config.task.passage_tokens
            texts = [ctx.tokenizer.decode(ids[i:i + size]) for i in range(0, len(ids), size)] or [""]
            index = bm25s.BM25()
            index.index(bm25s.tokenize(texts, show_progress=False), show_progress=False)
            ctx.scratch[group.key] = texts, index
        return ctx.scratch[group.key]

    def search(self, ctx: RolloutContext, group: GroupSlot, query: str) -> list[int]:
        """Indices of the best passages for `query`, best first (document order for a query BM25 cannot use)."""
        bm25s = require_module("bm25s", "the tool reader's search", "examples")
        texts, index = self.passages(ctx, group)
        k = min(ctx.config.task.top_k, len(texts))
        query_tokens = bm25s.tokenize([query], show_progress=False)
        if not any(query_tokens.ids):  # nothing BM25 can match (a query of stopwords or nothing)
            return list(range(k))
        found, _scores = index.retrieve(query_tokens, k=k, show_progress=False)
        return [int(i) for i in found[0]]

    def results_ids(self, ctx: RolloutContext, stop_id: int | None, passages: list[str]) -> list[int]:
        """The passages as the chat template's next user message, then the assistant's turn: the template's
        text after the query's message, less the end-of-message token the query ended on (`stop_id`)."""
        results = RESULTS.format(passages="\n\n".join(passages))
        text = self.chat(ctx, [{"role": "user", "content": "q"}, {"role": "assistant", "content": PLACEHOLDER},
                               {"role": "user", "content": results}], tokenize=False)
        after = text[text.index(PLACEHOLDER) + len(PLACEHOLDER):]
        end = ctx.tokenizer.decode([stop_id]) if stop_id is not None else None
        if end and after.startswith(end):
            after = after[len(end):]
        return ctx.tokenizer.encode(after, add_special_tokens=False)

    async def sample_group(self, ctx: RolloutContext, group: GroupSlot, n: int) -> list[Trajectory]:
        prompt = list(self.chat(ctx, [{"role": "user", "content": PROMPT.format(question=group.record.question)}],
                                tokenize=True))
        return list(await asyncio.gather(*(self.sample(ctx, group, k, prompt) for k in range(n))))

    async def sample(self, ctx: RolloutContext, group: GroupSlot, k: int, prompt: list[int]) -> Trajectory:
        record, task = group.record, ctx.config.task
        traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k, turns=[],
                          metadata={"question_id": record.id, "question": record.question,
                                    "golds": list(record.answers), "searches": []})
        turn = await ctx.sample_turn(group, traj, "final", prompt, task.final_tokens)
        start = 0
        while turn is not None and len(traj.metadata["searches"]) < task.max_searches:
            said = ctx.tokenizer.decode(turn.response_ids[start:], skip_special_tokens=True)
            if extract_boxed(said) is not None:
                break  # answered
            found = self.search(ctx, group, said.strip())
            traj.metadata["searches"].append({"query": said.strip(), "passages": found})
            texts, _index = self.passages(ctx, group)
            stop_id = turn.response_ids[-1] if turn.finish_reason == "stop" else None
            inserted = self.results_ids(ctx, stop_id, [texts[i] for i in found])
            start = turn.response_length + len(inserted)
            turn = await ctx.extend_turn(group, traj, inserted, task.final_tokens)
        traj.reward = ctx.reward(traj, record.answers)
        return traj

    def log_fields(self, traj: Trajectory | None, phase: str) -> dict[str, Any]:
        """Each search's query and the passages it found, kept in the logs and eval lines."""
        return {"searches": (traj.metadata.get("searches", []) if traj is not None else [])}
