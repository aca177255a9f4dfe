"""Pure scheduling of a rollout step's rows: optimizer steps, data-parallel ranks, micro-batches.

Invariants (asserted by tests/train/test_actor.py and tests/distributed/test_partition_plan.py):
- every real row lands in exactly one (optimizer step, rank, micro-batch); padding rows have an all-zero
  loss mask and `is_padding=True`; a prompt group stays in one optimizer step;
- every rank of an optimizer step gets the same number of rows (checked, or padded with `pad_to_dp`),
  balanced by token count, and the same number of micro-batches (collectives must match);
- a micro-batch holds at most `micro_batch_tokens` padded tokens (real tokens when packed), except a
  single row longer than the budget, which runs alone;
- with `train.share_prefixes`, rows sharing a prefix (memrl.train.shared_prefix) are dealt to one rank and
  one micro-batch where row counts and the budget allow, and tokens are counted as computed: a shared
  micro-batch holds at most `micro_batch_tokens` of them (each prefix once);
- each row's weight in the loss is computed over the whole step (`compute_token_weights`), so any
  micro-batching or rank split gives the same gradient as one full batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from memrl.config import Config
from memrl.errors import MemrlError
from memrl.rl.advantages import by_group
from memrl.rl.loss import compute_token_weights
from memrl.rl.validate import validate_train_rows
from memrl.task import load_task
from memrl.train.shared_prefix import computed_tokens, prefix_clusters
from memrl.types import TrainRow


class PartitionError(ValueError, MemrlError):
    """Rows that cannot be split as configured; the message names the numbers to change."""


def padding_row(pad_token_id: int, rollout_id: int) -> TrainRow:
    return TrainRow(tokens=[pad_token_id, pad_token_id], response_length=1, loss_mask=[0], rollout_log_probs=[0.0],
                    advantage=0.0, group_id="__padding__", trajectory_id="__padding__", turn_index=0,
                    rollout_id=rollout_id, is_padding=True)


def split_optimizer_steps(rows: Sequence[TrainRow], num_steps: int) -> list[list[TrainRow]]:
    """Cut rows into `num_steps` optimizer steps of whole prompt groups, balanced by group count: counted in
    groups, never rows, so longer documents never speed up the LR schedule (docs/design.md pitfalls)."""
    groups = by_group(rows)
    if num_steps > len(groups):
        raise PartitionError(
            f"train.num_optimizer_steps = {num_steps} is more than the {len(groups)} prompt groups of this step; "
            f"lower train.num_optimizer_steps or raise train.rollout_batch_size"
        )
    ordered = list(groups.values())
    bounds = [k * len(ordered) // num_steps for k in range(num_steps + 1)]
    return [[r for g in ordered[lo:hi] for r in g] for lo, hi in itertools.pairwise(bounds)]


@dataclass
class _Unit:
    """Rows dealt together: a cluster sharing its first `shared` tokens (memrl.train.shared_prefix), or one row."""

    rows: list[TrainRow]
    shared: int = 0

    def cost(self, count: int | None = None) -> int:
        """Token positions its first `count` rows (all by default) run: the shared prefix once."""
        return computed_tokens([len(r.tokens) for r in self.rows[:count]], self.shared)


def _units(rows: Sequence[TrainRow], share_min: int | None) -> list[_Unit]:
    """Rows in their order, those sharing a prefix (`share_min` tokens or more) joined at their first one."""
    if share_min is None:
        return [_Unit([r]) for r in rows]
    return [_Unit([rows[i] for i in c.members], c.shared) for c in prefix_clusters(rows, share_min)]


def split_ranks(rows: Sequence[TrainRow], dp_size: int, pad_to_dp: bool, pad_token_id: int,
                rollout_id: int, share_min: int | None = None) -> list[list[TrainRow]]:
    """Deal one optimizer step's rows to `dp_size` ranks: equal row counts, balanced token counts (computed
    ones: with `share_min`, rows sharing a prefix are dealt together, split only where no rank has room)."""
    rows = list(rows)
    remainder = len(rows) % dp_size
    if remainder:
        if not pad_to_dp:
            up = len(rows) + dp_size - remainder
            raise PartitionError(
                f"{len(rows)} rows in an optimizer step do not divide by train.dp_size = {dp_size}; set "
                f"train.pad_to_dp=true to add {dp_size - remainder} all-zero-loss padding rows (to {up}), or change "
                f"train.dp_size, sampling.n_samples or train.rollout_batch_size so the row count divides"
            )
        rows += [padding_row(pad_token_id, rollout_id) for _ in range(dp_size - remainder)]
    per_rank = len(rows) // dp_size
    # Largest-first greedy onto the least-loaded rank that has room for the whole unit (ties: the lowest
    # rank); a unit no rank has room for fills the roomiest rank and deals its remaining rows on.
    loads = [0] * dp_size
    ranks: list[list[TrainRow]] = [[] for _ in range(dp_size)]
    for unit in sorted(_units(rows, share_min), key=lambda u: u.cost(), reverse=True):
        while unit.rows:
            room = {k: per_rank - len(ranks[k]) for k in range(dp_size) if len(ranks[k]) < per_rank}
            whole = [k for k in room if room[k] >= len(unit.rows)]
            rank = (min(whole, key=lambda k: (loads[k], k)) if whole
                    else min(room, key=lambda k: (-room[k], loads[k], k)))
            take = min(room[rank], len(unit.rows))
            ranks[rank] += unit.rows[:take]
            loads[rank] += unit.cost(take)
            unit = _Unit(unit.rows[take:], unit.shared)
    return ranks


def micro_batches(rows: Sequence[TrainRow], micro_batch_tokens: int, packed: bool = False,
                  share_min: int | None = None) -> list[list[TrainRow]]:
    """Length-sorted micro-batches whose padded size (rows x longest row), or with `packed` their total
    length (rows concatenated, `train.packing`), stays within the budget. With `share_min`
    (`train.share_prefixes`) rows sharing a prefix stay in one micro-batch unless they alone exceed the
    budget, and a micro-batch holding such rows counts the tokens it computes (each prefix once)."""
    def size(parts: list[_Unit]) -> int:
        if any(len(u.rows) > 1 and u.shared for u in parts):  # the shared layout: one sequence
            return sum(u.cost() for u in parts)
        lengths = [len(r.tokens) for u in parts for r in u.rows]
        return sum(lengths) if packed else len(lengths) * max(lengths)

    batches: list[list[TrainRow]] = []
    current: list[_Unit] = []
    for unit in sorted(_units(rows, share_min), key=lambda u: max(len(r.tokens) for r in u.rows)):
        while unit.rows:
            if current and size([*current, unit]) > micro_batch_tokens:
                batches.append([r for u in current for r in u.rows])
                current = []
            # Alone, a unit over the budget is cut: its longest head that fits (at least one row).
            take = len(unit.rows) if current else max(
                [k for k in range(1, len(unit.rows) + 1) if size([_Unit(unit.rows[:k], unit.shared)]) <=
                 micro_batch_tokens] or [1])
            current.append(_Unit(unit.rows[:take], unit.shared))
            unit = _Unit(unit.rows[take:], unit.shared)
    if current:
        batches.append([r for u in current for r in u.rows])
    return batches


def equalize_micro_batch_counts(per_rank: list[list[list[TrainRow]]], pad_token_id: int,
                                rollout_id: int) -> list[list[list[TrainRow]]]:
    """Give every rank the same number of micro-batches (collectives must match), padding with empty work."""
    most = max((len(b) for b in per_rank), default=0)
    return [b + [[padding_row(pad_token_id, rollout_id)] for _ in range(most - len(b))] for b in per_rank]


@dataclass
class RankShare:
    """One rank's work in one optimizer step: its micro-batches and each row's weight in the whole step
    (`weights[k][i]` belongs to `micro_batches[k][i]`; padding rows weigh 0)."""

    micro_batches: list[list[TrainRow]]
    weights: list[list[float]]


def loss_scale_factor(config: Config) -> float:
    """L of seq_mean_token_sum_norm: `algorithm.loss_scale_factor`, else the longest response-token limit
    (a constant of the run, as Dr. GRPO's normaliser must be)."""
    algorithm = config.algorithm
    if algorithm.loss_scale_factor is not None:
        return float(algorithm.loss_scale_factor)
    return float(load_task(config).max_response_tokens(config))


def plan_optimizer_step(rows: Sequence[TrainRow], config: Config, pad_token_id: int,
                        rollout_id: int) -> list[RankShare]:
    t, a = config.train, config.algorithm
    share_min = t.share_prefix_min_tokens if t.share_prefixes else None
    ranks = split_ranks(rows, t.dp_size, t.pad_to_dp, pad_token_id, rollout_id, share_min)
    all_rows = [r for rank in ranks for r in rank]
    # Every real row counts in the step's row and trajectory counts, a fully masked one too (verl's training
    # path divides by its global batch size); padding rows do not (docs/algorithms.md).
    weights = dict(zip(map(id, all_rows), compute_token_weights(
        [sum(r.loss_mask) for r in all_rows], [r.trajectory_id for r in all_rows], a.loss_agg,
        loss_scale_factor(config), counted=[not r.is_padding for r in all_rows]), strict=True))
    batches = equalize_micro_batch_counts([micro_batches(rank, t.micro_batch_tokens, t.packing, share_min)
                                           for rank in ranks], pad_token_id, rollout_id)
    return [RankShare(rank, [[weights.get(id(r), 0.0) for r in mb] for mb in rank]) for rank in batches]


def plan_rollout(rows: Sequence[TrainRow], config: Config, pad_token_id: int, rollout_id: int,
                 vocab_size: int | None = None) -> list[list[RankShare]]:
    """`[optimizer step][rank] -> RankShare` for one rollout step's rows, validated first (token ids against
    the model's `vocab_size`): whoever trains rows plans them here. Rows are taken in `group_id` order (a
    stable sort), so the plan does not depend on how the batch was cut across rollout workers."""
    validate_train_rows(rows, vocab_size)
    rows = sorted(rows, key=lambda r: r.group_id)
    return [plan_optimizer_step(step, config, pad_token_id, rollout_id)
            for step in split_optimizer_steps(rows, config.train.num_optimizer_steps)]
