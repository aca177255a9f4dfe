"""GSPO's trajectory-level ratio (memrl.rl.loss.gspo_log_ratio) and rollout correction
(memrl.rl.correction) on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch
from traj_factory import make_trajectory

from memrl.config import AlgorithmConfig, ConfigError, config_from_dict
from memrl.memagent.task import convert_trajectories
from memrl.rl.advantages import trajectory_advantages
from memrl.rl.correction import RolloutCorrection, per_row, trajectory_totals
from memrl.rl.loss import compute_token_weights, policy_loss


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


def verl_gspo(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high):
    """verl's compute_policy_loss_gspo (verl/trainer/ppo/core_algos.py, v0.7.1 to v0.9.0), ported: one
    sequence per row, its loss aggregated seq-mean-token-mean (one process, no micro-batches)."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_low, 1 + clip_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    # agg_loss(loss_agg_mode="seq-mean-token-mean")
    seq_mask = torch.sum(response_mask, dim=-1)
    seq_losses = torch.sum(pg_losses * response_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).float()
    return torch.sum(seq_losses * seq_mask) / seq_mask.sum()


def gspo_trajectories():
    """A group of 3-turn and a group of 1-turn trajectories (split credit would give A/3 and A)."""
    specs = [("g", [1.0, 0.0, 0.0], 2), ("h", [0.0, 1.0], 0)]
    return [make_trajectory(f"{g}/s{i}", g, memory_turns, reward=r, sample_index=i, response_len=4 + i)
            for g, rewards, memory_turns in specs for i, r in enumerate(rewards)]


def memrl_gspo(rows, logp, old, clip_low, clip_high):
    """memrl's GSPO step loss with every row in its own micro-batch: trajectory totals first, then
    trajectory_mean row weights (as the trainer does)."""
    masks = [torch.tensor([r.loss_mask], dtype=torch.float64) for r in rows]
    totals = trajectory_totals([lp.detach() - o for lp, o in zip(logp, old, strict=True)], masks,
                               [[r.trajectory_id] for r in rows])
    weights = compute_token_weights([sum(r.loss_mask) for r in rows], [r.trajectory_id for r in rows],
                                    "trajectory_mean")
    total = 0.0
    for r, lp, o, m, w in zip(rows, logp, old, masks, weights, strict=True):
        s, n = totals[r.trajectory_id]
        loss, _ = policy_loss(lp, o, torch.tensor([r.advantage], dtype=torch.float64), m, clip_low, clip_high,
                              row_weights=torch.tensor([w], dtype=torch.float64),
                              sequence_log_ratio=torch.tensor([s / n], dtype=torch.float64))
        total = total + loss
    return total


def test_gspo_with_share_credit_is_verls_sequence_level_gspo():
    """A trajectory is GSPO's sequence: memrl's per-row GSPO (rows in separate micro-batches, credit share,
    loss_agg trajectory_mean) has the loss and gradient of verl's GSPO on each trajectory's turns
    concatenated into one sequence with the trajectory's advantage A on every token. Split credit (A/T per
    turn) does not, hence the config refuses it."""
    trajs = gspo_trajectories()
    cfg = AlgorithmConfig(loss_mode="gspo", credit="share", loss_agg="trajectory_mean", clip_low=0.05, clip_high=0.05)
    rows = convert_trajectories(trajs, cfg, 0)
    gen = torch.Generator().manual_seed(0)
    logp = [(-0.1 - 3 * torch.rand(1, r.response_length, generator=gen, dtype=torch.float64)).requires_grad_()
            for r in rows]
    # per-token log-ratios around a trajectory's own level: some trajectories inside the clip range, some out
    level = {t: x for t, x in zip(sorted({r.trajectory_id for r in rows}), [-0.1, -0.02, 0.01, 0.03, 0.09],
                                  strict=True)}
    old = [lp.detach() - level[r.trajectory_id]
           - (0.1 * torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.05)
           for lp, r in zip(logp, rows, strict=True)]

    ours = memrl_gspo(rows, logp, old, 0.05, 0.05)
    ours.backward()

    # verl: one padded sequence per trajectory, advantage A_i (GRPO on the raw rewards) on all its tokens
    advantage = trajectory_advantages(trajs)
    ids = sorted({r.trajectory_id for r in rows})
    leaves = [lp.detach().clone().requires_grad_() for lp in logp]
    per_traj = {t: [k for k, r in enumerate(rows) if r.trajectory_id == t] for t in ids}
    width = max(sum(rows[k].response_length for k in ks) for ks in per_traj.values())

    def padded(parts):
        seq = torch.cat(parts, dim=1)
        return torch.nn.functional.pad(seq, (0, width - seq.shape[1]))

    log_prob = torch.cat([padded([leaves[k] for k in per_traj[t]]) for t in ids])
    old_log_prob = torch.cat([padded([old[k] for k in per_traj[t]]) for t in ids])
    mask = torch.cat([padded([torch.tensor([rows[k].loss_mask], dtype=torch.float64) for k in per_traj[t]])
                      for t in ids])
    adv = torch.tensor([[advantage[t]] for t in ids], dtype=torch.float64).expand_as(mask)
    theirs = verl_gspo(log_prob, old_log_prob, adv, mask, 0.05, 0.05)
    theirs.backward()

    ratios = [math.exp(float(((log_prob.detach() - old_log_prob) * mask)[i].sum() / mask[i].sum()))
              for i in range(len(ids))]
    assert any(abs(s - 1) > 0.05 for s in ratios) and any(abs(s - 1) < 0.05 for s in ratios)  # clipped and not
    assert any(lp.grad.abs().sum() > 0 for lp in logp) and any(lp.grad.abs().sum() == 0 for lp in logp)
    # float64 on both sides, the same terms in another order (~1e-16 relative); verl adds 1e-8 to every
    # sequence's token count (>= 3 here), which moves its result by at most 1e-8 / 3 relative.
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-8)
    for lp, leaf in zip(logp, leaves, strict=True):
        torch.testing.assert_close(lp.grad, leaf.grad, rtol=1e-8, atol=1e-15)

    split = convert_trajectories(trajs, AlgorithmConfig(credit="split"), 0)
    assert memrl_gspo(split, logp, old, 0.05, 0.05).item() != pytest.approx(theirs.item(), rel=1e-3)


def test_gspo_refuses_split_credit():
    with pytest.raises(ConfigError, match=r"algorithm.credit = 'share'"):
        config_from_dict({"algorithm": {"loss_mode": "gspo"}})  # credit's default is split
    with pytest.raises(ConfigError, match=r"algorithm.credit = 'share'"):
        config_from_dict({"algorithm": {"loss_mode": "gspo", "credit": "split"}})
    assert config_from_dict({"algorithm": {"loss_mode": "gspo", "credit": "share"}}).algorithm.loss_mode == "gspo"


def test_gspo_refuses_the_dual_clip_it_does_not_have():
    """verl's GSPO has no dual clip; accepted, it capped a runaway trajectory's loss (3.0 per token, verl 7.389)."""
    with pytest.raises(ConfigError, match=r"algorithm.dual_clip = 3.0 with algorithm.loss_mode = 'gspo'.*no dual clip"):
        config_from_dict({"algorithm": {"loss_mode": "gspo", "credit": "share", "dual_clip": 3.0}})
    assert config_from_dict({"algorithm": {"dual_clip": 3.0}}).algorithm.dual_clip == 3.0  # PPO keeps it


@pytest.mark.parametrize("mean_log_ratio, ratio", [(12.0, math.exp(10.0)), (9.0, math.exp(9.0))])
def test_gspo_trajectory_ratio_is_clamped_above_at_verls_bound(mean_log_ratio, ratio):
    """A = -1 and a trajectory whose mean log-ratio is +12: every token's loss is -A s = e^10 = 22,026.47 (verl's
    clamp at 10), not e^12 = 162,754.79, and past the bound the token gets no gradient (as in verl, whose clamp
    takes the log_prob term with it). Below it (+9) the ratio and its gradient are s."""
    logp = torch.zeros(1, 3, requires_grad=True)
    loss, metrics = policy_loss(logp, torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3), 3e-4, 4e-4,
                                row_weights=torch.tensor([1 / 3]), sequence_log_ratio=torch.tensor([mean_log_ratio]))
    loss.backward()
    assert loss.item() == pytest.approx(ratio, rel=1e-6)  # float32: exp() to ~1e-7 relative
    assert metrics["ratio_max"].item() == pytest.approx(ratio, rel=1e-6)
    expected_grad = 0.0 if mean_log_ratio > 10 else ratio / 3
    torch.testing.assert_close(logp.grad, torch.full((1, 3), expected_grad), rtol=1e-6, atol=0.0)
    verl = verl_gspo(torch.zeros(1, 3), torch.full((1, 3), -mean_log_ratio), torch.full((1, 3), -1.0),
                     torch.ones(1, 3), 3e-4, 4e-4)
    assert loss.item() == pytest.approx(verl.item(), rel=1e-6)


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

    w, keep, m = rc(rollout_rs="token", rollout_rs_threshold=2.0,
                    rollout_rs_threshold_lower=0.5).apply(old, rollout, mask)
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
    token = rc(rollout_is="token", rollout_is_threshold=3.0)
    assert (token.is_level, token.is_threshold, token.rs_level) == ("token", 3.0, None)
    assert rc(rollout_rs="token", rollout_is_threshold=4.0).rs_low == 0.25  # lower bound: 1 / upper
    with pytest.raises(ConfigError, match="tis_cap is replaced by algorithm.rollout_is=token"):
        config_from_dict({"algorithm": {"tis_cap": 2.0}})
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
