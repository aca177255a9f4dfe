"""Row partitioning across data-parallel ranks (no Ray needed): the invariants every real rank relies on."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.config import Config
from memrl.distributed.workers import merge_rollout_outputs
from memrl.train.partition import plan_rollout, split_ranks
from memrl.types import RolloutOutput, TrainRow, Trajectory


def make_rows(seed, n_groups, per_group):
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        for s in range(per_group):
            for turn in range(rng.randint(1, 4)):
                p, r = rng.randint(2, 30), rng.randint(1, 8)
                rows.append(TrainRow(tokens=[rng.randrange(1, 50) for _ in range(p + r)], response_length=r,
                                     loss_mask=[1] * r, rollout_log_probs=[-1.0] * r, advantage=rng.uniform(-1, 1),
                                     group_id=f"g{g}", trajectory_id=f"g{g}s{s}", turn_index=turn, rollout_id=0))
    return rows


def cfg(**train):
    return Config.model_validate({"train": train})


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(2, 6), per_group=st.integers(1, 4),
       dp=st.integers(1, 4), steps=st.integers(1, 2), budget=st.sampled_from([30, 80, 10_000]),
       agg=st.sampled_from(["token_mean", "seq_mean_token_mean", "trajectory_mean"]))
def test_plan_invariants(seed, n_groups, per_group, dp, steps, budget, agg):
    rows = make_rows(seed, n_groups, per_group)
    config = Config.model_validate({"train": {"dp_size": dp, "pad_to_dp": True, "num_optimizer_steps": steps,
                                              "micro_batch_tokens": budget}, "algorithm": {"loss_agg": agg}})
    plan = plan_rollout(rows, config, pad_token_id=0, rollout_id=0)
    assert len(plan) == steps and all(len(shares) == dp for shares in plan)
    seen = []
    for shares in plan:
        step_rows = [r for share in shares for mb in share.micro_batches for r in mb]
        real = [r for r in step_rows if not r.is_padding]
        seen += real
        # rows of one prompt group stay in one optimizer step
        groups = {r.group_id for r in real}
        assert all(r.group_id not in groups for other in plan if other is not shares
                   for share in other for mb in share.micro_batches for r in mb if not r.is_padding)
        # every rank runs the same number of micro-batches; padding rows train nothing
        assert len({len(share.micro_batches) for share in shares}) == 1
        for r in step_rows:
            if r.is_padding:
                assert sum(r.loss_mask) == 0 and r.trajectory_id == "__padding__"
        # the dealing itself gives every rank the same number of rows (real + all-zero padding)
        assert len({len(rank) for rank in split_ranks(real, dp, True, 0, 0)}) == 1
        # balanced token loads
        loads = [sum(len(r.tokens) for mb in s.micro_batches for r in mb if not r.is_padding) for s in shares]
        assert max(loads) - min(loads) <= max(len(r.tokens) for r in real)
        # weights are over the whole step: token_mean weights of real tokens sum to 1 across ranks
        total = sum(w * sum(r.loss_mask) for s in shares for mb, ws in zip(s.micro_batches, s.weights, strict=True)
                    for r, w in zip(mb, ws, strict=True))
        assert total == pytest.approx(1.0)
        # micro-batch token budget, except a single over-long row
        for s in shares:
            for mb in s.micro_batches:
                assert len(mb) == 1 or max(len(r.tokens) for r in mb) * len(mb) <= budget
    # every real row exactly once
    assert sorted(map(id, seen)) == sorted(map(id, rows))


def test_indivisible_step_without_padding_names_the_fix():
    from memrl.train.partition import PartitionError

    rows = make_rows(1, 1, 1)[:1] * 1
    with pytest.raises(PartitionError, match="pad_to_dp"):
        plan_rollout(rows, cfg(dp_size=2), 0, 0)


def traj(tid, group, reward, question):
    return Trajectory(trajectory_id=tid, group_id=group, sample_index=0, turns=[], reward=reward,
                      metadata={"question_id": question})


def test_merge_rollout_outputs_adds_counts_and_weights_means():
    a = RolloutOutput([traj("a0", "g0", 1.0, "q0"), traj("a1", "g0", 1.0, "q0")],
                      {"reward/mean": 1.0, "trajectories/total": 2, "time/generate_s": 3.0, "tokens/generated": 10},
                      train_row_count=5, rows=["a rows"], advantages={"a0": 0.0, "a1": 0.0})
    b = RolloutOutput([traj("b0", "g1", 0.0, "q1")],
                      {"reward/mean": 0.0, "trajectories/total": 2, "time/generate_s": 5.0, "tokens/generated": 4},
                      train_row_count=3, dropped=[traj("b1", "g2", 0.0, "q2")], rows=["b rows"],
                      advantages={"b0": 0.0}, turn_advantages={("b0", 0): 0.0})
    out = merge_rollout_outputs([a, b])
    assert out.rows == ["a rows", "b rows"]  # the slices' rows, converted where they were generated
    assert list(out.advantages) == ["a0", "a1", "b0"] and list(out.turn_advantages) == [("b0", 0)]
    assert [t.trajectory_id for t in out.trajectories] == ["a0", "a1", "b0"]
    assert [t.trajectory_id for t in out.dropped] == ["b1"]
    assert out.train_row_count == 8
    assert out.metrics["trajectories/total"] == 4 and out.metrics["tokens/generated"] == 14
    assert out.metrics["time/generate_s"] == 5.0
    assert out.metrics["reward/mean"] == pytest.approx(0.5)  # 2 trajectories at 1.0, 2 (1 kept + 1 dropped) at 0.0
    assert merge_rollout_outputs([a, RolloutOutput([], {}, train_row_count=None, rows=[])]).train_row_count is None


def test_the_plan_does_not_depend_on_how_the_batch_was_cut_across_rollout_workers():
    # Group ids name slots without zero padding ("r0:10:q10" sorts before "r0:2:q2"): one process converts
    # the whole batch (rows in group_id order), two rollout workers convert slots 0-5 and 6-11 each in
    # group_id order and the driver concatenates them. Both must train the same rows in the same places.
    rows = []
    for slot in range(12):
        for row in make_rows(slot, 1, 2):
            row.group_id = f"r0:{slot}:q{slot}"
            row.trajectory_id = row.group_id + row.trajectory_id[2:]
            rows.append(row)

    def in_group_order(part):
        return sorted(part, key=lambda r: r.group_id)

    whole = in_group_order(rows)
    cut = in_group_order(rows[:len(rows) // 2]) + in_group_order(rows[len(rows) // 2:])
    assert [r.group_id for r in whole] != [r.group_id for r in cut]  # the transport order does differ

    def plan(ordered):
        return [[([[(r.trajectory_id, r.turn_index) for r in mb] for mb in share.micro_batches], share.weights)
                 for share in step]
                for step in plan_rollout(ordered, cfg(dp_size=2, num_optimizer_steps=2, pad_to_dp=True,
                                                      micro_batch_tokens=60), 0, 0)]

    assert plan(cut) == plan(whole)


@pytest.mark.parametrize("agg, per_row", [("seq_mean_token_mean", lambda n: 1 / (n * 4)),
                                          ("trajectory_mean", lambda n: 1 / (n * 4)),
                                          ("seq_mean_token_sum", lambda n: 1 / 4), ("token_mean", lambda n: 1 / 10)])
def test_a_fully_masked_row_still_counts_in_the_steps_rows_as_in_verls_training_path(agg, per_row):
    """Four trajectories of one turn, one masked whole (mask_truncated_completions): the seq and trajectory
    means divide by 4 rows, as verl >= 0.7.1's training path divides by its global batch size (3 would scale
    the step by 4/3); token_mean divides by the 10 unmasked tokens either way; padding rows count nowhere."""
    lengths = [2, 3, 5, 4]
    rows = [TrainRow(tokens=[1] * (3 + n), response_length=n, loss_mask=[0 if k == 3 else 1] * n,
                     rollout_log_probs=[-1.0] * n, advantage=1.0, group_id="g", trajectory_id=f"g/s{k}",
                     turn_index=0, rollout_id=0) for k, n in enumerate(lengths)]
    config = Config.model_validate({"train": {"dp_size": 3, "pad_to_dp": True}, "algorithm": {"loss_agg": agg}})
    (shares,) = plan_rollout(rows, config, pad_token_id=0, rollout_id=0)
    weights = {r.trajectory_id: w for s in shares for mb, ws in zip(s.micro_batches, s.weights, strict=True)
               for r, w in zip(mb, ws, strict=True)}
    assert sum(r.is_padding for s in shares for mb in s.micro_batches for r in mb) == 2
    assert weights.pop("__padding__") == 0.0 and weights.pop("g/s3") == 0.0
    assert weights == pytest.approx({f"g/s{k}": per_row(n) for k, n in enumerate(lengths[:3])})


def shared_rows(seed, n_groups, per_group, head):
    """Groups whose rows share a `head`-token prompt prefix (a turn-0 prompt whole): what sharing plans."""
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        prefix = [rng.randrange(1, 50) for _ in range(head)]
        for s in range(per_group):
            for turn in range(rng.randint(1, 3)):
                p, r = rng.randint(1, 20), rng.randint(1, 8)
                rows.append(TrainRow(tokens=prefix + [rng.randrange(1, 50) for _ in range(p + r)], response_length=r,
                                     loss_mask=[1] * r, rollout_log_probs=[-1.0] * r, advantage=rng.uniform(-1, 1),
                                     group_id=f"g{g}", trajectory_id=f"g{g}s{s}", turn_index=turn, rollout_id=0))
    return rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n_groups=st.integers(1, 4), per_group=st.integers(1, 5), dp=st.integers(1, 4),
       budget=st.sampled_from([40, 120, 10_000]), packed=st.booleans())
def test_sharing_plan_invariants(seed, n_groups, per_group, dp, budget, packed):
    from memrl.train.shared_prefix import computed_tokens, prefix_clusters

    rows = shared_rows(seed, n_groups, per_group, head=34)
    config = Config.model_validate({"train": {"dp_size": dp, "pad_to_dp": True, "micro_batch_tokens": budget,
                                              "packing": packed, "share_prefix_min_tokens": 32}})
    (shares,) = plan_rollout(rows, config, pad_token_id=0, rollout_id=0)
    seen = [r for share in shares for mb in share.micro_batches for r in mb if not r.is_padding]
    assert sorted(map(id, seen)) == sorted(map(id, rows))  # every real row exactly once
    assert len({len(share.micro_batches) for share in shares}) == 1  # the same micro-batch count on every rank
    # the dealing itself gives every rank the same number of rows (real + all-zero padding), balanced in
    # computed tokens to within the largest cluster's
    ranks = split_ranks(rows, dp, True, 0, 0, share_min=32)
    assert len({len(rank) for rank in ranks}) == 1

    def computed(part):
        return sum(computed_tokens([len(part[i].tokens) for i in c.members], c.shared)
                   for c in prefix_clusters(part, 32))

    loads = [computed(rank) for rank in ranks]
    assert max(loads) - min(loads) <= max(computed([rows[i] for i in c.members]) for c in prefix_clusters(rows, 32))
    for share in shares:
        for mb in share.micro_batches:
            clusters = prefix_clusters(mb, 32)
            if any(len(c.members) > 1 for c in clusters):  # a sharing micro-batch: its computed tokens
                size = sum(computed_tokens([len(mb[i].tokens) for i in c.members], c.shared) for c in clusters)
            else:
                size = sum(len(r.tokens) for r in mb) if packed else len(mb) * max(len(r.tokens) for r in mb)
            assert len(mb) == 1 or size <= budget
