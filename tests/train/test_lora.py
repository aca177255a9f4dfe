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

from memrl.config import Config, ConfigError, config_from_dict  # noqa: E402
from memrl.train.actor import Actor  # noqa: E402
from memrl.train.checkpoint import CheckpointError  # noqa: E402
from memrl.train.export import export_to_hf  # noqa: E402
from memrl.types import TrainRow  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
VOCAB = 64


def base_model(seed=0, hidden_size=32):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2,
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


def lora_cfg(model_path=None, lora=None, **train):
    return Config.model_validate({
        "model": {"path": model_path, "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear", **(lora or {})}},
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
    out = export_to_hf(ckpt, tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in k for k in exported.state_dict())
    # Merged W + BA vs the adapter path W x + B(A x): float32 rounding apart.
    torch.testing.assert_close(logits_of(exported, IDS), logits_of(actor.model, IDS), atol=1e-5, rtol=1e-5)
    assert json.loads((out / "memrl_export.json").read_text())["rollout_id"] == 1
    built_in_code = Actor(base_model(), lora_cfg(), pad_token_id=0)  # no folder, no model.path: nothing to merge into
    with pytest.raises(CheckpointError, match="--base-model"):
        export_to_hf(built_in_code.save_checkpoint(tmp_path / "run2", 0, {"rollout_id": 0}), tmp_path / "m2")


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


# ----------------------------------------------------------------- adapters only on what they were trained with


def one_line_error(kind, call, match):
    with pytest.raises(kind, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_resume_with_another_rank_alpha_or_layers_is_refused_naming_the_checkpoints_value(tmp_path):
    # Another alpha loaded silently (every update scaled: another policy); another rank ended in peft's
    # size-mismatch traceback.
    path = Actor(base_model(), lora_cfg(), pad_token_id=0).save_checkpoint(tmp_path, 0, {"rollout_id": 0})
    for lora, match in (({"alpha": 16}, r"model.lora.alpha 8 vs 16 \(checkpoint vs this run\)"),
                        ({"rank": 8}, r"model.lora.rank 4 vs 8"),
                        ({"target_modules": ["q_proj", "v_proj"]},
                         r"target_modules 14 layers \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', "
                         r"'up_proj', 'v_proj'\] vs 4 layers \['q_proj', 'v_proj'\].*set model.lora as in the run")):
        one_line_error(CheckpointError, lambda lora=lora: Actor(base_model(), lora_cfg(lora=lora), pad_token_id=0,
                                                                 load=path), match)
    # The same scaling spelled another way (unset alpha: 2 x rank) resumes; so does another dropout, which
    # does not change what the saved weights mean.
    Actor(base_model(), lora_cfg(lora={"alpha": None}), pad_token_id=0, load=path)
    Actor(base_model(), lora_cfg(lora={"dropout": 0.1}), pad_token_id=0, load=path)


def test_a_resume_onto_another_base_is_refused_by_architecture_and_warned_about_by_weights(tmp_path):
    path = Actor(base_model(), lora_cfg(), pad_token_id=0).save_checkpoint(tmp_path, 0, {"rollout_id": 0})
    assert json.loads((path / "state.json").read_text())["lora_base"]["architecture"]["hidden_size"] == 32
    one_line_error(CheckpointError, lambda: Actor(base_model(hidden_size=48), lora_cfg(), pad_token_id=0, load=path),
                   r"another architecture .*hidden_size 32 vs 48")
    with pytest.warns(UserWarning, match="has other weights than the one the adapters"):
        Actor(base_model(seed=1), lora_cfg(), pad_token_id=0, load=path)


def test_target_modules_naming_nothing_are_refused_before_peft():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules = \[\]: .*adapts no layer"):
        config_from_dict({"model": {"lora": {"target_modules": []}}})
    # Config load cannot know the model's layers: the actor checks them as it builds the adapters, also an
    # entry misspelt beside a good one (which peft ignores).
    for targets in (["nosuchlayer"], ["q_proj", "nosuchlayer"], "layers\\.9\\..*", ["mlp"]):
        one_line_error(ConfigError, lambda t=targets: Actor(base_model(), lora_cfg(lora={"target_modules": t}),
                                                             pad_token_id=0),
                       r"names no layer of this model .*its layers: down_proj, embed_tokens, gate_proj, k_proj, "
                       r"lm_head, o_proj, q_proj, up_proj, v_proj")
    Actor(base_model(), lora_cfg(lora={"target_modules": ["self_attn.q_proj", "layers.1.mlp.up_proj"]}), pad_token_id=0)


def trained_from_folder(tmp_path, model_path="base"):
    """A LoRA checkpoint of a run whose model.path is `model_path` (a folder under the cwd, `tmp_path`)."""
    base_model().save_pretrained(tmp_path / model_path)
    cfg = lora_cfg(model_path=model_path)
    actor = Actor(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), cfg, pad_token_id=0)
    actor.train_rollout(make_rows(0), 0)
    return actor, actor.save_checkpoint(tmp_path / "run", 0, {"rollout_id": 0, "config": cfg})


def test_convert_to_hf_refuses_a_base_of_another_architecture_or_other_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    actor, ckpt = trained_from_folder(tmp_path)
    base_model(hidden_size=48).save_pretrained(tmp_path / "wider")
    base_model(seed=1).save_pretrained(tmp_path / "other")
    one_line_error(CheckpointError, lambda: export_to_hf(ckpt, tmp_path / "m1", base_model="wider"),
                   r"base model wider is another architecture .*hidden_size 32 vs 48")
    one_line_error(CheckpointError, lambda: export_to_hf(ckpt, tmp_path / "m2", base_model="other"),
                   r"base model other has the architecture but not the weights .*--allow-other-base")
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()
    with pytest.warns(UserWarning, match="whose weights differ"):
        out = export_to_hf(ckpt, tmp_path / "m3", base_model="other", allow_other_base=True)
    assert json.loads((out / "memrl_export.json").read_text())["base_model_checked"].startswith("architecture only")
    # The base it was trained on, in files of another dtype (the same values): the fingerprint matches.
    AutoModelForCausalLM.from_pretrained("base", dtype=torch.float32).to(torch.bfloat16).save_pretrained("bf16")
    bf16_values = AutoModelForCausalLM.from_pretrained("bf16", dtype=torch.float32)
    (tmp_path / "run2").mkdir()
    monkeypatch.chdir(tmp_path / "run2")
    as_bf16 = Actor(bf16_values, lora_cfg(model_path="../bf16"), pad_token_id=0).save_checkpoint(tmp_path / "r2", 0, {})
    AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).save_pretrained(tmp_path / "fp32")
    out = export_to_hf(as_bf16, tmp_path / "m4", base_model=str(tmp_path / "fp32"))
    assert json.loads((out / "memrl_export.json").read_text())["base_model_checked"].startswith("architecture and")


def test_convert_to_hf_finds_a_relative_model_path_from_another_folder_or_says_to_pass_base_model(tmp_path,
                                                                                                monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    actor, ckpt = trained_from_folder(tmp_path / "work", "models/base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out = export_to_hf(ckpt, tmp_path / "merged")
    export = json.loads((out / "memrl_export.json").read_text())
    assert export["base_model"] == str((tmp_path / "work" / "models" / "base").resolve())
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits_of(exported, IDS), logits_of(actor.model, IDS), atol=1e-5, rtol=1e-5)
    (tmp_path / "work" / "models").rename(tmp_path / "work" / "moved")
    one_line_error(CheckpointError, lambda: export_to_hf(ckpt, tmp_path / "m2"),
                   rf"the base model models/base of .*relative to {tmp_path / 'work'}.* "
                   r"is not found; pass --base-model")


@pytest.fixture
def quiet_weight_loading():
    # transformers draws a "Loading weights" bar on stderr, which CliRunner mixes into the output.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


def test_the_cli_says_what_convert_to_hf_checked_and_refuses_in_one_line(tmp_path, monkeypatch, quiet_weight_loading):
    from typer.testing import CliRunner

    from memrl.cli import app

    monkeypatch.chdir(tmp_path)
    _, ckpt = trained_from_folder(tmp_path)
    base_model(seed=1).save_pretrained(tmp_path / "other")
    result = CliRunner().invoke(app, ["convert-to-hf", str(ckpt), str(tmp_path / "m1"), "--base-model", "other"])
    assert result.exit_code == 2 and "not the weights" in result.output, result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output
    result = CliRunner().invoke(app, ["convert-to-hf", str(ckpt), str(tmp_path / "m2")])
    assert result.exit_code == 0, result.output
    assert f"merged into {tmp_path / 'base'}; checked: architecture and weights fingerprint match" in result.output
