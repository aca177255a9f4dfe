"""Padding-free micro-batches (train.packing): the same per-token log-probs and gradients as padded ones."""

import pytest
import torch
import transformers.masking_utils
from test_actor import make_rows, tiny_model

from memrl.config import Config
from memrl.train import packing
from memrl.train.actor import Actor
from memrl.train.microbatch import MicroBatch, response_log_probs
from memrl.train.partition import micro_batches

EPS = torch.finfo(torch.float32).eps
pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")


def close(got, want, ulps=256):
    """Packed and padded attention sum the same terms; only the reduction order differs (other sequence
    lengths block the products differently): a few hundred float32 roundings of the largest magnitude."""
    scale = max(float(want.abs().max()), 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=ulps * EPS * scale)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_log_probs_equal_padded_ones(attention):
    rows = make_rows(n_groups=3)
    model = tiny_model()
    model.config._attn_implementation = attention
    with torch.no_grad():
        padded = response_log_probs(model, MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu")), 0.8, 4)
        assert packing.enable(model) == packing.PACKED_ATTENTION
        mb = MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"), packed=True)
        packed = response_log_probs(model, mb, 0.8, 4)
    assert mb.input_ids.shape == (1, sum(len(r.tokens) for r in rows)) and mb.attention_mask is None
    assert mb.position_ids[0, : len(rows[0].tokens) + 1].tolist() == [*range(len(rows[0].tokens)), 0]
    close(packed, padded)


def test_packed_forward_builds_no_dense_mask(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a packed forward built a [tokens x tokens] mask")

    monkeypatch.setitem(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
                        packing.PACKED_ATTENTION, refuse)
    model = tiny_model()
    packing.enable(model)
    rows = make_rows()
    response_log_probs(model, MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"), packed=True), 1.0, 8)


def test_packed_batch_without_enable_is_refused():
    rows = make_rows()
    mb = MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"), packed=True)
    with pytest.raises(packing.PackingError, match="enable"):
        response_log_probs(tiny_model(), mb, 1.0, 8)


def test_an_enabled_model_still_runs_padded_batches_and_generates_alike():
    rows = make_rows()
    plain, enabled = tiny_model(), tiny_model()
    packing.enable(enabled)
    mb = MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"))
    with torch.no_grad():
        close(response_log_probs(enabled, mb, 1.0, 8), response_log_probs(plain, mb, 1.0, 8), ulps=16)
        ids = torch.tensor([rows[0].tokens])
        assert torch.equal(plain.generate(ids, max_new_tokens=4, do_sample=False),
                           enabled.generate(ids, max_new_tokens=4, do_sample=False))


def actor_grads(packed, rows, budget):
    cfg = Config.model_validate({"train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": budget,
                                           "packing": packed},
                                 "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.01}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    actor.optimizer.step = lambda *a, **k: None  # keep the gradient, skip the update
    metrics = actor.train_rollout(rows, rollout_id=0)
    return metrics, {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def test_packed_actor_step_matches_padded_one():
    rows = make_rows(n_groups=3)
    padded_metrics, padded = actor_grads(False, rows, 60)
    packed_metrics, packed = actor_grads(True, rows, 60)
    assert padded.keys() == packed.keys()
    for name in padded:
        close(packed[name], padded[name], ulps=1024)
    for key in ("loss/total", "entropy/mean", "kl/mean", "grad_norm"):
        assert packed_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-5, abs=1e-6), key
    assert packed_metrics["padding_fraction"] == 0.0 < padded_metrics["padding_fraction"]


def test_packed_budget_counts_real_tokens():
    rows = make_rows(n_groups=3)
    for budget in (30, 60, 200):
        for batch in micro_batches(rows, budget, packed=True):
            assert len(batch) == 1 or sum(len(r.tokens) for r in batch) <= budget
    # the padded budget (rows x longest) never fits more rows per micro-batch than the packed one
    counts = [(len(micro_batches(rows, b, packed=True)), len(micro_batches(rows, b))) for b in (30, 40, 60, 80)]
    assert all(p <= q for p, q in counts) and any(p < q for p, q in counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: torch's varlen flash kernel under bf16 autocast")
def test_packed_varlen_attention_on_cuda_matches_padded_sdpa():
    """Both attend in bf16 (flash kernels with different tilings): equal to a few bf16 roundings."""
    device = torch.device("cuda")
    rows = make_rows(n_groups=3)
    model = tiny_model().to(device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        padded = response_log_probs(model, MicroBatch.build(rows, [0.0] * len(rows), 0, device), 1.0, 8)
        packing.enable(model)
        packed = response_log_probs(model, MicroBatch.build(rows, [0.0] * len(rows), 0, device, packed=True), 1.0, 8)
    bf16 = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(packed, padded, rtol=0, atol=16 * bf16 * max(float(padded.abs().max()), 1.0))


def _torch_2_11_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1)):
    """torch 2.11's `varlen_attn` signature (no `enable_gqa`), computed per row on CPU."""
    assert window_size == (-1, 0) and k.shape[1] == q.shape[1]  # causal; that torch has no grouped-query attention
    bounds = torch.diff(cu_seq_q).tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1),
                                                             c.transpose(0, 1), is_causal=True, scale=scale)
            for a, b, c in zip(q.split(bounds), k.split(bounds), v.split(bounds), strict=True)]
    return torch.cat(outs, dim=1).transpose(0, 1)


def _torch_2_9_varlen(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    raise AssertionError("torch 2.9's varlen_attn takes no scale: the per-row sdpa must run instead")


def test_varlen_call_fits_the_installed_torchs_keywords():
    """The GPU machine's torch (2.11) has `varlen_attn` without `enable_gqa`: the call must use the keywords it
    has (repeating kv heads for grouped-query attention) and give the grouped result; torch 2.9's has no
    `scale`, so it is not called at all (None: the caller attends per row)."""
    torch.manual_seed(0)
    lengths = [3, 5, 2]
    q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)  # 4 query heads, 2 kv heads
    cu = torch.tensor([0, 3, 8, 10])
    out = packing.causal_varlen(_torch_2_11_varlen, q, k, v, cu, max(lengths), None)
    expected = [torch.nn.functional.scaled_dot_product_attention(a.transpose(0, 1), b.transpose(0, 1),
                                                                 c.transpose(0, 1), is_causal=True, enable_gqa=True)
                for a, b, c in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)]
    # Each output is a softmax-weighted mean of <= 5 value rows, so |out| <= max|v|; two float32 kernels may
    # sum in other orders: a few roundings (the exponentials, the normaliser, <= 5 terms) of max|v| each.
    atol = 8 * torch.finfo(torch.float32).eps * float(v.abs().max())
    torch.testing.assert_close(out, torch.cat(expected, dim=1).transpose(0, 1), rtol=0, atol=atol)
    assert packing.causal_varlen(_torch_2_9_varlen, q, k, v, cu, max(lengths), None) is None
