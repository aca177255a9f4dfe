"""LoRA (model.lora, memrl.train.lora): adapters trained, the reference is the base with adapters off,
engines get merged weights, checkpoints hold adapters and resume exactly, convert-to-hf merges."""

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

pytest.importorskip("peft")

from memrl.config import Config  # noqa: E402
from memrl.train.actor import Actor  # noqa: E402
from memrl.train.checkpoint import CheckpointError, convert_to_hf_command  # noqa: E402
from memrl.types import TrainRow  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
VOCAB = 64


def base_model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).float()


def make_rows(seed):
    rng = random.Random(seed)
    rows = []
    for s in range(4):
        p, r = rng.randint(3, 8), rng.randint(2, 5)
        rows.append(TrainRow(tokens=[rng.randrange(1, VOCAB) for _ in range(p + r)], response_length=r,
                             loss_mask=[1] * r, rollout_log_probs=[-rng.random() * 3 for _ in range(r)],
                             advantage=[1.0, -1.0, 0.5, -0.5][s], group_id="g", trajectory_id=f"t{s}",
                             turn_index=0, rollout_id=0))
    return rows


def lora_cfg(model_path=None, **train):
    return Config.model_validate({
        "model": {"path": model_path, "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"}},
        "train": {"lr": 5e-2, "grad_clip": 1e9, "num_rollout": 4, "lr_scheduler": "cosine", **train},
        "algorithm": {"kl_coef": 0.1}})


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[5, 9, 3, 17, 22, 8, 41]])


def test_only_adapters_train_and_the_reference_is_the_base_without_a_copy():
    base = base_model()
    reference_copy = base_model()  # the same starting weights, kept aside to compare with
    actor = Actor(base, lora_cfg(), pad_token_id=0)
    assert actor.ref_model is None  # no second copy of the weights
    trained = [p for group in actor.optimizer.param_groups for p in group["params"]]
    assert trained and all(p.requires_grad for p in trained)
    names = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert names and all(".lora_" in n for n in names)
    before = logits_of(actor.merged_model(), IDS)
    for r in range(2):
        metrics = actor.train_rollout(make_rows(r), r)
    assert metrics["kl/mean"] > 0  # the policy moved away from its reference
    after = logits_of(actor.merged_model(), IDS)
    assert not torch.allclose(before, after, atol=1e-4)
    # The reference forward is the untouched base model's.
    with actor.peft.disable_adapter():
        torch.testing.assert_close(logits_of(actor.model, IDS), logits_of(reference_copy, IDS), atol=1e-6, rtol=0)
    # The engine's weights (merged) give the policy's own outputs (adapters applied).
    torch.testing.assert_close(logits_of(actor.model, IDS), after, atol=1e-5, rtol=1e-5)
    assert set(actor.policy_weights()) == set(reference_copy.state_dict())


def test_a_lora_run_resumes_exactly_from_its_adapter_checkpoint(tmp_path):
    cfg = lora_cfg()
    straight = Actor(base_model(), cfg, pad_token_id=0)
    straight_metrics = [straight.train_rollout(make_rows(r), r) for r in range(4)]
    first = Actor(base_model(), cfg, pad_token_id=0)
    for r in range(2):
        first.train_rollout(make_rows(r), r)
    path = first.save_checkpoint(tmp_path, 1, {"rollout_id": 1})
    files = {p.name for p in (path / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert not any(name.startswith("model") and name.endswith(".safetensors") for name in files)  # no base copy
    resumed = Actor(base_model(), cfg, pad_token_id=0, load=path)
    resumed_metrics = [resumed.train_rollout(make_rows(r), r) for r in range(2, 4)]
    for key in ("lr", "loss/total", "kl/mean", "grad_norm"):
        assert [m[key] for m in straight_metrics[2:]] == pytest.approx([m[key] for m in resumed_metrics],
                                                                       rel=1e-5, abs=1e-7), key
    a, b = straight.policy_weights(), resumed.policy_weights()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    # A LoRA checkpoint into a model without adapters is refused by name.
    plain = Config.model_validate({"algorithm": {"kl_coef": 0.0}})
    with pytest.raises(CheckpointError, match="LoRA adapters"):
        Actor(base_model(), plain, pad_token_id=0, load=path)


def test_convert_to_hf_merges_adapters_into_a_model_with_the_policys_outputs(tmp_path):
    base_dir = tmp_path / "base"
    base_model().save_pretrained(base_dir)
    cfg = lora_cfg(model_path=str(base_dir))
    actor = Actor(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), cfg, pad_token_id=0)
    for r in range(2):
        actor.train_rollout(make_rows(r), r)
    ckpt = actor.save_checkpoint(tmp_path / "run", 1, {"rollout_id": 1, "config": cfg})
    out = convert_to_hf_command(ckpt, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in k for k in exported.state_dict())
    # Merged W + BA vs the adapter path W x + B(A x): float32 rounding apart.
    torch.testing.assert_close(logits_of(exported, IDS), logits_of(actor.model, IDS), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "memrl_export.json").read_text())["rollout_id"] == 1
    with pytest.raises(CheckpointError, match="--base-model"):
        convert_to_hf_command(actor.save_checkpoint(tmp_path / "run2", 0, {"rollout_id": 0}), tmp_path / "m2")


def test_a_lora_training_run_syncs_merged_weights_to_its_engine(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_controller import config, make_trainer

    from memrl.tiny import build_tiny_tokenizer

    raw = config(num_rollout=2).model_dump(mode="json")
    raw["model"]["lora"] = {"rank": 4}
    trainer = make_trainer(build_tiny_tokenizer(), tmp_path / "run", Config.model_validate(raw))
    history = trainer.run()
    assert [m["rows/consumed"] for m in history] == [32, 32]
    engine_weights = trainer.parts.rollout.engine.model.state_dict()
    policy = trainer.parts.policy.policy_weights()
    assert set(engine_weights) == set(policy)
    for name, value in policy.items():
        torch.testing.assert_close(engine_weights[name].float(), value.float(), atol=0, rtol=0, msg=name)
    assert (tmp_path / "run" / "checkpoints" / "iter_0000001" / "model" / "adapter_model.safetensors").is_file()


def test_the_supervised_warm_start_trains_every_weight_whatever_model_lora_says():
    from memrl.train.sft import SFTOptions, sft_config

    assert sft_config(lora_cfg(), SFTOptions()).model.lora is None
