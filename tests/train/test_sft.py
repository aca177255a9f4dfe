"""SFT through the RL actor equals plain supervised learning on the response tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from memrl.config import TrainConfig, load_config
from memrl.tiny import build_tiny_model, build_tiny_tokenizer
from memrl.train.sft import SFTError, SFTOptions, demonstration_rows, mean_nll, run_sft, sft_config

WORDS = ["a", "b", "c", "d", "e", "f", "g", "h"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer(words=WORDS)


def _demos(tokenizer):
    ids = {w: tokenizer.convert_tokens_to_ids(w) for w in WORDS}
    eos = tokenizer.eos_token_id
    return [
        [([ids["a"], ids["b"], ids["c"]], [ids["d"], eos]), ([ids["e"], ids["f"]], [ids["g"], ids["h"], eos])],
        [([ids["h"], ids["g"], ids["f"], ids["e"]], [ids["a"], eos])],
    ]


def test_rows_put_loss_on_response_tokens_only(tokenizer):
    rows = demonstration_rows(_demos(tokenizer))
    assert [(r.trajectory_id, r.turn_index) for r in rows] == [("sft:0", 0), ("sft:0", 1), ("sft:1", 0)]
    for r, (prompt, response) in zip(rows, [t for d in _demos(tokenizer) for t in d], strict=True):
        assert r.tokens == prompt + response and r.prompt_length == len(prompt)
        assert r.loss_mask == [1] * len(response) and r.advantage == 1.0


def test_sft_gradient_is_the_token_mean_nll_gradient(tokenizer):
    """Through the actor (ratio 1, advantage 1, no KL), the step's gradient is that of the mean NLL."""
    from memrl.train.actor import Actor

    cfg = sft_config(load_config(None, ["train.grad_clip=1000"]), SFTOptions(lr=1e-2, warmup_steps=0))
    model = build_tiny_model(len(tokenizer), seed=3)
    reference = copy.deepcopy(model)
    demos = _demos(tokenizer)
    actor = Actor(model, cfg, pad_token_id=tokenizer.pad_token_id)
    actor.train_rollout(demonstration_rows(demos), rollout_id=0)

    reference.train()
    nll, count = 0.0, 0
    for prompt, response in (t for d in demos for t in d):
        logp = torch.log_softmax(reference(input_ids=torch.tensor([prompt + response])).logits[0].float(), -1)
        for k, token in enumerate(response):  # prompt positions carry no loss
            nll = nll - logp[len(prompt) + k - 1, token]
            count += 1
    (nll / count).backward()
    beta1 = cfg.train.adam_betas[0]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = actor.optimizer.state[p]["exp_avg"] / (1 - beta1)  # Adam's first moment after one step
        assert torch.allclose(grad, q.grad, atol=1e-6, rtol=1e-4), name


def test_run_sft_writes_metrics_and_model(tokenizer, tmp_path):
    history = run_sft(build_tiny_model(len(tokenizer)), tokenizer, load_config(None), _demos(tokenizer),
                      SFTOptions(epochs=2, batch_size=1, progress=False), out_dir=tmp_path)
    assert [h["step"] for h in history] == [0, 1, 2, 3] and "nll" in history[1] and "nll" in history[3]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert (tmp_path / "model" / "config.json").is_file()


def test_sft_lowers_the_nll(tokenizer):
    cfg = load_config(None)
    model = build_tiny_model(len(tokenizer), seed=0)
    history = run_sft(model, tokenizer, cfg, _demos(tokenizer) * 8,
                      SFTOptions(epochs=15, batch_size=16, lr=1e-2, warmup_steps=0, progress=False))
    nlls = [h["nll"] for h in history if "nll" in h]
    assert nlls[-1] < 0.5 * nlls[0]


def test_sft_config_turns_off_rl_terms():
    cfg = sft_config(load_config(None, ["algorithm.kl_coef=0.1", "sampling.temperature=0.7"]), SFTOptions(lr=5e-3))
    assert cfg.algorithm.kl_coef == 0 and cfg.sampling.temperature == 1.0 and cfg.train.lr == 5e-3
    assert cfg.algorithm.loss_agg == "token_mean"


def test_bad_inputs_are_refused(tokenizer):
    cfg = load_config(None)
    with pytest.raises(SFTError, match="no demonstrations"):
        run_sft(build_tiny_model(len(tokenizer)), tokenizer, cfg, [], SFTOptions(progress=False))
    with pytest.raises(SFTError, match="non-empty"):
        demonstration_rows([[([], [1])]])


@pytest.mark.parametrize(("options", "words"), [
    ({"lr": float("nan")}, "lr = nan: Input should be a finite number"), ({"lr": float("inf")}, "lr = inf"),
    ({"lr": 0.0}, "lr = 0.0: Input should be greater than 0"), ({"epochs": 0}, "epochs"),
    ({"batch_size": 0}, "batch_size"), ({"warmup_steps": -1}, "warmup_steps = -1"),
])
def test_options_that_cannot_train_are_refused_when_made(options, words):
    # Made before the model loads (`memrl sft`); lr=nan was a pydantic traceback from sft_config.
    with pytest.raises(SFTError, match=words):
        SFTOptions(**options)


def test_sft_config_turns_off_rollout_correction_and_gspo():
    """Demonstrations carry rollout log-probs of 0: a recipe's rollout_is / rollout_rs would weigh or drop
    every token of them by the model's own probability."""
    cfg = sft_config(load_config(None, ["algorithm.rollout_rs=token", "algorithm.rollout_is=sequence",
                                        "algorithm.credit=share", "algorithm.loss_mode=gspo"]), SFTOptions(lr=5e-3))
    assert cfg.algorithm.rollout_rs is None and cfg.algorithm.rollout_is is None
    assert cfg.algorithm.loss_mode == "vanilla"


def test_the_nll_probe_runs_a_token_budget_at_a_time(tokenizer, monkeypatch):
    """The probe never puts more than `micro_batch_tokens` padded tokens through one forward (32 long
    demonstrations at once took ~12 GB for a 135M model), and splitting changes the mean only by float
    rounding (a token-weighted mean over the micro-batches)."""
    import memrl.train.microbatch as microbatch

    model = build_tiny_model(len(tokenizer), seed=3)
    rows = demonstration_rows(_demos(tokenizer) * 4)
    whole = mean_nll(model, rows, tokenizer.pad_token_id, TrainConfig(micro_batch_tokens=10**6))
    sizes = []
    build = microbatch.MicroBatch.build
    monkeypatch.setattr(microbatch.MicroBatch, "build", lambda batch, *a, **k: sizes.append(
        len(batch) * max(len(r.tokens) for r in batch)) or build(batch, *a, **k))
    budget = 2 * max(len(r.tokens) for r in rows)
    split = mean_nll(model, rows, tokenizer.pad_token_id, TrainConfig(micro_batch_tokens=budget))
    assert len(sizes) > 1 and max(sizes) <= budget
    assert split == pytest.approx(whole, rel=1e-5)
