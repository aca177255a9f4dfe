"""memrl.rl.loss against hand-written loop references, known numbers, and exact micro-batching."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.rl.loss import (
    LossError,
    aggregate,
    compute_token_weights,
    entropy_from_log_probs,
    kl_penalty,
    policy_loss,
    weighted_token_sum,
)

MODES = ["token_mean", "seq_mean_token_mean", "trajectory_mean"]


# ---- plain-loop references --------------------------------------------------------------------


def ref_token_loss(lp, old, adv, clip_low, clip_high, dual_clip):
    """One token's PPO loss, written with scalar branches instead of tensor ops."""
    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped_ratio = ratio
    if ratio < 1 - clip_low:
        clipped_ratio = torch.full_like(ratio, 1 - clip_low)
    elif ratio > 1 + clip_high:
        clipped_ratio = torch.full_like(ratio, 1 + clip_high)
    clipped = -adv * clipped_ratio
    loss = unclipped if unclipped >= clipped else clipped
    if dual_clip is not None and adv < 0 and loss > -adv * dual_clip:
        loss = -adv * dual_clip
    return loss


def ref_aggregate(values, mask, mode, traj):
    """values/mask as nested python lists of 0-d tensors / numbers; traj: per-row trajectory ids."""
    rows = range(len(mask))
    if mode == "token_mean":
        num = sum((values[r][t] * mask[r][t] for r in rows for t in range(len(mask[r]))), torch.tensor(0.0))
        den = sum(mask[r][t] for r in rows for t in range(len(mask[r])))
        return num / den if den else num * 0
    if mode == "seq_mean_token_mean":
        means = []
        for r in rows:
            n = sum(mask[r])
            if n:
                means.append(sum(values[r][t] * mask[r][t] for t in range(len(mask[r]))) / n)
        return sum(means) / len(means) if means else torch.tensor(0.0)
    per_traj: dict = {}
    for r in rows:
        num, den = per_traj.get(traj[r], (0.0, 0))
        num = num + sum(values[r][t] * mask[r][t] for t in range(len(mask[r])))
        per_traj[traj[r]] = (num, den + sum(mask[r]))
    means = [num / den for num, den in per_traj.values() if den]
    return sum(means) / len(means) if means else torch.tensor(0.0)


def random_batch(seed, batch=5, seq=7, zero_rows=(1,)):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.3 - 1.0)
    old = lp + torch.randn(batch, seq, generator=g, dtype=torch.float64) * 0.4  # ratios well outside 1 ± 0.2
    adv = torch.randn(batch, seq, generator=g, dtype=torch.float64)
    mask = (torch.rand(batch, seq, generator=g) > 0.3).to(torch.float64)
    for r in zero_rows:
        mask[r] = 0
    return lp, old, adv, mask


# ---- policy loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clips", [(0.2, 0.2), (0.2, 0.28)])
def test_policy_loss_and_gradient_match_loop_reference(dual_clip, mode, clips):
    lp, old, adv, mask = random_batch(seed=3)
    traj = torch.tensor([0, 0, 1, 2, 2])
    clip_low, clip_high = clips

    lp_a = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(lp_a, old, adv, mask, clip_low, clip_high, dual_clip, mode, traj)
    loss.backward()

    lp_b = lp.clone().requires_grad_(True)
    token_losses = [[ref_token_loss(lp_b[r, t], old[r, t], adv[r, t], clip_low, clip_high, dual_clip)
                     for t in range(lp.shape[1])] for r in range(lp.shape[0])]
    ref = ref_aggregate(token_losses, mask.tolist(), mode, traj.tolist())
    ref.backward()

    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp_a.grad, lp_b.grad)
    # zero-mask row gets no gradient; some tokens are clipped (zero grad), so the test sees the clip
    assert torch.all(lp_a.grad[1] == 0)
    assert 0 < metrics["clip_fraction"].item() < 1
    if dual_clip is not None:
        assert metrics["dual_clip_fraction"].item() > 0


def test_dual_clip_caps_negative_advantage_loss():
    lp = torch.tensor([[math.log(10.0)]])  # ratio 10
    old = torch.zeros(1, 1)
    adv = torch.tensor([[-1.0]])
    mask = torch.ones(1, 1)
    plain, _ = policy_loss(lp, old, adv, mask)
    capped, m = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    assert plain.item() == pytest.approx(10.0)
    assert capped.item() == pytest.approx(3.0)
    assert m["dual_clip_fraction"].item() == 1.0
    # positive advantage is untouched by dual clip: clipped at 1 + 0.2
    pos, _ = policy_loss(lp, old, -adv, mask, dual_clip=3.0)
    assert pos.item() == pytest.approx(-1.2)


def test_policy_loss_metrics_and_row_advantages():
    lp = torch.tensor([[0.0, 0.5, 0.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss_rows, metrics = policy_loss(lp, old, torch.tensor([2.0]), mask)
    loss_full, _ = policy_loss(lp, old, torch.full((1, 3), 2.0), mask)
    assert loss_rows.item() == pytest.approx(loss_full.item())
    r = math.exp(0.5)
    assert metrics["ratio_mean"].item() == pytest.approx((1 + r) / 2)
    assert metrics["ratio_max"].item() == pytest.approx(r)
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["approx_kl"].item() == pytest.approx(((r - 1) - 0.5) / 2)
    assert metrics["tokens"].item() == 2
    assert all(not v.requires_grad for v in metrics.values())


def test_importance_weights_scale_tokens():
    lp, old, adv, mask = random_batch(seed=5)
    base, _ = policy_loss(lp, old, adv, mask, agg="token_mean", row_weights=torch.ones(lp.shape[0]))
    weighted, _ = policy_loss(lp, old, adv, mask, importance_weights=torch.ones_like(lp) * 2,
                              row_weights=torch.ones(lp.shape[0]))
    assert weighted.item() == pytest.approx(2 * base.item())


def test_policy_loss_rejects_bad_arguments():
    lp, old, adv, mask = random_batch(seed=1)
    with pytest.raises(LossError, match="dual_clip"):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(LossError, match="shape"):
        policy_loss(lp[:, :3], old, adv, mask)
    with pytest.raises(LossError, match="group_index"):
        policy_loss(lp, old, adv, mask, agg="trajectory_mean")
    with pytest.raises(LossError, match="loss_agg"):
        policy_loss(lp, old, adv, mask, agg="mean")


# ---- KL and entropy ---------------------------------------------------------------------------


def test_kl_estimators_on_known_numbers():
    lp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref = torch.tensor([-1.0, -1.0, -1.5, -3.0])
    k1 = kl_penalty(lp, ref, "k1")
    torch.testing.assert_close(k1, torch.tensor([0.0, -1.0, 1.0, 0.0]))
    k3 = kl_penalty(lp, ref, "k3")
    d = ref - lp  # [0, 1, -1, 0]
    expected = torch.exp(d) - d - 1
    torch.testing.assert_close(k3, expected)
    assert k3[1].item() == pytest.approx(math.e - 2)
    assert k3[2].item() == pytest.approx(math.exp(-1))
    assert torch.all(k3 >= 0) and k3[0] == 0 and k3[3] == 0
    with pytest.raises(LossError, match="k1"):
        kl_penalty(lp, ref, "k2")


def test_k3_nonnegative_and_finite_on_random_and_extreme_values():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(1000, generator=g) * 5
    ref = torch.randn(1000, generator=g) * 5
    k3 = kl_penalty(torch.cat([lp, torch.tensor([-200.0])]), torch.cat([ref, torch.tensor([0.0])]), "k3")
    assert torch.all(k3 >= 0) and torch.all(torch.isfinite(k3))


def entropy_from_logits(logits):
    return entropy_from_log_probs(torch.log_softmax(logits.float(), dim=-1))


@pytest.mark.parametrize("inplace", [False, True])
def test_entropy_matches_categorical(inplace):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    got = entropy_from_log_probs(torch.log_softmax(logits, dim=-1), inplace=inplace)
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_entropy_stable_with_extreme_and_masked_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [0.0, 0.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    assert h[0].item() == pytest.approx(0.0, abs=1e-6)
    assert h[1].item() == pytest.approx(math.log(2))
    h.sum().backward()
    assert torch.all(torch.isfinite(logits.grad))


# ---- aggregation ------------------------------------------------------------------------------


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [99.0, 99.0, 99.0], [4.0, 6.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])
    traj = torch.tensor([7, 7, 3, 5])  # trajectory 7 has rows 0 and 1; row 2 is padding
    # token_mean: (1+2+3+10+4+6) / 6
    assert aggregate(values, mask, "token_mean").item() == pytest.approx(26 / 6)
    # seq_mean_token_mean: mean(2, 10, 5) over the three non-empty rows
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx(17 / 3)
    # trajectory_mean: traj 7 = 16/4 = 4, traj 5 = 5, traj 3 has no tokens -> mean(4, 5)
    assert aggregate(values, mask.bool(), "trajectory_mean", traj).item() == pytest.approx(4.5)


def test_padding_rows_change_nothing_even_with_nan_values():
    values = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    padded_values = torch.cat([values, torch.tensor([[float("nan"), float("inf")]])])
    padded_mask = torch.cat([mask, torch.zeros(1, 2)])
    for mode in MODES:
        a = aggregate(values, mask, mode, torch.tensor([0, 1]))
        b = aggregate(padded_values, padded_mask, mode, torch.tensor([0, 1, 2]))
        assert b.item() == pytest.approx(a.item()), mode


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_mask_gives_zero_with_grad(mode):
    values = torch.randn(3, 4, requires_grad=True)
    loss = aggregate(values, torch.zeros(3, 4), mode, torch.tensor([0, 0, 1]))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.all(values.grad == 0)
    w = compute_token_weights([0, 0, 0], ["a", "a", "b"], mode)
    assert w == [0.0, 0.0, 0.0]


def test_compute_token_weights_by_hand():
    n = [3, 1, 0, 2]
    traj = ["x", "x", "pad", "y"]
    assert compute_token_weights(n, None, "token_mean") == pytest.approx([1 / 6, 1 / 6, 0, 1 / 6])
    assert compute_token_weights(n, None, "seq_mean_token_mean") == pytest.approx([1 / 9, 1 / 3, 0, 1 / 6])
    assert compute_token_weights(n, traj, "trajectory_mean") == pytest.approx([1 / 8, 1 / 8, 0, 1 / 4])
    with pytest.raises(LossError, match="trajectory"):
        compute_token_weights(n, None, "trajectory_mean")


# ---- exact micro-batching (hypothesis) --------------------------------------------------------


@st.composite
def step_batches(draw):
    batch = draw(st.integers(1, 10))
    seq = draw(st.integers(1, 6))
    n_traj = draw(st.integers(1, 4))
    traj = draw(st.lists(st.integers(0, n_traj - 1), min_size=batch, max_size=batch))
    mask = draw(st.lists(st.lists(st.sampled_from([0, 1]), min_size=seq, max_size=seq),
                         min_size=batch, max_size=batch))
    values = draw(st.lists(st.lists(st.floats(-10, 10), min_size=seq, max_size=seq),
                           min_size=batch, max_size=batch))
    perm = draw(st.permutations(range(batch)))
    cuts = sorted(draw(st.sets(st.integers(1, max(batch - 1, 1)), max_size=batch)))
    cuts = [c for c in cuts if 0 < c < batch]
    return (torch.tensor(values, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64),
            torch.tensor(traj), list(perm), cuts)


def split(indices, cuts):
    bounds = [0, *cuts, len(indices)]
    return [indices[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


@settings(max_examples=150, deadline=None)
@given(step_batches(), st.sampled_from(MODES))
def test_row_weights_make_any_micro_batching_exact(data, mode):
    values, mask, traj, perm, cuts = data
    full = aggregate(values, mask, mode, traj)
    weights = torch.tensor(compute_token_weights(mask.sum(-1).tolist(), traj.tolist(), mode), dtype=torch.float64)
    assert weighted_token_sum(values, mask, weights).item() == pytest.approx(full.item(), abs=1e-9)
    total = sum(weighted_token_sum(values[mb], mask[mb], weights[mb]) for mb in split(perm, cuts))
    assert float(total) == pytest.approx(full.item(), abs=1e-9)


def test_policy_loss_row_weights_equal_full_batch_for_micro_batches():
    lp, old, adv, mask = random_batch(seed=11, batch=6, zero_rows=(2,))
    traj = ["a", "a", "pad", "b", "c", "c"]
    gi = torch.tensor([0, 0, 1, 2, 3, 3])
    for mode in MODES:
        full, _ = policy_loss(lp, old, adv, mask, agg=mode, group_index=gi)
        w = torch.tensor(compute_token_weights(mask.sum(-1).tolist(), traj, mode), dtype=torch.float64)
        parts = [policy_loss(lp[mb], old[mb], adv[mb], mask[mb], row_weights=w[mb])[0]
                 for mb in ([0, 3], [1, 2, 4], [5])]
        assert float(sum(parts)) == pytest.approx(full.item(), abs=1e-12), mode


# ---- seq_mean_token_sum and Dr. GRPO's seq_mean_token_sum_norm ---------------------------------

SUM_MODES = ["seq_mean_token_sum", "seq_mean_token_sum_norm"]


def test_token_sum_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row sums 3 and 4; row 3 is empty
    assert aggregate(values, mask, "seq_mean_token_sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum_norm", loss_scale_factor=4).item() == pytest.approx(7 / (2 * 4))
    # a longer row weighs more in both (its token sum), unlike seq_mean_token_mean: (1.5 + 4) / 2
    assert aggregate(values, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    n = [3, 1, 0, 2]
    assert compute_token_weights(n, None, "seq_mean_token_sum") == pytest.approx([1 / 3, 1 / 3, 0, 1 / 3])
    assert compute_token_weights(n, None, "seq_mean_token_sum_norm", 10) == pytest.approx([1 / 30, 1 / 30, 0, 1 / 30])


def verl_agg_loss_token_sum_norm(loss_mat, loss_mask, dp_size=1, global_batch_size=None, loss_scale_factor=None):
    """verl's agg_loss(loss_agg_mode="seq-mean-token-sum-norm"), v0.7.1 to v0.9.0, ported."""
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
    seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()
    if global_batch_size is None:
        global_batch_size = seq_mask.sum()
    loss = torch.sum(seq_losses * seq_mask) / global_batch_size * dp_size
    return loss / (loss_scale_factor if loss_scale_factor is not None else loss_mask.shape[-1])


def test_seq_mean_token_sum_norm_is_verls_and_trls_dr_grpo_by_hand():
    """4 rows x 5 tokens of loss 1, L = 64: sum / (R L) = 20 / 256 = 0.078125, as verl >= 0.7.1 (agg_loss over
    the global batch, whatever the micro-batches) and TRL's dr_grpo (sum / (rows x max_completion_length)).
    verl <= 0.7.0 divided one call's token sum by L only, 20 / 64 = 0.3125. A fifth, empty row that is padding
    counts in neither R nor verl's global batch size (a masked truncated answer is a real row and counts in
    both: test_a_fully_masked_row_still_counts_in_the_steps_rows_as_in_verls_training_path)."""
    values = torch.ones(5, 64)
    mask = torch.zeros(5, 64)
    mask[:4, :5] = 1.0
    ours = aggregate(values, mask, "seq_mean_token_sum_norm", loss_scale_factor=64).item()
    assert ours == 0.078125  # exact: powers of two
    weights = torch.tensor(compute_token_weights(mask.sum(-1).tolist(), None, "seq_mean_token_sum_norm", 64))
    for cuts in ([0, 5], [0, 1, 3, 5], [0, 2, 4, 5]):  # any cut into micro-batches adds up to the same loss
        parts = [weighted_token_sum(values[a:b], mask[a:b], weights[a:b]) for a, b in itertools.pairwise(cuts)]
        assert float(sum(parts)) == ours
    # verl: each of 2 ranks aggregates its own rows with the global batch size; DDP averages the ranks
    ranks = [verl_agg_loss_token_sum_norm(values[r], mask[r], dp_size=2, global_batch_size=4, loss_scale_factor=64)
             for r in (slice(0, 3), slice(3, 5))]
    assert ours == float(sum(ranks) / 2) == verl_agg_loss_token_sum_norm(values, mask, loss_scale_factor=64).item()
    assert ours == (mask[:4] * values[:4]).sum().item() / (4 * 64)  # TRL dr_grpo on the 4 non-empty rows


def test_token_sum_norm_needs_its_normaliser():
    with pytest.raises(LossError, match="loss_scale_factor"):
        compute_token_weights([1, 2], None, "seq_mean_token_sum_norm")
    with pytest.raises(LossError, match="loss_scale_factor"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), "seq_mean_token_sum_norm", loss_scale_factor=0)


@settings(max_examples=100, deadline=None)
@given(step_batches(), st.sampled_from(SUM_MODES))
def test_token_sum_modes_micro_batch_exactly(data, mode):
    values, mask, traj, perm, cuts = data
    full = aggregate(values, mask, mode, traj, loss_scale_factor=7)
    weights = torch.tensor(compute_token_weights(mask.sum(-1).tolist(), traj.tolist(), mode, 7), dtype=torch.float64)
    total = sum(weighted_token_sum(values[mb], mask[mb], weights[mb]) for mb in split(perm, cuts))
    assert float(total) == pytest.approx(full.item(), abs=1e-9)
