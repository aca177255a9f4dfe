import dataclasses
import math
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config
from memrl.rl.validate import TrajectoryError
from memrl.train.actor import Actor, NonFiniteUpdateError
from memrl.train.partition import PartitionError, plan_optimizer_step, plan_rollout, split_optimizer_steps
from memrl.types import TrainRow

VOCAB = 64
pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float()


def make_rows(n_groups=2, per_group=3, seed=0):
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        for s in range(per_group):
            for turn in range(rng.randint(1, 3)):
                p, r = rng.randint(3, 12), rng.randint(1, 6)
                mask = [1] * r
                if r > 2:
                    mask[0] = 0  # a masked-out response token must carry no gradient
                rows.append(TrainRow(tokens=[rng.randrange(1, VOCAB) for _ in range(p + r)], response_length=r,
                                     loss_mask=mask, rollout_log_probs=[-rng.random() * 3 for _ in range(r)],
                                     advantage=rng.uniform(-1, 1), group_id=f"g{g}", trajectory_id=f"g{g}s{s}",
                                     turn_index=turn, rollout_id=0))
    return rows


def make_cfg(**train):
    return Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9, **train},
                                  "algorithm": {"kl_coef": 0.0}})


def grads_of(actor, rows):
    actor.optimizer.step = lambda *a, **k: None  # keep the gradient, skip the update
    actor.train_rollout(rows, rollout_id=0)
    return {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def reference_grads(model, rows, temperature=1.0, is_cap=None, token_weight=None):
    """Plain per-row loop: on-policy PPO (ratio = 1) token_mean loss = -sum(mask * A * logp) / sum(mask).

    With `is_cap` (rollout_is=token), every token's term is multiplied by the detached truncated importance weight
    w = min(exp(old_logp - rollout_logp), cap), old_logp being this very forward (one optimizer step);
    with `token_weight(row_index, k)`, by that number instead."""
    model.zero_grad()
    total_tokens = sum(sum(r.loss_mask) for r in rows)
    loss = 0.0
    for i, r in enumerate(rows):
        logits = model(input_ids=torch.tensor([r.tokens])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        p = r.prompt_length
        for k in range(r.response_length):
            lp = logp[p + k - 1, r.tokens[p + k]]
            w = 1.0 if is_cap is None else min(math.exp(lp.item() - r.rollout_log_probs[k]), is_cap)
            w = w if token_weight is None else token_weight(i, k)
            # -A * ratio with ratio = exp(lp - lp.detach()) (value 1, gradient of lp)
            loss = loss + r.loss_mask[k] * w * (-r.advantage * torch.exp(lp - lp.detach()))
    (loss / total_tokens).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("budget", [10_000, 40])
def test_gradient_matches_plain_reference(budget):
    rows = make_rows()
    ref = reference_grads(tiny_model(), rows)
    got = grads_of(Actor(tiny_model(), make_cfg(micro_batch_tokens=budget), pad_token_id=0), rows)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-4, msg=name)


def test_simulated_data_parallel_gives_same_gradient():
    rows = make_rows(n_groups=2, per_group=2, seed=3)
    rows = rows[: len(rows) - len(rows) % 2]
    one = grads_of(Actor(tiny_model(), make_cfg(), pad_token_id=0), rows)
    two = grads_of(Actor(tiny_model(), make_cfg(dp_size=2), pad_token_id=0), rows)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-4)


def test_indivisible_rows_error_names_the_fix_and_padding_changes_nothing():
    rows = make_rows(n_groups=1, per_group=3, seed=1)
    if len(rows) % 2 == 0:
        rows = rows[:-1]
    with pytest.raises(PartitionError, match=r"train\.pad_to_dp=true"):
        Actor(tiny_model(), make_cfg(dp_size=2), pad_token_id=0).train_rollout(rows, 0)
    padded = grads_of(Actor(tiny_model(), make_cfg(dp_size=2, pad_to_dp=True), pad_token_id=0), rows)
    plain = grads_of(Actor(tiny_model(), make_cfg(), pad_token_id=0), rows)
    for name in plain:
        torch.testing.assert_close(padded[name], plain[name], atol=1e-6, rtol=1e-4)


def test_kl_is_zero_at_start_and_metrics_are_reported():
    cfg = Config.model_validate({"train": {"lr": 1e-2}, "algorithm": {"kl_coef": 0.1}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    rows = make_rows()
    m1 = actor.train_rollout(rows, 0)
    assert abs(m1["kl/mean"]) < 1e-7
    m2 = actor.train_rollout(rows, 1)
    assert m2["kl/mean"] > 0 and m2["grad_norm"] > 0 and m2["rows/consumed"] == len(rows)
    assert m1["logprob_gap/mean_abs"] > 0 and 0 <= m1["padding_fraction"] < 1


def test_optimizer_steps_counted_in_groups():
    rows = make_rows(n_groups=4)
    actor = Actor(tiny_model(), make_cfg(num_optimizer_steps=2), pad_token_id=0)
    actor.train_rollout(rows, 0)
    assert actor.global_step == 2
    with pytest.raises(PartitionError, match="num_optimizer_steps"):
        Actor(tiny_model(), make_cfg(num_optimizer_steps=5), pad_token_id=0).train_rollout(rows, 0)


def test_later_optimizer_steps_use_the_pre_update_policy_as_old():
    """With 2 optimizer steps, the second step's PPO ratio is against the policy before the first update:
    its ratio is no longer 1, so some tokens get clipped at a high learning rate."""
    rows = make_rows(n_groups=4, per_group=3, seed=5)
    cfg = Config.model_validate({"train": {"lr": 0.05, "grad_clip": 1e9, "num_optimizer_steps": 2},
                                 "algorithm": {"kl_coef": 0.0, "clip_low": 0.01, "clip_high": 0.01}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    metrics = actor.train_rollout(rows, 0)
    # averaged over the 2 steps: step 1 clips nothing (ratio 1), step 2 clips where the policy moved
    assert metrics["clip_fraction"] > 0
    one_step = Actor(tiny_model(), Config.model_validate({"train": {"lr": 0.05, "grad_clip": 1e9},
                                                          "algorithm": {"kl_coef": 0.0}}), pad_token_id=0)
    assert one_step.train_rollout(rows, 0)["clip_fraction"] == 0


def with_rollout_log_probs(rows, log_probs):
    """The same rows with other rollout (engine) log-probs."""
    return [dataclasses.replace(r, rollout_log_probs=[float(x) for x in lp])
            for r, lp in zip(rows, log_probs, strict=True)]


@pytest.mark.parametrize("budget", [10_000, 40])
def test_logprob_gap_metric_is_the_exact_gap(budget):
    """Pitfall "Silent log-prob drift" (docs/design.md: "log the gap every step"): the logged gap must be the
    real |trainer - rollout| log-prob difference over loss tokens, not just some positive number; with a
    small budget the mean and max are taken across several micro-batches."""
    rows = make_rows()
    own = Actor(tiny_model(), make_cfg(), pad_token_id=0).log_probs(rows)  # the initial policy's log-probs
    same = Actor(tiny_model(), make_cfg(micro_batch_tokens=budget), pad_token_id=0).train_rollout(
        with_rollout_log_probs(rows, own), 0)
    assert same["logprob_gap/mean_abs"] <= 1e-5 and same["logprob_gap/max_abs"] <= 1e-5
    # Every loss token off by 0.3, with alternating signs (a signed mean would be ~0); tokens outside the
    # loss mask are off by far more and must not count.
    delta = 0.3
    shifted = [[x + (delta * (-1) ** k if r.loss_mask[k] else 2.0) for k, x in enumerate(lp)]
               for r, lp in zip(rows, own, strict=True)]
    assert any(0 in r.loss_mask for r in rows)
    off = Actor(tiny_model(), make_cfg(micro_batch_tokens=budget), pad_token_id=0).train_rollout(
        with_rollout_log_probs(rows, shifted), 0)
    assert off["logprob_gap/mean_abs"] == pytest.approx(delta, abs=1e-5)
    assert off["logprob_gap/max_abs"] == pytest.approx(delta, abs=1e-5)
    if budget == 40:
        assert off["micro_batches"] > 1


def flat(grads):
    return torch.cat([grads[n].flatten() for n in sorted(grads)])


def test_truncated_importance_weights_reach_the_gradient():
    """Pitfall "Silent log-prob drift" (docs/design.md: "offer truncated importance weights"): with rollout
    log-probs off the trainer's, the gradient with `algorithm.rollout_is: token` is the PPO gradient with each
    token weighted by the detached
    w = min(exp(old_logp - rollout_logp), rollout_is_threshold) (token_mean), unlike the gradient without it."""
    rows = make_rows()
    own = Actor(tiny_model(), make_cfg(), pad_token_id=0).log_probs(rows)
    rng = random.Random(7)
    # Off by up to +-1 nat: weights exp(-shift) span [0.37, 2.7], so a cap of 1.5 truncates some of them.
    off = with_rollout_log_probs(rows, [[x + rng.uniform(-1, 1) for x in lp] for lp in own])
    cap = 1.5

    def cfg(cap):
        weights = {} if cap is None else {"rollout_is": "token", "rollout_is_threshold": cap}
        return Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9},
                                      "algorithm": {"kl_coef": 0.0, **weights}})

    with_tis = grads_of(Actor(tiny_model(), cfg(cap), pad_token_id=0), off)
    without = grads_of(Actor(tiny_model(), cfg(None), pad_token_id=0), off)
    ref = reference_grads(tiny_model(), off, is_cap=cap)
    assert ref.keys() == with_tis.keys()
    for name in ref:
        torch.testing.assert_close(with_tis[name], ref[name], atol=1e-6, rtol=1e-4, msg=name)
    scale = flat(with_tis).norm()
    assert (flat(with_tis) - flat(without)).norm() > 0.05 * scale  # the weights reach the gradient
    uncapped = reference_grads(tiny_model(), off, is_cap=math.inf)
    assert (flat(with_tis) - flat(uncapped)).norm() > 0.01 * scale  # and so does the cap


# Padding rows may change these, by design: padding_fraction is the share of processed tokens that are
# padding (padding rows and the split into ranks are exactly what it reports), micro_batches counts units
# of work (two ranks run at least one each); time/train_s and perf/train_tokens_per_s are wall-clock.
PADDING_DEPENDENT = {"padding_fraction", "micro_batches", "time/train_s", "perf/train_tokens_per_s"}


def test_padding_rows_change_no_metric():
    """Pitfall "Padding by copying" (docs/design.md: padding to a DP multiple pollutes metrics): dp_size=2 with
    pad_to_dp on an odd number of rows reports the same metrics as dp_size=1 without padding, from the same weights."""
    rows = make_rows(n_groups=2, per_group=3, seed=2)
    cfgs = {dp: Config.model_validate({
        "train": {"lr": 0.05, "grad_clip": 1e9, "num_optimizer_steps": 2, "dp_size": dp, "pad_to_dp": dp > 1},
        # two optimizer steps at a high lr with tight clips: the second step clips some tokens
        "algorithm": {"kl_coef": 0.1, "clip_low": 0.01, "clip_high": 0.01}}) for dp in (1, 2)}
    # 13 rows: groups of 6 and 7, one per optimizer step; the step of 7 gets a padding row.
    assert len(rows) % 2 == 1
    plan = plan_rollout(rows, cfgs[2], pad_token_id=0, rollout_id=0)
    assert any(r.is_padding for step in plan for share in step for mb in share.micro_batches for r in mb)
    metrics = {}
    for dp, cfg in cfgs.items():
        actor = Actor(tiny_model(), cfg, pad_token_id=0)
        # A reference model away from the policy, so kl/mean is not 0 from the first step on.
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in actor.ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        metrics[dp] = actor.train_rollout(rows, 0)
    one, two = metrics[1], metrics[2]
    required = {"loss/policy", "loss/total", "kl/mean", "entropy/mean", "logprob_gap/mean_abs",
                "logprob_gap/max_abs", "clip_fraction", "grad_norm", "tokens/loss", "rows/consumed"}
    assert required <= one.keys() and one.keys() == two.keys()
    assert one["kl/mean"] > 0 and one["clip_fraction"] > 0 and one["logprob_gap/max_abs"] > 0
    for key in sorted(one.keys() - PADDING_DEPENDENT):
        assert two[key] == pytest.approx(one[key], abs=1e-6), key


def snapshot(actor):
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


def assert_unchanged(actor, before):
    assert actor.global_step == 0 and not actor.optimizer.state  # AdamW never stepped
    for name, p in actor.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert all(p.grad is None for p in actor.model.parameters())


def unvalidated_plan(rows, cfg, rollout_id):
    """plan_rollout without its validation: how bad rows could reach train_planned past a broken check."""
    return [plan_optimizer_step(step, cfg, 0, rollout_id)
            for step in split_optimizer_steps(rows, cfg.train.num_optimizer_steps)]


def test_non_finite_advantage_past_validation_stops_the_step_unapplied():
    # train_planned trusts its plan (plan_rollout validates the rows it plans): a NaN advantage there
    # makes the loss NaN, and the step must stop with a named error instead of writing NaN weights.
    rows = make_rows()
    rows[1] = dataclasses.replace(rows[1], advantage=math.nan)
    actor = Actor(tiny_model(), make_cfg(), pad_token_id=0)
    before = snapshot(actor)
    with pytest.raises(NonFiniteUpdateError, match=r"rollout 3, optimizer step 0: non-finite loss \(nan\)") as info:
        actor.train_planned(unvalidated_plan(rows, actor.cfg, 3), 3, len(rows), 0)
    assert "passed validation" in str(info.value)
    assert_unchanged(actor, before)


@pytest.mark.parametrize("weights", [{}, {"rollout_is": "token", "rollout_is_threshold": 2.0}])
def test_infinite_logits_on_valid_rows_stop_the_step_unapplied(weights):
    # A hook makes the LM head overflow, as diverged weights would: the rows are valid, the loss is not.
    cfg = Config.model_validate({"train": {"lr": 1e-3}, "algorithm": {"kl_coef": 0.0, **weights}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    actor.model.get_output_embeddings().register_forward_hook(lambda module, args, out: out * math.inf)
    before = snapshot(actor)
    with pytest.raises(NonFiniteUpdateError, match="rollout 5, optimizer step 0") as info:
        actor.train_rollout(make_rows(), 5)
    assert "check the rows" not in str(info.value)  # the rows were validated: they are not the cause
    assert_unchanged(actor, before)


def test_actor_rejects_nan_rollout_log_probs_before_training():
    rows = make_rows()
    rows[2] = dataclasses.replace(rows[2], rollout_log_probs=[math.nan] * rows[2].response_length)
    actor = Actor(tiny_model(), make_cfg(), pad_token_id=0)
    before = snapshot(actor)
    with pytest.raises(TrajectoryError) as info:
        actor.train_rollout(rows, 0)
    assert info.value.rule == "row_log_probs_finite"
    assert_unchanged(actor, before)


def test_logprob_gap_max_is_nan_whenever_the_mean_is():
    # Python's max(0.0, nan) is 0.0: a NaN gap was reported as mean nan, max 0.0. Past validation (a
    # debug path) a NaN rollout log-prob on a loss token makes both NaN; on a masked-out token, neither.
    rows = make_rows()
    k = next(i for i, r in enumerate(rows) if r.loss_mask[0] == 0)
    actor = Actor(tiny_model(), make_cfg(), pad_token_id=0)

    def gap_metrics(position):
        lp = list(rows[k].rollout_log_probs)
        lp[position] = math.nan
        bad = rows[:k] + [dataclasses.replace(rows[k], rollout_log_probs=lp)] + rows[k + 1:]
        m = actor.train_planned(unvalidated_plan(bad, actor.cfg, 0), 0, len(bad), 0)
        return m["logprob_gap/mean_abs"], m["logprob_gap/max_abs"]

    mean, top = gap_metrics(position=1)  # a loss token
    assert math.isnan(mean) and math.isnan(top)
    mean, top = gap_metrics(position=0)  # masked out: it must not count at all
    assert math.isfinite(mean) and math.isfinite(top) and top > 0


def test_dr_grpo_fixed_normaliser_reaches_the_gradient():
    """loss_agg = seq_mean_token_sum_norm: every row's token sum over R rows x L (here L = 5), i.e. the
    token_mean gradient times total_tokens / (R L), whatever the micro-batching."""
    from memrl.train.partition import loss_scale_factor

    rows = make_rows()
    tokens, n_rows = sum(sum(r.loss_mask) for r in rows), sum(1 for r in rows if sum(r.loss_mask))
    ref = reference_grads(tiny_model(), rows)
    cfg = Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": 40},
                                 "algorithm": {"kl_coef": 0.0, "loss_agg": "seq_mean_token_sum_norm",
                                               "loss_scale_factor": 5}})
    got = grads_of(Actor(tiny_model(), cfg, pad_token_id=0), rows)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name] * tokens / (n_rows * 5), atol=1e-6, rtol=1e-4, msg=name)
    assert loss_scale_factor(Config()) == 128.0  # unset: max(task.memory_tokens 128, task.final_tokens 64)


def test_rows_of_a_trajectory_share_one_optimizer_step():
    """GSPO's trajectory ratio and sequence-level corrections need all of a trajectory's rows in one step:
    the plan keeps whole prompt groups, hence whole trajectories, together."""
    rows = make_rows(n_groups=4, per_group=3, seed=5)
    plan = plan_rollout(rows, make_cfg(num_optimizer_steps=3, micro_batch_tokens=40), pad_token_id=0, rollout_id=0)
    step_of = {}
    for k, step in enumerate(plan):
        for share in step:
            for mb in share.micro_batches:
                for r in mb:
                    if not r.is_padding:
                        assert step_of.setdefault(r.trajectory_id, k) == k
    assert len(step_of) == 12 and len(set(step_of.values())) == 3


def rc_cfg(budget, **algorithm):
    return Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": budget},
                                  "algorithm": {"kl_coef": 0.0, **algorithm}})


@pytest.mark.parametrize("option", [{"rollout_is": "sequence", "rollout_is_threshold": 1.3},
                                    {"rollout_rs": "token", "rollout_rs_threshold": 1.2},
                                    {"rollout_rs": "geometric", "rollout_rs_threshold": 1.1}])
def test_rollout_correction_reaches_the_gradient_whatever_the_micro_batching(option):
    """Sequence-level IS (one weight per trajectory, from the product of its rows' ratios), token-level MIS
    and geometric MIS give the reference gradient with each token's term weighted by hand, with one
    micro-batch or with a trajectory's rows spread over several."""
    rows = make_rows()
    own = Actor(tiny_model(), make_cfg(), pad_token_id=0).log_probs(rows)
    rng = random.Random(7)
    off = with_rollout_log_probs(rows, [[x + rng.uniform(-0.4, 0.4) for x in lp] for lp in own])
    log_rho = [[o - r for o, r in zip(lp, row.rollout_log_probs, strict=True)]
               for lp, row in zip(own, off, strict=True)]
    per_traj = {}
    for row, lr in zip(off, log_rho, strict=True):
        s, n = per_traj.get(row.trajectory_id, (0.0, 0))
        per_traj[row.trajectory_id] = (s + sum(x for x, m in zip(lr, row.loss_mask, strict=True) if m),
                                       n + sum(row.loss_mask))

    def weight(i, k):
        total, n = per_traj[off[i].trajectory_id]
        if "rollout_is" in option:
            return min(math.exp(total), option["rollout_is_threshold"])
        high = option["rollout_rs_threshold"]
        level = log_rho[i][k] if option["rollout_rs"] == "token" else total / n
        return float(-math.log(high) <= level <= math.log(high))

    weights = [weight(i, k) for i, r in enumerate(off) for k in range(r.response_length) if r.loss_mask[k]]
    assert len(set(weights)) > 1 and any(w != 1 for w in weights)  # the option weighs tokens, and not all alike
    ref = reference_grads(tiny_model(), off, token_weight=weight)
    for budget in (10_000, 40):
        got = grads_of(Actor(tiny_model(), rc_cfg(budget, **option), pad_token_id=0), off)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-4, msg=f"{budget} {name}")


def test_gspo_trajectory_ratio_is_exact_across_micro_batches():
    """loss_mode = gspo on a step whose old log-probs are off the current policy by delta (as in a later
    optimizer step): the gradient is the reference with every token of trajectory i weighted by
    s_i = exp(mean of delta over all of i's tokens, all its rows), whether its rows share a micro-batch or not."""
    rows = make_rows(n_groups=2, per_group=3, seed=5)
    gen = torch.Generator().manual_seed(3)
    got = {}
    for budget in (10_000, 40):
        cfg = Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": budget},
                                     "algorithm": {"kl_coef": 0.0, "loss_mode": "gspo", "credit": "share",
                                                   "clip_low": 0.9, "clip_high": 10.0}})
        actor = Actor(tiny_model(), cfg, pad_token_id=0)
        actor.optimizer.step = lambda *a, **k: None
        (shares,) = plan_rollout(rows, cfg, pad_token_id=0, rollout_id=0)
        current = actor._old_log_probs(shares)
        gen.manual_seed(3)
        deltas = {}  # (trajectory, turn) -> per-token delta, the same for both budgets
        olds = []
        for mb_rows, cur in zip([mb for sh in shares for mb in sh.micro_batches], current, strict=True):
            d = torch.zeros_like(cur)
            for b, r in enumerate(mb_rows):
                key = (r.trajectory_id, r.turn_index)
                if key not in deltas:
                    deltas[key] = torch.rand(r.response_length, generator=gen) * 0.6 - 0.3
                d[b, : r.response_length] = deltas[key]
            olds.append(cur - d)
        actor._optimizer_step(shares, 0, olds, fresh_old=False)
        got[budget] = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    mean = {}
    for r in rows:
        s_, n_ = mean.get(r.trajectory_id, (0.0, 0))
        d = deltas[(r.trajectory_id, r.turn_index)]
        mean[r.trajectory_id] = (s_ + sum(float(d[k]) for k in range(r.response_length) if r.loss_mask[k]),
                                 n_ + sum(r.loss_mask))
    s_of = {t: math.exp(total / n) for t, (total, n) in mean.items()}
    assert max(s_of.values()) / min(s_of.values()) > 1.05  # the trajectories' ratios differ
    ref = reference_grads(tiny_model(), rows, token_weight=lambda i, k: s_of[rows[i].trajectory_id])
    for budget, grads in got.items():
        for name in ref:
            torch.testing.assert_close(grads[name], ref[name], atol=1e-6, rtol=1e-4, msg=f"{budget} {name}")
    # and a real two-step run: GSPO's narrow range clips whole trajectories in the second step
    cfg = Config.model_validate({"train": {"lr": 0.05, "grad_clip": 1e9, "num_optimizer_steps": 2},
                                 "algorithm": {"kl_coef": 0.0, "loss_mode": "gspo", "credit": "share",
                                               "loss_agg": "trajectory_mean", "clip_low": 3e-4, "clip_high": 4e-4}})
    assert Actor(tiny_model(), cfg, pad_token_id=0).train_rollout(make_rows(n_groups=4), 0)["clip_fraction"] > 0


def test_importance_weights_scale_the_policy_gradient_only():
    """memrl/rl/correction.py: the rollout IS weights multiply the policy-gradient term, not the KL or entropy
    terms (as verl, whose rollout_is_weights reach the policy loss only): the gradient is a plain loop's
    token_mean of w_t PG_t + kl_coef KL_t - entropy_coef H_t, and not the one with w_t on all three."""
    rows = make_rows()
    own = Actor(tiny_model(), make_cfg(), pad_token_id=0).log_probs(rows)
    rng = random.Random(7)
    off = with_rollout_log_probs(rows, [[x + rng.uniform(-1, 1) for x in lp] for lp in own])
    cap, kl_coef, entropy_coef = 1.5, 0.5, 0.1
    cfg = Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9},
                                 "algorithm": {"kl_coef": kl_coef, "entropy_coef": entropy_coef,
                                               "rollout_is": "token", "rollout_is_threshold": cap}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a reference away from the policy, so the KL term has a gradient
        for p in actor.ref_model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    ref_model = actor.ref_model
    got = grads_of(actor, off)

    def reference(weigh_all):
        model = tiny_model()
        total_tokens = sum(sum(r.loss_mask) for r in off)
        loss = 0.0
        for r in off:
            logp = torch.log_softmax(model(input_ids=torch.tensor([r.tokens])).logits[0].float(), -1)
            with torch.no_grad():
                ref_logp = torch.log_softmax(ref_model(input_ids=torch.tensor([r.tokens])).logits[0].float(), -1)
            p = r.prompt_length
            for k in range(r.response_length):
                pos, tok = p + k - 1, r.tokens[p + k]
                lp, diff = logp[pos, tok], ref_logp[pos, tok] - logp[pos, tok]
                w = min(math.exp(lp.item() - r.rollout_log_probs[k]), cap)
                pg = -r.advantage * torch.exp(lp - lp.detach())
                kl = torch.expm1(diff) - diff  # k3
                entropy = -(logp[pos].exp() * logp[pos]).sum()
                other = kl_coef * kl - entropy_coef * entropy
                loss = loss + r.loss_mask[k] * (w * pg + (w * other if weigh_all else other))
        model.zero_grad()
        (loss / total_tokens).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    pg_only = reference(weigh_all=False)
    for name in pg_only:
        torch.testing.assert_close(got[name], pg_only[name], atol=1e-6, rtol=1e-4, msg=name)
    all_terms = reference(weigh_all=True)
    assert (flat(all_terms) - flat(pg_only)).norm() > 0.01 * flat(pg_only).norm()  # the test tells them apart
