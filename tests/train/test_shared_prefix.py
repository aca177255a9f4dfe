"""Shared-prefix micro-batches (train.share_prefixes, memrl.train.shared_prefix): what a group's rows share is
computed once, and every log-prob, entropy, KL, loss and gradient equals the unshared computation's.

Tolerances. Shared and unshared runs sum the same float32 terms in another order: the prefix's keys and
values meet each suffix in another attention call (another key length, so other kernel blocks), and a prefix
position's gradient is one sum over every suffix instead of one per row, added into the weight gradients in
another grouping. Every dot product of K terms may round differently by about sqrt(K) eps |terms| (errors
add as a random walk, Higham §3.1; tests/engines/numerics.py), each of the L layers and the LM head adds its
own, and a log-prob moves by at most twice its logits' error:

    log-probs: 2 eps max|logit| (L + 1) sqrt(K),  K = the longest sum: max(hidden, intermediate, tokens)

An entropy moves by at most 2 H <= 2 log V times that logit error; a gradient is a sum over the K token
positions of a micro-batch of terms no larger than its largest per-row part, with the same error per layer,
and rows of opposite advantages cancel, so its scale is the tensor's summed per-row magnitude, taken here as
its largest entry times the rows (measured: shared and unshared gradients differ by <= 10 float32 ulps of the
largest entry, the bound allows ~2,700; log-probs differ by ~2% of theirs). A broken sharing (a suffix not
seeing the prefix, the prefix's gradient lost or doubled, shifted positions) fails every equality test here.
"""

from __future__ import annotations

import dataclasses
import math
import random
from datetime import timedelta

import pytest
import torch
from test_actor import VOCAB, make_rows, tiny_model
from test_fsdp import _free_port
from torch.distributed.tensor import DTensor

from memrl.config import Config
from memrl.train import packing, shared_prefix
from memrl.train.actor import Actor
from memrl.train.microbatch import MicroBatch, ResponseStats
from memrl.train.partition import micro_batches, plan_rollout, split_ranks
from memrl.train.shared_prefix import computed_tokens, prefix_clusters
from memrl.types import TrainRow

EPS = torch.finfo(torch.float32).eps
MIN = 8  # share_prefix_min_tokens of these tests: short rows keep the tiny model fast
pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")


def group_rows(layout: str, n_groups: int = 2, n: int = 3, chunks: int = 2, chunk_tokens: int = 28,
               seed: int = 0) -> list[TrainRow]:
    """MemAgent-like rows, one per turn: each group has its instructions + question (`head`) and document
    chunks; a memory turn's prompt is head + memory + chunk (`memagent`) or head + chunk + memory
    (`chunk_first`), its response the next memory; the final turn's prompt is head + memory. So at turn 0
    a group's n rows share their whole prompt, later they share the head (memagent) or head + chunk. The
    chunk is over twice the head, so both of the attention's ways to attend to a prefix run."""
    rng = random.Random(seed)

    def ids(k):
        return [rng.randrange(1, VOCAB) for _ in range(k)]

    rows = []
    for g in range(n_groups):
        head, document = ids(12), [ids(chunk_tokens) for _ in range(chunks)]
        for s in range(n):
            memory, advantage = [3, 4], rng.uniform(-1, 1)  # the empty memory's tokens
            for turn in range(chunks + 1):
                if turn < chunks:
                    prompt = head + (memory + document[turn] if layout == "memagent" else document[turn] + memory)
                else:
                    prompt = head + memory
                response = ids(rng.randint(1, 6))
                mask = [1] * len(response)
                if len(response) > 2:
                    mask[0] = 0  # a masked-out response token carries no gradient
                rows.append(TrainRow(tokens=prompt + response, response_length=len(response), loss_mask=mask,
                                     rollout_log_probs=[-rng.random() * 3 for _ in response], advantage=advantage,
                                     group_id=f"g{g}", trajectory_id=f"g{g}s{s}", turn_index=turn, rollout_id=0))
                memory = response
    return rows


def depth_width(model, tokens: int) -> tuple[int, int]:
    cfg = model.config
    return cfg.num_hidden_layers + 1, max(cfg.hidden_size, cfg.intermediate_size, tokens)


def logprob_atol(model, tokens: int, max_logit: float) -> float:
    depth, width = depth_width(model, tokens)
    return 2 * EPS * max(max_logit, 1.0) * depth * math.sqrt(width)


def assert_grads_close(got: dict, want: dict, model, tokens: int, rows: int) -> None:
    depth, width = depth_width(model, tokens)
    assert got.keys() == want.keys()
    for name in want:
        scale = rows * max(float(want[name].abs().max()), EPS)
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2 * EPS * depth * math.sqrt(width) * scale,
                                   msg=name)


# --------------------------------------------------------------------------- clusters and layout


def test_clusters_find_what_a_group_shares():
    rows = group_rows("memagent", n_groups=2, n=3, chunks=2)
    clusters = prefix_clusters(rows, MIN)
    cluster_of = {i: c for c in clusters for i in c.members}
    for c in clusters:
        members = [rows[i] for i in c.members]
        assert len({r.group_id for r in members}) == 1  # the groups' heads differ
        if len(members) > 1:
            assert c.shared <= min(r.prompt_length for r in members) - 1
            assert all(r.tokens[:c.shared] == members[0].tokens[:c.shared] for r in members)
    for key in {(r.group_id, r.turn_index) for r in rows}:  # a group's rows of one turn share >= the head
        (c,) = {cluster_of[i] for i, r in enumerate(rows) if (r.group_id, r.turn_index) == key}
        assert len(c.members) >= 3 and c.shared >= 12
        if key[1] == 0:  # turn 0: the whole prompt but its last token (the later turns share only the head)
            assert c.shared == rows[c.members[0]].prompt_length - 1 and len(c.members) == 3
    assert sorted(i for c in clusters for i in c.members) == list(range(len(rows)))
    # the same clusters whatever order the rows come in
    order = list(range(len(rows)))
    random.Random(1).shuffle(order)
    shuffled = prefix_clusters([rows[i] for i in order], MIN)
    assert sorted((tuple(sorted(order[i] for i in c.members)), c.shared) for c in shuffled) == \
        sorted((c.members, c.shared) for c in clusters)


def test_clusters_prefer_the_longer_shared_prefix_and_respect_the_minimum():
    common = list(range(1, 11))  # 10 tokens every row starts with
    a, b = [*common, *range(20, 40)], [*common, *range(40, 60)]

    def row(tokens):
        return TrainRow(tokens=[*tokens, 7], response_length=1, loss_mask=[1], rollout_log_probs=[-1.0], advantage=1.0,
                        group_id="g", trajectory_id="t", turn_index=0, rollout_id=0)

    rows = [row(a), row(b), row(a), row(b), row([*a[:25], 9, 9])]
    clusters = prefix_clusters(rows, MIN)
    # a's rows share 30 tokens (a whole prompt less one: 29), b's too: better than all five sharing 10
    assert sorted((c.members, c.shared) for c in clusters) == [((0, 2, 4), 25), ((1, 3), 29)]
    assert [c.members for c in prefix_clusters(rows, 30)] == [(0,), (1,), (2,), (3,), (4,)]
    assert computed_tokens([31, 31, 28], 25) == 31 + 6 + 3


def test_shared_layout_holds_each_prefix_once_with_each_rows_positions():
    rows = group_rows("chunk_first", n_groups=1, n=3, chunks=1)
    mb = MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"), share_min=MIN)
    clusters = prefix_clusters(rows, MIN)
    assert mb.input_ids.shape == (1, sum(computed_tokens([len(rows[i].tokens) for i in c.members], c.shared)
                                         for c in clusters))
    assert mb.shared_layout == tuple((c.shared, tuple(len(rows[i].tokens) - c.shared for i in c.members))
                                     for c in clusters)
    # every response position and target, read back from the one sequence, is the row's own
    ids, positions = mb.input_ids[0].tolist(), mb.position_ids[0].tolist()
    for (line, at), target, (b, k) in zip(mb.positions.tolist(), mb.targets.tolist(), mb.resp_index.tolist(),
                                          strict=True):
        row = rows[b]
        assert line == 0 and positions[at] == row.prompt_length + k - 1
        assert ids[at] == row.tokens[row.prompt_length + k - 1] and target == row.tokens[row.prompt_length + k]


# --------------------------------------------------------------------------- equality with the unshared pass


@pytest.mark.parametrize("prefix", [0, 5, 20])
def test_attention_equals_each_row_attended_whole(prefix):
    """Suffixes shorter and longer than twice the prefix (an explicit mask, or the prefix's queries again):
    outputs and the gradients of query, key and value equal causal attention over each whole row."""
    suffixes = (3, 9, 50)
    total = prefix + sum(suffixes)
    gen = torch.Generator().manual_seed(prefix)
    q, k, v = (torch.randn(1, h, total, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    got = shared_prefix.attention(q, k, v, ((prefix, suffixes),), None, True)
    weight = torch.randn(got.shape, generator=gen)
    got_grads = torch.autograd.grad((got * weight).sum(), (q, k, v))
    rows, at = [], prefix
    for s in suffixes:  # each row whole: the prefix, then its suffix
        rows.append([torch.cat([x[:, :, :prefix], x[:, :, at:at + s]], dim=2) for x in (q, k, v)])
        at += s
    outs = [torch.nn.functional.scaled_dot_product_attention(*row, is_causal=True, enable_gqa=True).transpose(1, 2)
            for row in rows]
    want = torch.cat([outs[0][:, :prefix], *(o[:, prefix:] for o in outs)], dim=1)
    # the prefix's outputs once (row 0's); its keys and values get every row's gradient
    want_grads = torch.autograd.grad((want * weight).sum(), (q, k, v))
    # softmax-weighted sums of <= 70 values of order 1: a few dozen float32 roundings
    atol = 2 * EPS * math.sqrt(total) * 8
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=len(suffixes) * atol)



def stats_and_grads(model, mb, coef_lp, coef_ent):
    """Log-probs, entropy and the gradient of a fixed combination of them, on the response tokens of `mb`."""
    model.zero_grad()
    stats = ResponseStats(model, 0.8, 4)(*mb.inputs())
    lp, ent = mb.scatter(stats.log_probs), mb.scatter(stats.entropy)
    ((lp * coef_lp).sum() + (ent * coef_ent).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["memagent", "chunk_first"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_log_probs_entropy_and_gradients_equal_the_unshared_pass(layout, packed):
    assert_shared_pass_equals_unshared(layout, packed, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the shared attention's sdpa calls on a GPU")
@pytest.mark.parametrize("layout", ["memagent", "chunk_first"])
def test_shared_prefix_on_cuda_equals_the_unshared_pass(layout):
    """float32 on the GPU (no TF32: torch's default for float32 matmuls): the same bound as on the CPU."""
    assert_shared_pass_equals_unshared(layout, False, torch.device("cuda"))


def assert_shared_pass_equals_unshared(layout: str, packed: bool, device: torch.device) -> None:
    rows = group_rows(layout)
    model = tiny_model().to(device)
    packing.enable(model)
    weights = [0.0] * len(rows)
    unshared = MicroBatch.build(rows, weights, 0, device, packed=packed)
    shared = MicroBatch.build(rows, weights, 0, device, packed=packed, share_min=MIN)
    assert shared.shared_layout is not None and unshared.shared_layout is None
    ways = {s > 2 * p for p, suffixes in shared.shared_layout if p for s in suffixes}  # the attention's two ways
    assert ways == ({True, False} if layout == "memagent" else {False})
    assert shared.input_ids.numel() < 0.8 * sum(len(r.tokens) for r in rows)
    gen = torch.Generator().manual_seed(0)
    coef_lp, coef_ent = (torch.randn(unshared.loss_mask.shape, generator=gen).to(device) for _ in range(2))
    want_lp, want_ent, want_grads = stats_and_grads(model, unshared, coef_lp, coef_ent)
    got_lp, got_ent, got_grads = stats_and_grads(model, shared, coef_lp, coef_ent)
    with torch.no_grad():
        max_logit = float(model(input_ids=torch.tensor([rows[0].tokens], device=device)).logits.abs().max())
    tokens = max(shared.input_ids.numel(), unshared.input_ids.numel())
    atol = logprob_atol(model, tokens, max_logit)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=atol)
    torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=2 * math.log(VOCAB) * atol)
    assert_grads_close(got_grads, want_grads, model, tokens, len(rows))


def test_a_llama_packs_and_shares_too():
    """Llama's model takes no {layer type: mask} mapping: packed and shared forwards pass it a prepared 4-D
    placeholder instead, and equal the padded pass as Qwen3's do."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    packing.enable(model)
    rows = group_rows("memagent")
    weights = [0.0] * len(rows)
    gen = torch.Generator().manual_seed(0)
    built = {name: MicroBatch.build(rows, weights, 0, torch.device("cpu"), **kw)
             for name, kw in {"padded": {}, "packed": {"packed": True}, "shared": {"share_min": MIN}}.items()}
    coef_lp, coef_ent = (torch.randn(built["padded"].loss_mask.shape, generator=gen) for _ in range(2))
    want_lp, _, want_grads = stats_and_grads(model, built["padded"], coef_lp, coef_ent)
    with torch.no_grad():
        max_logit = float(model(input_ids=torch.tensor([rows[0].tokens])).logits.abs().max())
    tokens = built["padded"].input_ids.numel()
    for name in ("packed", "shared"):
        got_lp, _, got_grads = stats_and_grads(model, built[name], coef_lp, coef_ent)
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=logprob_atol(model, tokens, max_logit), msg=name)
        assert_grads_close(got_grads, want_grads, model, tokens, len(rows))


def actor_step(rows, share, packed=False, budget=10_000, lora=False, **train):
    """One optimizer step's metrics and gradients (the update skipped), KL and entropy terms on."""
    cfg = Config.model_validate({
        "train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": budget, "packing": packed,
                  "share_prefixes": share, "share_prefix_min_tokens": MIN, **train},
        "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.01},
        **({"model": {"lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"}}} if lora else {})})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    if actor.ref_model is not None:  # a reference away from the policy: the KL and its gradient are not 0
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in actor.ref_model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    actor.optimizer.step = lambda *a, **k: None  # keep the gradient, skip the update
    metrics = actor.train_rollout(rows, rollout_id=0)
    return metrics, {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}


def assert_same_step(shared, unshared, rows, tokens):
    (m_s, g_s), (m_u, g_u) = shared, unshared
    assert_grads_close(g_s, g_u, tiny_model(), tokens, len(rows))
    for key in ("loss/total", "loss/policy", "entropy/mean", "kl/mean", "grad_norm", "tokens/loss"):
        scale = max(abs(m_u[key]), 1.0)
        assert m_s[key] == pytest.approx(m_u[key], rel=0, abs=1e3 * EPS * scale), key
    assert m_u["computed_fraction"] == 1.0 and m_s["computed_fraction"] < 0.9


@pytest.mark.parametrize("layout", ["memagent", "chunk_first"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_actor_step_equals_the_unshared_step(layout, packed):
    rows = group_rows(layout)
    tokens = sum(len(r.tokens) for r in rows)
    assert_same_step(actor_step(rows, True, packed), actor_step(rows, False, packed), rows, tokens)


def test_a_group_split_across_micro_batches_gives_the_same_step():
    rows = group_rows("chunk_first", n_groups=2, n=4)
    budget = 60  # less than a turn's four rows even shared: clusters are cut across micro-batches
    plan = plan_rollout(rows, Config.model_validate({"train": {"micro_batch_tokens": budget,
                                                               "share_prefix_min_tokens": MIN}}), 0, 0)
    batches = plan[0][0].micro_batches
    split = [key for key in {(r.group_id, r.turn_index) for r in rows}
             if sum(any((r.group_id, r.turn_index) == key for r in mb) for mb in batches) > 1]
    assert split and any(len(prefix_clusters(mb, MIN)) < len(mb) for mb in batches)  # split, and still sharing
    shared, unshared = actor_step(rows, True, budget=budget), actor_step(rows, False, budget=budget)
    assert shared[0]["micro_batches"] > 1
    assert_same_step(shared, unshared, rows, sum(len(r.tokens) for r in rows))


def test_lora_step_equals_the_unshared_step():
    pytest.importorskip("peft")
    rows = group_rows("memagent")
    shared, unshared = actor_step(rows, True, lora=True), actor_step(rows, False, lora=True)
    assert shared[1] and all("lora" in name for name in shared[1])  # only the adapters train
    assert_same_step(shared, unshared, rows, sum(len(r.tokens) for r in rows))


def test_gradient_checkpointing_step_equals_the_unshared_step():
    rows = group_rows("chunk_first")
    assert_same_step(actor_step(rows, True, gradient_checkpointing=True), actor_step(rows, False), rows,
                     sum(len(r.tokens) for r in rows))


# --------------------------------------------------------------------------- nothing shared: today's path


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_micro_batches_sharing_nothing_run_todays_path_bit_for_bit(packed):
    rows = make_rows(n_groups=3)  # prompts of 3-12 random tokens: nothing shared
    assert all(len(c.members) == 1 for c in prefix_clusters(rows, MIN))
    built = [MicroBatch.build(rows, [0.0] * len(rows), 0, torch.device("cpu"), packed, share) for share in (MIN, None)]
    for a, b in zip(dataclasses.astuple(built[0]), dataclasses.astuple(built[1]), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b  # the same micro-batch, no layout
    shared, unshared = actor_step(rows, True, packed, budget=60), actor_step(rows, False, packed, budget=60)
    assert shared[1].keys() == unshared[1].keys()
    for name in unshared[1]:
        assert torch.equal(shared[1][name], unshared[1][name]), name
    assert {k: v for k, v in shared[0].items() if not k.startswith(("time/", "perf/"))} == \
        {k: v for k, v in unshared[0].items() if not k.startswith(("time/", "perf/"))}
    # and the plan itself is the one without sharing
    cfgs = [Config.model_validate({"train": {"micro_batch_tokens": 60, "packing": packed, "dp_size": 2,
                                             "pad_to_dp": True, "share_prefixes": s}}) for s in (True, False)]
    plans = [[[[["pad" if r.is_padding else id(r) for r in mb] for mb in share.micro_batches] for share in step]
              for step in plan_rollout(rows, c, 0, 0)] for c in cfgs]
    assert plans[0] == plans[1]


# --------------------------------------------------------------------------- the planner


def test_planner_keeps_a_groups_turn_together_and_counts_computed_tokens():
    rows = group_rows("chunk_first", n_groups=3, n=4)
    clusters = prefix_clusters(rows, MIN)
    cost = {c.members: computed_tokens([len(rows[i].tokens) for i in c.members], c.shared) for c in clusters}
    budget = max(cost.values()) + 10
    batches = micro_batches(rows, budget, share_min=MIN)
    where = {id(r): k for k, mb in enumerate(batches) for r in mb}
    for c in clusters:  # each cluster fits the budget: it stays in one micro-batch
        assert len({where[id(rows[i])] for i in c.members}) == 1
    for mb in batches:
        built = MicroBatch.build(mb, [0.0] * len(mb), 0, torch.device("cpu"), share_min=MIN)
        assert built.input_ids.numel() <= budget  # computed tokens, each prefix once
    # fewer micro-batches than counting every row whole
    assert len(batches) < len(micro_batches(rows, budget, packed=True))
    # on two ranks: equal row counts, each cluster on one rank (row counts allow it here: clusters of 4)
    ranks = split_ranks(rows, 2, False, 0, 0, share_min=MIN)
    assert len(ranks[0]) == len(ranks[1])
    rank_of = {id(r): k for k, rank in enumerate(ranks) for r in rank}
    assert all(len({rank_of[id(rows[i])] for i in c.members}) == 1 for c in clusters)


def test_planner_cuts_a_cluster_only_where_no_rank_has_room():
    rows = group_rows("memagent", n_groups=1, n=3, chunks=1)  # turn 0's three rows share, the final's three too
    clusters = [{id(rows[i]) for i in c.members} for c in prefix_clusters(rows, MIN)]
    assert sorted(map(len, clusters)) == [3, 3]
    two = split_ranks(rows, 2, False, 0, 0, share_min=MIN)  # 3 rows per rank: a cluster each
    assert sorted({id(r) for r in rank} in clusters for rank in two) == [True, True]
    four = split_ranks(rows, 4, True, 0, 0, share_min=MIN)  # 8 rows with padding, 2 per rank: cut
    assert [len(rank) for rank in four] == [2, 2, 2, 2]
    assert sorted(id(r) for rank in four for r in rank if not r.is_padding) == sorted(map(id, rows))


def test_plan_does_not_depend_on_the_order_groups_arrive_in():
    rows = group_rows("memagent", n_groups=3, n=3)
    cfg = Config.model_validate({"train": {"micro_batch_tokens": 120, "dp_size": 2, "pad_to_dp": True,
                                           "share_prefix_min_tokens": MIN}})
    groups = sorted({r.group_id for r in rows}, reverse=True)
    reordered = [r for g in groups for r in rows if r.group_id == g]

    def key(plan):
        return [[[[(r.trajectory_id, r.turn_index) for r in mb] for mb in share.micro_batches] for share in step]
                for step in plan]

    assert key(plan_rollout(reordered, cfg, 0, 0)) == key(plan_rollout(rows, cfg, 0, 0))


def test_a_one_token_prompt_shares_nothing():
    # its one prompt token is the position that predicts its first response token: no prefix to share
    row = group_rows("memagent")[0]
    one = dataclasses.replace(row, tokens=[row.tokens[0], *row.tokens[row.prompt_length:]])
    assert [c.shared for c in prefix_clusters([one, one], 1)] == [0, 0]


# --------------------------------------------------------------------------- data-parallel ranks


WORLD = 2


def _rank_main(rank: int, port: int) -> None:
    """One of two gloo ranks: DDP and FSDP steps with and without sharing give the same gradients."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # a failing peer ends the other's wait
    try:
        rows = group_rows("memagent", n_groups=2, n=4)
        for strategy in ("ddp", "fsdp"):
            results = {}
            for share in (True, False):
                cfg = Config.model_validate({
                    "train": {"lr": 1e-3, "grad_clip": 1e9, "micro_batch_tokens": 300, "dp_size": WORLD,
                              "pad_to_dp": True, "strategy": strategy, "runtime": "ray", "share_prefixes": share,
                              "share_prefix_min_tokens": MIN},
                    "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.01}})
                actor = Actor(tiny_model(), cfg, pad_token_id=0, rank=rank, world_size=WORLD)
                actor.optimizer.step = lambda *a, **k: None  # keep the gradient, skip the update
                metrics = actor.train_rollout(rows, rollout_id=0)
                grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
                         for n, p in actor.model.named_parameters() if p.grad is not None}
                results[share] = metrics, grads
            assert_same_step(results[True], results[False], rows, 300)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~25 s here
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_ddp_and_fsdp_ranks_share_and_give_the_unshared_gradients():
    import torch.multiprocessing as mp

    mp.start_processes(_rank_main, args=(_free_port(),), nprocs=WORLD, start_method="spawn")
