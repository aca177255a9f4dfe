"""Dynamic sampling (DAPO; verl `algorithm.filter_groups`; the rules are in docs/algorithms.md): train only on
groups whose *raw* rewards or raw turn rewards differ (a shaped reward would make an all-wrong group look
informative, NeMo-RL #2431), generating further batches until the step has its groups or the cap is reached.
Every batch arrives converted, so the step keeps its kept groups' rows by `group_id` and announces their number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from memrl.rl.advantages import by_group
from memrl.types import RolloutOutput, Trajectory

# Metrics of one generation batch that add up over the batches; every other metric of the step (reward
# mean, lengths) is the first batch's: the same questions and statistics as with filtering off.
ADDITIVE_METRICS = ("trajectories/total", "trajectories/failed", "tokens/generated", "groups/dropped",
                    "time/generate_s", "time/convert_s")


@dataclass(frozen=True)
class GroupFilter:
    """The settings of dynamic sampling for one step."""

    target_groups: int        # train.rollout_batch_size
    max_gen_batches: int      # algorithm.max_num_gen_batches, the first batch included
    min_groups: int = 1       # train.num_optimizer_steps: every optimizer step needs a group
    turn_rewards_teach: bool = True  # algorithm.turn_reward_alpha < 1: the turn term has a weight


def is_informative(group: Sequence[Trajectory], turn_rewards_teach: bool) -> bool:
    """True when the group's raw rewards are not all equal (GRPO gives an equal group advantage 0), or, under
    `algorithm.turn_reward_function` with a weight (`turn_rewards_teach`: alpha < 1), its samples' turn rewards
    differ: the turn term (memrl.rl.shaping) then teaches an all-wrong group which memories held the answer, so
    dropping it would waste that signal. At alpha 1 the term counts for nothing, and such a group would train
    on a zero gradient."""
    rewards = [t.reward for t in group]
    turn_rewards = [t.metadata.get("turn_rewards") for t in group]
    return any(r != rewards[0] for r in rewards) or \
        (turn_rewards_teach and any(r != turn_rewards[0] for r in turn_rewards))


def sample_informative_groups(first: RolloutOutput, generate_more: Callable[[int], RolloutOutput],
                              settings: GroupFilter) -> RolloutOutput:
    """The step's output with dynamic sampling: `first` is the step's own batch, `generate_more(k)` chunk k
    (k = 1, 2, ...). Left-out trajectories go to `dropped` (kept for logs); counts under `dynamic_sampling/`."""
    outs = [first]
    informative: list[list[Trajectory]] = []
    equal: list[list[Trajectory]] = []

    def sort(out: RolloutOutput) -> None:
        for group in by_group(out.trajectories).values():
            (informative if is_informative(group, settings.turn_rewards_teach) else equal).append(group)

    sort(first)
    while len(informative) < settings.target_groups and len(outs) < settings.max_gen_batches:
        out = generate_more(len(outs))
        outs.append(out)
        sort(out)

    kept, surplus = informative[: settings.target_groups], informative[settings.target_groups:]
    topped_up = equal[: max(0, settings.min_groups - len(kept))]
    kept += topped_up
    kept_ids = {id(g) for g in kept}
    left_out = [t for g in informative + equal if id(g) not in kept_ids for t in g]
    trajectories = [t for g in kept for t in g]

    metrics = dict(first.metrics)
    for key in ADDITIVE_METRICS:
        if any(key in o.metrics for o in outs):
            metrics[key] = sum(o.metrics.get(key, 0.0) for o in outs)
    failed_groups = sum(o.metrics.get("groups/dropped", 0.0) for o in outs)
    metrics.update({
        "dynamic_sampling/generation_batches": float(len(outs)),
        "dynamic_sampling/groups_generated": float(len(informative) + len(equal)) + failed_groups,
        "dynamic_sampling/groups_kept": float(len(kept)),
        "dynamic_sampling/groups_filtered_equal_reward": float(len(equal) - len(topped_up)),
        "dynamic_sampling/groups_filtered_failed": failed_groups,
        "dynamic_sampling/groups_filtered_surplus": float(len(surplus)),
        "dynamic_sampling/groups_topped_up": float(len(topped_up)),
        "dynamic_sampling/reached_cap": float(len(informative) < settings.target_groups),
    })
    rows_by_group = by_group(row for o in outs for row in o.rows)
    rows = [row for g in kept for row in rows_by_group.get(g[0].group_id, [])]
    dropped = [t for o in outs for t in o.dropped] + left_out
    kept_trajectories = {t.trajectory_id for t in trajectories}
    return RolloutOutput(
        trajectories=trajectories, metrics=metrics, dropped=dropped, rows=rows,
        train_row_count=None if first.train_row_count is None else len(rows),
        advantages={k: v for o in outs for k, v in o.advantages.items() if k in kept_trajectories},
        turn_advantages={k: v for o in outs for k, v in o.turn_advantages.items() if k[0] in kept_trajectories})

