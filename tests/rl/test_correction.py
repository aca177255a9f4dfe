"""GSPO's trajectory-level ratio (memrl.rl.loss.gspo_log_ratio) and rollout correction
(memrl.rl.correction) on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from memrl.config import AlgorithmConfig, ConfigError, config_from_dict
from memrl.rl.correction import RolloutCorrection, per_row, trajectory_totals
from memrl.rl.loss import policy_loss


def gspo_rows():
    """One trajectory of two rows (turns): log-ratios 0.1, 0.1 | -0.1, so its mean log-ratio is 0.1 / 3."""
    logp = [torch.tensor([[-1.0, -2.0]], requires_grad=True), torch.tensor([[-0.5]], requires_grad=True)]
    old = [torch.tensor([[-1.1, -2.1]]), torch.tensor([[-0.4]])]
    return logp, old


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gspo_ratio_is_the_trajectory_geometric_mean_across_micro_batches(advantage):
    logp, old = gspo_rows()
    totals = trajectory_totals([lp.detach() - o for lp, o in zip(logp, old, strict=True)],
                               [torch.ones_like(o) for o in old], [["t"], ["t"]])
    assert totals["t"][0] == pytest.approx(0.1) and totals["t"][1] == 3
    mean = totals["t"][0] / totals["t"][1]
    s = math.exp(mean)  # 1.0339: beyond GSPO's clip_high of 4e-4
    weights = torch.tensor([1 / 3])  # token_mean over the trajectory's 3 tokens
    losses, metrics = [], []
    for lp, o in zip(logp, old, strict=True):  # each row in its own micro-batch
        loss, m = policy_loss(lp, o, torch.tensor([advantage]), torch.ones_like(o), clip_low=3e-4, clip_high=4e-4,
                              row_weights=weights, sequence_log_ratio=torch.tensor([mean]))
        losses.append(loss)
        metrics.append(m)
    total = sum(losses)
    total.backward()
    if advantage > 0:
        # -A * clip(s) = -1.0004 at every token: clipped, so no gradient (PPO's pessimistic branch)
        assert total.item() == pytest.approx(-1.0004, abs=1e-6)
        assert all(torch.all(lp.grad == 0) for lp in logp)
        assert all(m["clip_fraction"].item() == 1.0 for m in metrics)
    else:
        # -A * s = s at every token, gradient s / 3 at every token of both rows (not exp(0.1) / 3 per token)
        assert total.item() == pytest.approx(s, rel=1e-6)
        for lp in logp:
            torch.testing.assert_close(lp.grad, torch.full_like(lp, s / 3))
        assert all(m["ratio_mean"].item() == pytest.approx(s, rel=1e-6) for m in metrics)


def rc(**kw):
    return RolloutCorrection.from_config(AlgorithmConfig(**kw))


def test_rollout_correction_by_hand():
    old, rollout = torch.zeros(1, 3), torch.tensor([[-1.0, 0.5, 0.0]])  # log rho = 1, -0.5, 0
    mask = torch.ones(1, 3)
    e, half = math.e, math.exp(-0.5)
    total, tokens = torch.tensor([0.5]), torch.tensor([3.0])  # the trajectory: sum log rho 0.5 over 3 tokens

    w, keep, m = rc(rollout_is="token", rollout_is_threshold=2.0).apply(old, rollout, mask)
    torch.testing.assert_close(w, torch.tensor([[2.0, half, 1.0]]))
    assert keep.tolist() == [[1, 1, 1]]
    assert m["rollout_corr/is_clipped_fraction"].item() == pytest.approx(1 / 3)
    assert m["rollout_corr/ratio_mean"].item() == pytest.approx((e + half + 1) / 3)
    assert m["rollout_corr/ratio_max"].item() == pytest.approx(e)

    w, keep, m = rc(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.5).apply(old, rollout, mask)
    assert w is None and keep.tolist() == [[0, 1, 1]]  # e > 2 is dropped, exp(-0.5) = 0.61 >= 0.5 kept
    assert m["rollout_corr/rs_masked_fraction"].item() == pytest.approx(1 / 3)

    w, keep, _ = rc(rollout_is="sequence", rollout_is_threshold=2.0).apply(old, rollout, mask, total, tokens)
    torch.testing.assert_close(w, torch.full((1, 3), math.exp(0.5)))  # one weight for the whole trajectory
    _, keep, _ = rc(rollout_rs="sequence", rollout_rs_threshold=1.5).apply(old, rollout, mask, total, tokens)
    assert keep.tolist() == [[0, 0, 0]]  # exp(0.5) = 1.65 > 1.5: the whole trajectory leaves
    _, keep, _ = rc(rollout_rs="geometric", rollout_rs_threshold=1.5).apply(old, rollout, mask, total, tokens)
    assert keep.tolist() == [[1, 1, 1]]  # exp(0.5 / 3) = 1.18 stays in [1/1.5, 1.5]


def test_rollout_correction_config():
    assert rc() is None
    legacy = rc(tis_cap=3.0)
    assert (legacy.is_level, legacy.is_threshold) == ("token", 3.0)
    assert rc(rollout_rs="token", rollout_is_threshold=4.0).rs_low == 0.25  # lower bound: 1 / upper
    with pytest.raises(ConfigError, match="tis_cap"):
        config_from_dict({"algorithm": {"tis_cap": 2.0, "rollout_is": "token"}})
    with pytest.raises(ConfigError, match="empty range"):
        config_from_dict({"algorithm": {"rollout_rs": "token", "rollout_rs_threshold": 2.0,
                                        "rollout_rs_threshold_lower": 3.0}})


def test_trajectory_totals_add_up_over_micro_batches():
    values = [torch.tensor([[1.0, 2.0], [3.0, 9.0]]), torch.tensor([[4.0, 5.0]])]
    masks = [torch.tensor([[1.0, 1.0], [1.0, 0.0]]), torch.tensor([[1.0, 0.0]])]
    totals = trajectory_totals(values, masks, [["a", "b"], ["a"]])
    assert totals == {"a": (7.0, 3.0), "b": (3.0, 1.0)}
    s, c = per_row(totals, ["b", "a", "pad"], torch.device("cpu"))
    assert s.tolist() == [3.0, 7.0, 0.0] and c.tolist() == [1.0, 3.0, 0.0]
