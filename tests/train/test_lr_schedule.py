"""LR schedules (memrl.train.lr_schedule): today's warmup unchanged, linear / cosine decay to a floor, resume."""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config, ConfigError, load_config
from memrl.train.actor import Actor
from memrl.train.lr_schedule import lr_schedule
from memrl.types import TrainRow

pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")


def train_cfg(**train):
    return Config.model_validate({"train": {"lr": 1e-3, **train}, "algorithm": {"kl_coef": 0.0}}).train


@pytest.mark.parametrize("warmup", [0, 1, 3, 10])
def test_the_default_is_the_warmup_memrl_always_had(warmup):
    t = train_cfg(warmup_steps=warmup, num_rollout=20)

    def before(step):  # the seed's LambdaLR factor
        return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0

    assert [lr_schedule(t)(s) for s in range(40)] == [before(s) for s in range(40)]


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_decay_reaches_the_floor_at_the_last_step(style):
    t = train_cfg(lr_scheduler=style, warmup_steps=2, num_rollout=5, num_optimizer_steps=2, min_lr_ratio=0.1)
    factors = [lr_schedule(t)(s) for s in range(10)]  # 5 rollouts x 2 optimizer steps
    assert factors[:2] == [0.5, 1.0]
    assert all(a >= b for a, b in zip(factors[1:], factors[2:], strict=False))  # never rises after warmup
    assert factors[-1] == pytest.approx(0.1)
    assert 0.1 < factors[5] < 1.0
    quarter = 0.75 if style == "linear" else 0.5 * (1 + math.cos(math.pi / 4))  # p = (4 - 2) / 8
    assert factors[3] == pytest.approx(0.1 + 0.9 * quarter, rel=1e-12)


def test_cosine_matches_the_formula():
    t = train_cfg(lr_scheduler="cosine", num_rollout=8, min_lr_ratio=0.0)
    for step in range(8):
        p = (step + 1) / 8
        assert lr_schedule(t)(step) == pytest.approx(0.5 * (1 + math.cos(math.pi * p)), rel=1e-12)


@pytest.mark.parametrize("sets", [["train.min_lr_ratio=0.1"], ["train.lr_scheduler=step"]])
def test_inconsistent_schedules_are_refused(sets):
    with pytest.raises(ConfigError, match="train"):
        load_config(None, sets)


def tiny_model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float()


def rows():
    return [TrainRow(tokens=[3, 4, 5, 6, 7, 8], response_length=3, loss_mask=[1, 1, 1],
                     rollout_log_probs=[-1.0, -2.0, -1.5], advantage=adv, group_id="g", trajectory_id=f"t{i}",
                     turn_index=0, rollout_id=0) for i, adv in enumerate((1.0, -1.0))]


def test_resume_restores_the_schedule_position(tmp_path):
    cfg = Config.model_validate({"train": {"lr": 1e-2, "lr_scheduler": "cosine", "warmup_steps": 1,
                                           "num_rollout": 6, "min_lr_ratio": 0.2},
                                 "algorithm": {"kl_coef": 0.0}})
    straight = Actor(tiny_model(), cfg, pad_token_id=0)
    lrs = [straight.train_rollout(rows(), r)["lr"] for r in range(6)]
    first = Actor(tiny_model(), cfg, pad_token_id=0)
    for r in range(3):
        first.train_rollout(rows(), r)
    path = first.save_checkpoint(tmp_path, 2, {"rollout_id": 2})
    resumed = Actor(tiny_model(), cfg, pad_token_id=0, load=path)
    assert resumed.scheduler.last_epoch == 3
    assert [resumed.train_rollout(rows(), r)["lr"] for r in range(3, 6)] == lrs[3:]
    assert lrs[-1] == pytest.approx(0.2 * 1e-2)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
