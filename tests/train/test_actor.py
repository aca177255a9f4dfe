import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config
from memrl.train.actor import Actor
from memrl.train.partition import PartitionError
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


def reference_grads(model, rows, temperature=1.0):
    """Plain per-row loop: on-policy PPO (ratio = 1) token_mean loss = -sum(mask * A * logp) / sum(mask)."""
    model.zero_grad()
    total_tokens = sum(sum(r.loss_mask) for r in rows)
    loss = 0.0
    for r in rows:
        logits = model(input_ids=torch.tensor([r.tokens])).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        p = r.prompt_length
        for k in range(r.response_length):
            lp = logp[p + k - 1, r.tokens[p + k]]
            # -A * ratio with ratio = exp(lp - lp.detach()) (value 1, gradient of lp)
            loss = loss + r.loss_mask[k] * (-r.advantage * torch.exp(lp - lp.detach()))
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
