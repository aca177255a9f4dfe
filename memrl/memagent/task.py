"""MemAgent as a Task (memrl/task.py; the default `plugins.task`): the memory loop of
memrl.memagent.rollout, its converter (one row per turn, docs/design.md §3), the framework's answer reward,
the gold-recall curve of its memory turns, and its chunk and memory fields in the logs and in `memrl view`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from memrl.config import AlgorithmConfig
from memrl.memagent.prompts import PromptBuilder
from memrl.memagent.reward import gold_in_text
from memrl.memagent.rollout import generate_group, rollout_metrics
from memrl.memagent.settings import MemAgentSettings
from memrl.rl.shaping import advantage_rows
from memrl.rl.validate import TrajectoryError
from memrl.rollout import GroupSlot, RolloutContext, finish_rollout
from memrl.task import Phase, Task
from memrl.types import RolloutOutput, TrainRow, Trajectory
from memrl.viewer.fields import check_kinds, is_int, short_value

# The fields of `log_fields` the viewer shows, by kind (memrl.viewer.fields).
VIEW_KINDS = {"num_chunks": "count", "memory_truncations": "count", "document_tokens": "count",
              "document_truncated": "bool", "chunk_golds": "list"}


def _is_hit(hit: Any, num_golds: int) -> bool:
    """One `[gold index, occurrences, excerpt, start, end]` of `chunk_gold_hits` (memagent/rollout.py)."""
    if not (isinstance(hit, list) and len(hit) == 5 and isinstance(hit[2], str)
            and all(is_int(hit[k]) for k in (0, 1, 3, 4))):
        return False
    g, count, excerpt, start, end = hit
    return 0 <= g < num_golds and count >= 1 and 0 <= start <= end <= len(excerpt)


def check_group_turns(trajectories: Sequence[Trajectory]) -> None:
    """The samples of one question read the same chunks, so those the task did not stop (`keep_reading`) take
    equal turn counts; another count is a rollout bug (rule `group_turn_count`)."""
    first: dict[str, Trajectory] = {}
    for traj in trajectories:
        other = first.setdefault(traj.group_id, traj) if not traj.metadata.get("stopped_reading") else traj
        if other.num_turns != traj.num_turns:
            raise TrajectoryError(traj.trajectory_id, None, "group_turn_count",
                                  f"{traj.num_turns} turns, but trajectory '{other.trajectory_id}' of the same group "
                                  f"'{traj.group_id}' has {other.num_turns}; samples of one question read the same "
                                  "chunks and, unless the task stops reading, take equal turn counts")


def convert_trajectories(trajectories: Sequence[Trajectory], algorithm_cfg: AlgorithmConfig,
                         rollout_id: int) -> list[TrainRow]:
    """One row per turn with its `algorithm.credit` share of the trajectory's advantage."""
    check_group_turns(trajectories)
    return advantage_rows(trajectories, algorithm_cfg, rollout_id, algorithm_cfg.credit)


class MemAgentTask(Task):
    Settings = MemAgentSettings

    def max_rows_per_trajectory(self, cfg: Any) -> int:
        """Up to max_chunks memory turns + 1 final turn, one row each."""
        return cfg.task.max_chunks + 1

    def max_response_tokens(self, cfg: Any) -> int:
        return max(cfg.task.memory_tokens, cfg.task.final_tokens)

    def validate_config(self, cfg: Any) -> None:
        """Settings the MemAgent rollout cannot train with (raised at config load, naming what to change)."""
        factor, needed = cfg.queue.train_sample_expansion_factor, self.max_rows_per_trajectory(cfg)
        if factor is not None and factor < needed:
            raise ValueError(f"queue.train_sample_expansion_factor = {factor} is below task.max_chunks + 1 = "
                             f"{needed}, the most rows one MemAgent trajectory expands to; set it to at least "
                             f"{needed} (or leave it unset: it then follows max_chunks)")

    def stop_token_ids(self, tokenizer: Any, cfg: Any) -> list[int]:
        return PromptBuilder(tokenizer, cfg.task).stop_token_ids

    async def keep_reading(self, ctx: RolloutContext, group: GroupSlot, traj: Trajectory) -> bool:
        """Whether sample `traj` (its memory turns so far, the last one just written) reads the next chunk; the
        seam of readers that stop early (it may sample turns of its own: `ctx.sample_turn`). False: the
        trajectory records `stopped_reading` and the final turn comes next, unless this call sampled it (its
        last turn is `final`) or the trajectory failed. Default: read every chunk."""
        return True

    async def sample_group(self, ctx: RolloutContext, group: GroupSlot, n: int,
                           on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        return await generate_group(ctx, group, n, on_done, task=self)

    async def generate(self, ctx: RolloutContext, records: Sequence[Any]) -> RolloutOutput:
        """Every group of the step at once, no group waiting for another; `train_row_count` is the exact
        number of rows the kept trajectories expand to (one per turn)."""
        start = time.perf_counter()
        n = ctx.config.sampling.n_samples
        with tqdm(total=len(records) * n, desc=f"rollout {ctx.rollout_id}", unit="traj",
                  disable=not ctx.progress, leave=False) as bar:
            groups = await asyncio.gather(*(self.sample_group(ctx, g, n, on_done=lambda _t: bar.update())
                                            for g in ctx.groups(records)))
        metrics = rollout_metrics([t for g in groups for t in g])
        metrics["time/generate_s"] = time.perf_counter() - start
        return finish_rollout(groups, metrics)

    def convert(self, trajectories: Sequence[Trajectory], algorithm: Any, rollout_id: int) -> list[TrainRow]:
        return convert_trajectories(trajectories, algorithm, rollout_id)

    def turn_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """`memory/gold_recall/turn_{j}`: the share of trajectories whose j-th memory turn holds a gold
        answer (`gold_in_text`), and its mean over memory turns; trajectories without golds give none."""
        hits: dict[int, list[float]] = {}
        for traj in trajectories:
            golds = list(traj.metadata.get("golds") or [])
            if not golds:
                continue
            texts = [text for turn, text in zip(traj.turns, traj.metadata["turn_texts"], strict=True)
                     if turn.kind == "memory"]  # a task's other turns (a reader's probes) are no memory
            for j, text in enumerate(texts):
                hits.setdefault(j, []).append(float(gold_in_text(text, golds)))
        metrics = {f"memory/gold_recall/turn_{j}": sum(v) / len(v) for j, v in sorted(hits.items())}
        if hits:
            metrics["memory/gold_recall/mean"] = sum(metrics.values()) / len(metrics)
        return metrics

    def log_fields(self, traj: Trajectory | None, phase: Phase) -> dict[str, Any]:
        """The document (chunks, tokens, truncation) and where the golds occur in each chunk; an eval line
        also keeps the memory lengths and truncations."""
        meta = traj.metadata if traj is not None else {}
        chunks = meta.get("chunks", {})
        fields = {"num_chunks": chunks.get("num_chunks"), "document_tokens": chunks.get("total_tokens"),
                  "document_truncated": chunks.get("truncated"), "chunk_golds": meta.get("chunk_golds")}
        if phase == "eval":
            fields.update(memory_lengths=meta.get("memory_lengths", []),
                          memory_truncations=meta.get("memory_truncations", 0))
        return fields

    def view_fields(self, record: dict[str, Any], turns: list[dict[str, Any]]) -> dict[str, Any]:
        """The page's chunk count (`nc`), truncated memory turns (`mt`), document truncation and tokens
        (`dt`, `dtok`) and each chunk's gold hits (`cg`). A rollout record keeps no memory truncation count
        or chunk count: both are read off its memory turns."""
        check_kinds(record, VIEW_KINDS)
        golds = record.get("golds") or []
        for c, hits in enumerate(record.get("chunk_golds") or []):
            if not isinstance(hits, list) or not all(_is_hit(h, len(golds)) for h in hits):
                raise ValueError(f"chunk_golds[{c}] is {short_value(hits)}, expected a list of [gold index, count, "
                                 f"excerpt, start, end]")
        memory = [t for t in turns if t.get("kind") == "memory"]
        truncations, chunks = record.get("memory_truncations"), record.get("num_chunks")
        if truncations is None:
            truncations = sum(t.get("finish_reason") == "length" for t in memory)
        return {"nc": chunks if chunks is not None else len(memory), "mt": int(truncations),
                "dt": bool(record.get("document_truncated")), "dtok": record.get("document_tokens"),
                "cg": record.get("chunk_golds")}
