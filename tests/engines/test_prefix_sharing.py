"""Prefix sharing at admission (memrl/engines/prefix.py): the shared path gives the unshared path's tokens
and log-probs, on the dynamic and static KV paths, whole-request and continuous batching.

Numbers: the shared prefill runs the same arithmetic under other batch shapes (the prefix as one row, the
suffixes after a padding gap), so log-probs agree within numerics.logprob_atol, derived from float32
rounding; tokens must be equal (a flip needs a uniform within ~1e-5 of a CDF boundary; seeds are fixed).
A wave that shares nothing takes the plain prefill: bit for bit the unshared engine's results.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from numerics import logprob_atol, token_ids
from staggering import generate, staggered
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.engines.prefix import MIN_SHARED_PREFIX, common_prefix_length, plan_prefill

PATHS = [pytest.param({}, id="dynamic"), pytest.param({"static_kv": "on"}, id="static")]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engines/conftest.py


TEMPLATE = token_ids(900, MIN_SHARED_PREFIX + 8)  # the chat template + instruction every prompt starts with


def group_prompt(question: int, memory: int | None = None) -> list[int]:
    """A memory-turn prompt: the template, a question and chunk of the question's own (longer than
    MIN_SHARED_PREFIX), then a memory (None: the turn-0 prompt, the same for the whole group)."""
    memory_ids = [] if memory is None else token_ids(50 + memory, 2 + memory % 4)
    return TEMPLATE + token_ids(question, MIN_SHARED_PREFIX + 3 + 5 * question) + memory_ids


def group_wave(questions: int, n: int, max_tokens: int = 12, memories: bool = False) -> list[GenerationRequest]:
    """n samples per question (turn 0, or a later turn with one memory each), every sampling mode."""
    return [GenerationRequest(group_prompt(q, q * n + s if memories else None), max_tokens + (q * n + s) % 5,
                              temperature=(1.0, 0.7, 0.0)[s % 3], top_p=(1.0, 0.9)[q % 2], seed=100 * q + s)
            for q in range(questions) for s in range(n)]


def mixed_wave() -> list[GenerationRequest]:
    """Every kind of node: two turn-0 groups (repeated prompts), two later-turn groups (a question's prefix
    shared, memories distinct), and a prompt that shares nothing (a leaf at the first level)."""
    alone = GenerationRequest(token_ids(77, 20), 9, temperature=1.0, seed=7)
    return group_wave(2, 4) + group_wave(4, 4, memories=True)[8:] + [alone]


def assert_same(unshared, shared, atol: float) -> None:
    for a, b in zip(unshared, shared, strict=True):
        assert b.finish_reason == a.finish_reason and b.output_ids == a.output_ids
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= atol


def levels(plan) -> list[list[tuple[int, int, bool]]]:
    """(start, end, leaf) of every node, level by level."""
    return [[(n.start, n.end, n.leaf) for n in nodes] for nodes in plan.stages]


# ---- the plan -----------------------------------------------------------------------------------------
def test_plan_dedups_repeated_prompts_and_shares_the_common_prefix():
    t = len(TEMPLATE)
    a, b = TEMPLATE + [1, 2, 3], TEMPLATE + [1, 9]
    plan = plan_prefill([a, b, a, a, b])
    assert plan.prompts == (tuple(a), tuple(b)) and plan.rows == (0, 1, 0, 0, 1)
    assert levels(plan) == [[(0, t + 1, False)], [(t + 1, t + 3, True), (t + 1, t + 2, True)]]
    assert plan.computed_tokens == t + 1 + 2 * 2
    # Identical prompts: one leaf; a prompt that is another's prefix keeps its last token in its leaf.
    assert levels(plan_prefill([a, a, a])) == [[(0, t + 3, True)]]
    assert levels(plan_prefill([TEMPLATE, TEMPLATE + [4, 5]], max_share=1)) == [
        [(0, t - 1, False)], [(t - 1, t, True), (t - 1, t + 2, True)]]
    assert common_prefix_length([a, b]) == t + 1 and common_prefix_length([[1], [2]]) == 0


def test_plan_shares_each_groups_prefix_below_the_common_one():
    prompts = [r.prompt_ids for r in mixed_wave()]
    plan = plan_prefill(prompts)
    t, q2, q3 = len(TEMPLATE), len(group_prompt(2)), len(group_prompt(3))
    root, groups, leaves = levels(plan)
    assert root == [(0, len(token_ids(77, 20)), True), (0, t, False)]  # the lone prompt, the template
    # Under the template: the two turn-0 prompts (leaves) and the two later-turn groups' question + chunk.
    assert groups == [(t, len(group_prompt(0)), True), (t, len(group_prompt(1)), True), (t, q2, False),
                      (t, q3, False)]
    assert [start for start, _, _ in leaves] == [q2] * 4 + [q3] * 4 and all(leaf for _, _, leaf in leaves)
    assert len(plan.prompts) == 1 + 2 + 8 and plan.rows[:8] == (0, 0, 0, 0, 1, 1, 1, 1)


def test_prefixes_are_shared_only_when_that_leaves_little_to_compute():
    # The template shared, but most of each prompt still to compute (through a mask): the plain prefill.
    long = [TEMPLATE + token_ids(q, 100) for q in range(3)]
    assert plan_prefill(long) is None
    assert levels(plan_prefill(long, max_share=1))[0] == [(0, len(TEMPLATE), False)]
    # A repeated prompt is still computed once; only the template is not shared.
    plan = plan_prefill([long[0], long[1], long[0]])
    assert levels(plan) == [[(0, len(p), True) for p in long[:2]]] and plan.rows == (0, 1, 0)
    # The same held: a copy that leaves ~0.7 of each prompt to compute is not made either.
    assert plan_prefill(long[1:], held=[tuple(long[0])]) is None
    assert plan_prefill(long[1:], held=[tuple(long[0])], max_share=1).stages[0][0].held == 0


def test_plan_is_none_when_nothing_is_worth_sharing():
    assert plan_prefill([token_ids(i, 50) for i in range(4)]) is None  # distinct from the first token
    short = token_ids(0, MIN_SHARED_PREFIX - 1)
    assert plan_prefill([short + [1, 2], short + [3, 4]]) is None  # common prefix below the minimum
    assert (levels(plan_prefill([short + [1, 2], short + [3, 4]], min_prefix=4, max_share=1))[0]
            == [(0, len(short), False)])
    assert plan_prefill([token_ids(0, 5)]) is None


def test_plan_copies_what_running_rows_hold():
    turn0, later = group_prompt(0), [group_prompt(0, m) for m in range(3)]
    held = [tuple(group_prompt(5)), tuple(turn0)]  # running rows: another question's, and this group's
    # A straggler of the running group: all but its last token copied from running row 1.
    plan = plan_prefill([turn0, turn0], held=held)
    assert levels(plan) == [[(len(turn0) - 1, len(turn0), True)]] and plan.stages[0][0].held == 1
    assert plan.computed_tokens == 1
    # Later turns of the group: question and chunk copied from row 1, each memory computed.
    plan = plan_prefill(later, held=held)
    assert levels(plan) == [[(len(turn0), len(p), True) for p in later]]
    assert {n.held for n in plan.stages[0]} == {1}
    # Nothing held in common beyond the template: the wave shares its question among itself, below a
    # template copied from whichever row holds it.
    plan = plan_prefill(later, held=held[:1], max_share=1)
    assert levels(plan)[0] == [(len(TEMPLATE), len(turn0), False)] and plan.stages[0][0].held == 0
    assert plan_prefill([token_ids(i, 50) for i in range(3)], held=held) is None  # nothing in common


# ---- the prefill itself -------------------------------------------------------------------------------
def test_shared_prefill_has_the_plain_prefills_layout_and_values(model):
    requests = mixed_wave()
    plain, shared = HFEngine(model, share_prefixes=False), HFEngine(model, share_prefixes=True)
    with torch.inference_mode():
        p_cache, p_mask, p_next, p_logits = plain._prefill(requests)
        s_cache, s_mask, s_next, s_logits = shared._prefill(requests)
    assert torch.equal(s_mask, p_mask) and torch.equal(s_next, p_next)
    atol = logprob_atol(model, [r.prompt_ids for r in requests])
    assert torch.allclose(s_logits, p_logits, rtol=0, atol=atol)
    valid = p_mask.bool()[:, None, :, None]  # [rows, 1, width, 1]: the columns each row attends to
    for p_layer, s_layer in zip(p_cache.layers, s_cache.layers, strict=True):
        for p_kv, s_kv in ((p_layer.keys, s_layer.keys), (p_layer.values, s_layer.values)):
            assert s_kv.shape == p_kv.shape
            scale = float(p_kv.abs().max())
            assert float(((s_kv - p_kv) * valid).abs().max()) <= atol * scale
            assert not bool((s_kv * ~valid).any())  # padding is zeros
    assert shared.stats.prefill_tokens == plan_prefill([r.prompt_ids for r in requests]).computed_tokens
    assert plain.stats.prefill_tokens == p_mask.numel()
    assert shared.stats.prompt_tokens == plain.stats.prompt_tokens == int(p_mask.sum())


# ---- end to end ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "whole"])
def test_groups_get_the_unshared_tokens_and_log_probs(model, path, continuous):
    requests = mixed_wave()
    kwargs = dict(max_batch_size=32, continuous_batching=continuous, **path)  # one wave
    unshared_engine, shared_engine = (HFEngine(model, share_prefixes=False, **kwargs),
                                      HFEngine(model, share_prefixes=True, **kwargs))
    unshared, shared = generate(unshared_engine, requests), generate(shared_engine, requests)
    assert_same(unshared, shared, logprob_atol(model, [r.prompt_ids for r in requests]))
    assert shared_engine.stats.prompt_tokens == unshared_engine.stats.prompt_tokens
    plan = plan_prefill([r.prompt_ids for r in requests])
    assert shared_engine.stats.prefill_tokens == plan.computed_tokens < unshared_engine.stats.prefill_tokens / 2


@pytest.mark.parametrize("path", PATHS)
def test_rows_joining_and_leaving_with_sharing(model, path):
    """Continuous batching: a running group (short and long rows), then a second wave of two groups that
    joins mid-batch and is shared among itself; rows leave as they finish."""
    first = group_wave(1, 3, max_tokens=4) + group_wave(1, 1, max_tokens=30)
    later = group_wave(3, 3)[3:]  # questions 1 and 2, three samples each

    def run(**share):
        engine = HFEngine(model, max_batch_size=16, **path, **share)
        hold = (engine, "_forward") if not path else (engine.static_decoder, "forward")
        first_results, later_results, _ = asyncio.run(staggered(engine, first, later, hold=hold))
        asyncio.run(engine.close())
        return first_results + later_results, engine.stats

    (unshared, plain_stats), (shared, shared_stats) = run(share_prefixes=False), run(share_prefixes=True)
    assert shared_stats.prefills == plain_stats.prefills == 2  # the later wave joined the running batch
    assert_same(unshared, shared, logprob_atol(model, [r.prompt_ids for r in first + later]))
    assert {len(r.output_ids) for r in shared} >= {4, 30}  # rows left at different steps
    assert shared_stats.prefill_tokens < plain_stats.prefill_tokens


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "whole"])
def test_prompts_that_share_nothing_behave_bit_for_bit_as_before(model, path, continuous):
    requests = [GenerationRequest(token_ids(i, 3 + 7 * i), 10 + i, temperature=(1.0, 0.7)[i % 2], seed=i)
                for i in range(6)]
    assert plan_prefill([r.prompt_ids for r in requests]) is None
    kwargs = dict(continuous_batching=continuous, **path)
    unshared_engine, shared_engine = (HFEngine(model, share_prefixes=False, **kwargs),
                                      HFEngine(model, share_prefixes=True, **kwargs))
    unshared, shared = generate(unshared_engine, requests), generate(shared_engine, requests)
    assert [(r.output_ids, r.log_probs, r.finish_reason) for r in shared] == \
        [(r.output_ids, r.log_probs, r.finish_reason) for r in unshared]
    assert shared_engine.stats.prefill_tokens == unshared_engine.stats.prefill_tokens


def test_sliding_window_layers_are_never_shared():
    """Their cache keeps only the last window of keys/values: a prefix copied into it would be cut."""
    config = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, use_sliding_window=True,
                         sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        sliding = Qwen3ForCausalLM(config).eval()
    requests = group_wave(2, 3)
    unshared_engine, shared_engine = HFEngine(sliding, share_prefixes=False), HFEngine(sliding, share_prefixes=True)
    unshared, shared = generate(unshared_engine, requests), generate(shared_engine, requests)
    assert shared_engine.stats.prefill_tokens == unshared_engine.stats.prefill_tokens
    assert [r.log_probs for r in shared] == [r.log_probs for r in unshared]


@pytest.mark.parametrize("path", PATHS)
def test_newcomers_copy_the_prompts_running_rows_hold(model, path):
    """A group's stragglers (its turn-0 prompt again) and its later turns (its question + chunk, then a
    memory each) join a batch whose running rows hold those prompts: copied, not computed."""
    first = group_wave(1, 2, max_tokens=30)
    later = group_wave(1, 2, max_tokens=6) + group_wave(1, 3, memories=True)

    def run(**share):
        engine = HFEngine(model, max_batch_size=16, **path, **share)
        hold = (engine, "_forward") if not path else (engine.static_decoder, "forward")
        engine.reset_stats()
        first_results, later_results, _ = asyncio.run(staggered(engine, first, later, hold=hold))
        asyncio.run(engine.close())
        return first_results + later_results, engine.stats

    (unshared, plain_stats), (shared, shared_stats) = run(share_prefixes=False), run(share_prefixes=True)
    assert_same(unshared, shared, logprob_atol(model, [r.prompt_ids for r in first + later]))
    assert shared_stats.prefills == plain_stats.prefills == 2  # the newcomers joined as one wave
    memories = [len(r.prompt_ids) - len(group_prompt(0)) for r in later[2:]]
    first_wave = len(group_prompt(0))  # two identical prompts: one row
    # Then one row per distinct newcomer, each only its last token (the straggler) or its memory, padded.
    assert shared_stats.prefill_tokens == first_wave + (1 + len(memories)) * max(memories)
