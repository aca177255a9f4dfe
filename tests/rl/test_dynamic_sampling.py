"""Dynamic sampling (memrl/rl/dynamic_sampling.py) on scripted rollouts: which groups are kept, the row
count, the metrics, and the deterministic extra draws."""

from __future__ import annotations

from dataclasses import dataclass

from traj_factory import make_group

from memrl.rl.dynamic_sampling import GroupFilter, sample_informative_groups
from memrl.rollout import finish_rollout
from memrl.train.setup import DataSource


@dataclass
class Ref:
    group_id: str
    index: int


def converted(out, rows_each=None):
    """`out` as every rollout source hands it over: converted (a row reference per turn, or `rows_each` per
    trajectory), with the advantages the logs show."""
    out.rows = [Ref(t.group_id, k) for t in out.trajectories for k in range(rows_each or t.num_turns)]
    out.train_row_count = len(out.rows)
    out.advantages = {t.trajectory_id: 1.0 for t in out.trajectories}
    out.turn_advantages = {(t.trajectory_id, turn.index): 0.5 for t in out.trajectories for turn in t.turns}
    return out


def rollout(name, group_rewards, num_memory_turns=1, rows_each=None):
    """One generation batch, converted: a group per reward list, ids `<name>g<k>`."""
    groups = [make_group(f"{name}g{k}", rewards, num_memory_turns) for k, rewards in enumerate(group_rewards)]
    return converted(finish_rollout(groups), rows_each)


def scripted(chunks):
    calls = []

    def generate_more(k):
        calls.append(k)
        return chunks[k - 1]
    return generate_more, calls


def test_equal_groups_are_replaced_by_further_chunks_until_the_target():
    first = rollout("a", [[0, 0], [0, 1], [1, 1], [1, 0]])          # 2 informative of 4
    more, calls = scripted([rollout("b", [[0, 0], [1, 0]]),          # +1
                            rollout("c", [[1, 0], [0, 1], [0, 0]])])  # +2: one more than needed
    out = sample_informative_groups(first, more, GroupFilter(target_groups=4, max_gen_batches=5))
    assert calls == [1, 2]
    assert [g for g in dict.fromkeys(t.group_id for t in out.trajectories)] == ["ag1", "ag3", "bg1", "cg0"]
    assert out.train_row_count == 4 * 2 * 2  # 4 groups x 2 samples x (1 memory turn + final)
    m = out.metrics
    assert m["dynamic_sampling/generation_batches"] == 3
    assert m["dynamic_sampling/groups_generated"] == 9
    assert m["dynamic_sampling/groups_kept"] == 4
    assert m["dynamic_sampling/groups_filtered_equal_reward"] == 4
    assert m["dynamic_sampling/groups_filtered_surplus"] == 1
    assert m["dynamic_sampling/reached_cap"] == 0
    assert m["trajectories/total"] == 18  # summed over the batches
    assert m["reward/mean"] == first.metrics["reward/mean"]  # the step's own batch, as with filtering off
    assert {t.group_id for t in out.dropped} == {"ag0", "ag2", "bg0", "cg1", "cg2"}


def test_the_cap_trains_on_what_there_is_and_tops_up_an_empty_step():
    first = rollout("a", [[0, 0], [1, 1]])
    more, calls = scripted([rollout("b", [[0, 0], [0, 1]]), rollout("c", [[0, 1]])])
    out = sample_informative_groups(first, more, GroupFilter(target_groups=2, max_gen_batches=2))
    assert calls == [1]  # the cap counts the first batch
    assert {t.group_id for t in out.trajectories} == {"bg1"}
    assert out.metrics["dynamic_sampling/reached_cap"] == 1
    # nothing informative at all: equal groups fill the optimizer steps (advantage 0, KL only)
    out = sample_informative_groups(rollout("a", [[0, 0], [1, 1], [0, 0]]), scripted([])[0],
                                    GroupFilter(target_groups=3, max_gen_batches=1, min_groups=2))
    assert [g for g in dict.fromkeys(t.group_id for t in out.trajectories)] == ["ag0", "ag1"]
    assert out.metrics["dynamic_sampling/groups_topped_up"] == 2
    assert out.metrics["dynamic_sampling/groups_filtered_equal_reward"] == 1


def test_filtering_reads_the_raw_reward_and_failed_groups_count_apart():
    groups = [make_group("x", [0.5, 0.5]), make_group("y", [0.0, 0.5])]
    groups[1][0].status = "failed"  # the failed group is dropped by finish_rollout before filtering
    out = sample_informative_groups(converted(finish_rollout(groups)), scripted([])[0], GroupFilter(1, 1))
    assert out.metrics["dynamic_sampling/groups_filtered_failed"] == 1
    assert out.metrics["dynamic_sampling/groups_generated"] == 2
    assert out.metrics["dynamic_sampling/groups_topped_up"] == 1  # x is equal: kept only to fill the step


def test_a_task_expanding_otherwise_than_one_row_per_turn_keeps_its_groups_rows():
    # The rows arrive with every batch, so the kept groups' rows are counted, not derived from their turns.
    more, _ = scripted([rollout("b", [[1, 0]], rows_each=3)])
    out = sample_informative_groups(rollout("a", [[0, 0], [0, 1]], rows_each=3), more, GroupFilter(2, 2))
    assert [r.group_id for r in out.rows] == ["ag1"] * 6 + ["bg0"] * 6 and out.train_row_count == 12


def test_extra_chunks_are_a_pure_function_of_rollout_and_chunk():
    data = DataSource(list(range(10)), batch_size=3, seed=7)
    main = [data.batch(r) for r in range(4)]
    a = data.extra_batch(2, 1, 12)
    assert a == DataSource(list(range(10)), batch_size=3, seed=7).extra_batch(2, 1, 12)  # a fresh run agrees
    assert len(a) == 12 and sorted(a[:10]) == list(range(10))  # a shuffle, wrapping past the set
    assert a != data.extra_batch(2, 2, 12) and a != data.extra_batch(3, 1, 12)
    assert [data.batch(r) for r in range(4)] == main  # the main cursor never moves


def test_the_kept_groups_keep_their_rows_and_logged_advantages():
    # Every source converts where it generates: the rows (references on Ray) arrive with the batches, and the
    # step keeps exactly the rows of the groups it keeps, group by group in the kept order.
    more, _ = scripted([rollout("b", [[1, 0], [1, 1]])])
    out = sample_informative_groups(rollout("a", [[0, 0], [0, 1]]), more,
                                    GroupFilter(target_groups=2, max_gen_batches=3))
    assert [r.group_id for r in out.rows] == ["ag1"] * 4 + ["bg0"] * 4
    assert len(out.rows) == out.train_row_count
    # the logs' advantages travel with the kept trajectories only (the left-out ones are logged as untrained)
    kept = {t.trajectory_id for t in out.trajectories}
    assert set(out.advantages) == kept and {tid for tid, _ in out.turn_advantages} == kept


def test_an_equal_reward_group_whose_turn_rewards_differ_is_kept():
    """Under algorithm.turn_reward_function an all-wrong group still teaches which memory held the answer
    (memrl.rl.shaping's turn term is non-zero), so only a group equal in both is filtered."""
    first = rollout("a", [[0, 0], [0, 0]])
    for k, group_turns in enumerate([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]]):
        for traj, turns in zip([t for t in first.trajectories if t.group_id == f"ag{k}"], group_turns, strict=True):
            traj.metadata["turn_rewards"] = turns
    more, calls = scripted([rollout("b", [[0, 0]])])
    out = sample_informative_groups(first, more, GroupFilter(target_groups=2, max_gen_batches=2))
    assert calls == [1]
    assert [g for g in dict.fromkeys(t.group_id for t in out.trajectories)] == ["ag0"]
    assert out.metrics["dynamic_sampling/groups_filtered_equal_reward"] == 2
    assert out.metrics["dynamic_sampling/groups_topped_up"] == 0
    # At algorithm.turn_reward_alpha 1 the turn term has no weight: ag0 would train on a zero gradient.
    more, calls = scripted([rollout("b", [[0, 0]])])
    out = sample_informative_groups(first, more, GroupFilter(target_groups=2, max_gen_batches=2,
                                                             turn_rewards_teach=False))
    assert calls == [1]
    assert out.metrics["dynamic_sampling/groups_topped_up"] == 1
    assert out.metrics["dynamic_sampling/groups_filtered_equal_reward"] == 2
