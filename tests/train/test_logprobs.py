"""Chunked, recomputed log-probs and entropy (memrl.train.logprobs) against the one big [tokens x vocab] pass.

Tolerances: the chunked path does the same float32 arithmetic per token; only the matrix products may be
blocked differently, so results differ by a few roundings of the largest magnitude involved (log-sum-exp
over the vocabulary, or a gradient summed over tokens): a small multiple of float32's epsilon times that.
"""

import pytest
import torch
from test_actor import make_rows, tiny_model

from memrl.config import Config
from memrl.train.actor import Actor
from memrl.train.logprobs import response_token_stats

EPS = torch.finfo(torch.float32).eps
pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")


def close(got: torch.Tensor, want: torch.Tensor, ulps: float = 64) -> None:
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=ulps * EPS * scale)


def head_and_inputs(n=37, hidden=16, vocab=300, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=g))
    h = torch.randn(n, hidden, generator=g)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return head, h, targets


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_chunked_values_and_gradients_match_the_whole_pass(chunk, temperature):
    results = {}
    for name, c in (("whole", None), ("chunked", chunk)):
        head, h, targets = head_and_inputs()
        h.requires_grad_(True)
        stats = response_token_stats(h, targets, head, temperature, c)
        # weights of both outputs, as the loss (PPO term + entropy bonus) gives them
        g = torch.Generator().manual_seed(1)
        w_lp, w_ent = torch.randn(len(targets), generator=g), torch.randn(len(targets), generator=g)
        ((stats.log_probs * w_lp).sum() + (stats.entropy * w_ent).sum()).backward()
        results[name] = (stats.log_probs.detach(), stats.entropy.detach(), h.grad, head.weight.grad)
    for got, want in zip(results["chunked"], results["whole"], strict=True):
        close(got, want)
    # and the whole pass is what it claims: log_softmax of the tempered logits
    head, h, targets = head_and_inputs()
    logits = head(h) / (temperature if temperature > 0 else 1.0)
    close(results["whole"][0], torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets].detach())
    close(results["whole"][1], torch.distributions.Categorical(logits=logits).entropy().detach())


def run_both(chunk, use=(1.0, 1.0), bias=False, autocast=False):
    """(log-probs, entropy, grad of hidden, of the weight, of the bias) for `chunk`, the loss weighting
    log-probs and entropy by `use` (0 = that output takes no part in the loss)."""
    head, h, targets = head_and_inputs(bias=bias)
    h.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        stats = response_token_stats(h, targets, head, 0.9, chunk)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(len(targets), generator=g), torch.randn(len(targets), generator=g)
    loss = sum(((out * w).sum() for out, w, u in ((stats.log_probs, w_lp, use[0]), (stats.entropy, w_ent, use[1]))
                if u), torch.zeros(()))
    loss.backward()
    return [stats.log_probs.detach(), stats.entropy.detach(), h.grad, head.weight.grad,
            head.bias.grad if bias else torch.zeros(1)]


@pytest.mark.parametrize("use", [(1.0, 0.0), (0.0, 1.0)])
def test_either_output_alone_gets_the_same_gradients(use):
    for got, want in zip(run_both(4, use), run_both(None, use), strict=True):
        close(got, want)


def test_a_head_with_bias_gets_the_same_gradients():
    for got, want in zip(run_both(4, bias=True), run_both(None, bias=True), strict=True):
        close(got, want)


def test_bf16_autocast_matches_the_whole_pass_to_bf16_rounding():
    """Under autocast both paths multiply in bf16 and do the rest in float32; the products' own roundings
    (8 bits of mantissa) differ with the blocking, so the bound is a few bf16 epsilons."""
    got, want, fp32 = run_both(4, autocast=True), run_both(None, autocast=True), run_both(None)
    bf16 = torch.finfo(torch.bfloat16).eps
    for g, w, f in zip(got[:4], want[:4], fp32[:4], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=8 * bf16 * max(float(w.abs().max()), 1.0))
        # and the product really ran in bf16: far closer to the bf16 whole pass than float32 is
        assert float((g - w).abs().max()) <= 0.5 * float((f - w).abs().max())


def test_chunked_forward_keeps_no_vocabulary_sized_tensor_for_the_backward():
    """What the graph holds between forward and backward: [tokens x vocab] without chunks, nothing that
    large with them (the chunk's logits are recomputed in the backward)."""
    def largest_saved(chunk):
        head, h, targets = head_and_inputs(n=64, vocab=500)
        h.requires_grad_(True)
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stats = response_token_stats(h, targets, head, 1.0, chunk)
        stats.log_probs.sum().backward()
        return max(sizes)

    assert largest_saved(None) >= 64 * 500
    assert largest_saved(8) == 500 * 16  # the head's weight is the largest thing kept


def test_no_grad_chunks_match_and_build_no_graph():
    head, h, targets = head_and_inputs()
    with torch.no_grad():
        whole = response_token_stats(h, targets, head, 1.0, None)
        chunked = response_token_stats(h, targets, head, 1.0, 4)
    assert chunked.log_probs.grad_fn is None
    close(chunked.log_probs, whole.log_probs)
    close(chunked.entropy, whole.entropy)


def test_log_probs_only_skip_the_entropy_and_keep_the_log_prob_gradients():
    results = []
    for with_entropy in (True, False):
        head, h, targets = head_and_inputs()
        h.requires_grad_(True)
        stats = response_token_stats(h, targets, head, 1.0, 4, with_entropy=with_entropy)
        stats.log_probs.sum().backward()
        results.append((stats, h.grad))
    (full, full_grad), (lean, lean_grad) = results
    assert torch.isnan(lean.entropy).all() and not lean.entropy.requires_grad
    close(lean.log_probs.detach(), full.log_probs.detach())
    close(lean_grad, full_grad)


def test_no_response_tokens_give_empty_results():
    head, h, targets = head_and_inputs(n=0)
    stats = response_token_stats(h, targets, head, 1.0, 4)
    assert stats.log_probs.shape == (0,) and stats.entropy.shape == (0,)


def test_non_positive_chunk_is_refused_with_the_option_named():
    head, h, targets = head_and_inputs()
    with pytest.raises(ValueError, match="train.logprob_chunk_tokens"):
        response_token_stats(h, targets, head, 1.0, 0)


def test_config_refuses_a_zero_chunk_and_accepts_unset():
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        Config.model_validate({"train": {"logprob_chunk_tokens": 0}})
    assert Config.model_validate({"train": {"logprob_chunk_tokens": None}}).train.logprob_chunk_tokens is None


def actor_step(chunk, rows, **algorithm):
    cfg = Config.model_validate({
        "train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": 40, "logprob_chunk_tokens": chunk},
        "sampling": {"temperature": 0.8},
        "algorithm": {"kl_coef": 0.0, **algorithm}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    actor.optimizer.step = lambda *a, **k: None  # keep the gradient, skip the update
    metrics = actor.train_rollout(rows, rollout_id=0)
    return metrics, {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("algorithm", [{}, {"kl_coef": 0.1, "entropy_coef": 0.01}])
def test_actor_loss_gradients_and_metrics_match_the_whole_pass(algorithm):
    """The whole actor step (PPO term, KL against the reference, entropy bonus; tied embeddings as in
    Qwen3-0.6B, so the LM head's gradient adds to the embeddings') with 3-token chunks vs none."""
    rows = make_rows()
    whole_metrics, whole = actor_step(None, rows, **algorithm)
    chunked_metrics, chunked = actor_step(3, rows, **algorithm)
    assert tiny_model().config.tie_word_embeddings and whole.keys() == chunked.keys()
    for name in whole:
        close(chunked[name], whole[name], ulps=256)
    for key in ("loss/total", "loss/policy", "entropy/mean", "kl/mean", "grad_norm"):
        assert chunked_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-5, abs=1e-6), key
