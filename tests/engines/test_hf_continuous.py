"""HFEngine continuous batching: requests admitted into a running batch (merged KV caches) stay exact.

Admission is made deterministic with a gate: the engine's `_forward` blocks at a chosen decode step
until the test has queued its newcomers, so they join at the next step boundary of a running batch.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from numerics import logprob_atol, sharp_model
from staggering import staggered as hold_and_join

import memrl.engines.hf_batch as hf_batch
from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.engines.sampling import sampling_log_probs


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs on one torch thread (the fixture is in tests/engines/conftest.py)."""


@pytest.fixture(scope="module")
def model():
    """Peaked, context-dependent next-token distributions, so errors in the merged cache change tokens
    and log-probs visibly."""
    return sharp_model()


def prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * k + 11) % 500 + 5 for k in range(length)]


def teacher_forced(model, request: GenerationRequest, output: list[int]) -> list[float]:
    ids = torch.tensor([request.prompt_ids + output[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1:].float()
    n = logits.shape[0]
    log_probs = sampling_log_probs(logits, torch.full((n,), request.temperature), torch.full((n,), request.top_p))
    return log_probs.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


def staggered(engine: HFEngine, first: list[GenerationRequest], later: list[GenerationRequest], after_steps: int = 3):
    """`staggering.staggered` on the dynamic path: the batch is held in `HFEngine._forward`."""
    return hold_and_join(engine, first, later, hold=(engine, "_forward"), after_steps=after_steps)


def test_newcomers_join_the_running_batch_and_log_probs_match_teacher_forcing(model):
    engine = HFEngine(model, max_batch_size=8)
    first = [GenerationRequest(prompt(0, 5), max_tokens=20, temperature=1.0, seed=1),
             GenerationRequest(prompt(1, 12), max_tokens=20, temperature=0.7, top_p=0.9, seed=2)]
    later = [GenerationRequest(prompt(2, 3), max_tokens=12, temperature=1.0, seed=3),  # shorter than the cache
             GenerationRequest(prompt(3, 40), max_tokens=12, temperature=0.7, top_p=0.9, seed=4),  # longer
             GenerationRequest(prompt(4, 9), max_tokens=12, temperature=0.0)]
    first_results, later_results, _ = asyncio.run(staggered(engine, first, later))
    assert engine.stats.prefills == 2 and engine.stats.prefill_requests == 5  # one group joined mid-batch
    assert engine.stats.decode_rows > engine.stats.decode_steps * 2  # rows were decoded together
    atol = logprob_atol(model, [r.prompt_ids for r in first + later])
    for request, result in zip(first + later, first_results + later_results, strict=True):
        assert result.finish_reason == "length" and len(result.output_ids) == request.max_tokens
        expected = teacher_forced(model, request, result.output_ids)
        assert max(abs(a - b) for a, b in zip(result.log_probs, expected, strict=True)) <= atol
    asyncio.run(engine.close())


def test_seeded_request_gives_the_same_tokens_alone_or_admitted_mid_batch(model):
    engine = HFEngine(model, max_batch_size=8)
    targets = [GenerationRequest(prompt(5, 4), max_tokens=10, temperature=1.0, seed=77),
               GenerationRequest(prompt(6, 30), max_tokens=10, temperature=0.8, top_p=0.9, seed=78)]
    alone = [asyncio.run(engine.generate([t]))[0] for t in targets]
    running = [GenerationRequest(prompt(7, 11), max_tokens=25, temperature=1.0, seed=i) for i in range(3)]
    _, admitted, _ = asyncio.run(staggered(engine, running, targets, after_steps=4))
    for a, b in zip(alone, admitted, strict=True):
        assert a.output_ids == b.output_ids
        assert a.log_probs == pytest.approx(b.log_probs, abs=logprob_atol(model, [t.prompt_ids for t in targets]))
    asyncio.run(engine.close())


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "whole"])
def test_a_short_request_overtakes_a_long_running_one_only_with_continuous_batching(model, continuous):
    engine = HFEngine(model, continuous_batching=continuous)
    long = [GenerationRequest(prompt(8, 6), max_tokens=80, temperature=1.0, seed=0)]  # no stop tokens
    short = [GenerationRequest(prompt(9, 6), max_tokens=3, temperature=1.0, seed=1)]
    long_results, short_results, order = asyncio.run(staggered(engine, long, short))
    assert len(long_results[0].output_ids) == 80 and len(short_results[0].output_ids) == 3
    assert order == (["later:0", "first"] if continuous else ["first", "later:0"])
    asyncio.run(engine.close())


def test_stop_and_length_for_admitted_requests(model):
    engine = HFEngine(model, max_batch_size=16)
    stops = list(range(0, 512, 3))
    running = [GenerationRequest(prompt(10, 7), max_tokens=30, temperature=1.0, seed=5)]
    later = [GenerationRequest(prompt(11 + i, 2 + 3 * i), max_tokens=1 + i % 7, temperature=1.0, seed=i,
                               stop_token_ids=stops) for i in range(10)]
    _, results, _ = asyncio.run(staggered(engine, running, later))
    assert {r.finish_reason for r in results} == {"stop", "length"}
    for request, result in zip(later, results, strict=True):
        assert len(result.output_ids) == len(result.log_probs) <= request.max_tokens
        assert not any(t in stops for t in result.output_ids[:-1])
        if result.finish_reason == "stop":
            assert result.output_ids[-1] in stops
        else:
            assert len(result.output_ids) == request.max_tokens
    asyncio.run(engine.close())


def test_batch_size_limit_holds_with_admissions_and_padding_is_trimmed(model, monkeypatch):
    engine = HFEngine(model, max_batch_size=2)
    shapes: list[tuple[int, int, int]] = []  # per decode step: rows, cache width, longest row
    original = engine._forward

    def recording_forward(input_ids, attention_mask, position_ids, cache):
        if input_ids.shape[1] == 1:
            shapes.append((input_ids.shape[0], attention_mask.shape[1], int(attention_mask.sum(1).max())))
        return original(input_ids, attention_mask, position_ids, cache)

    monkeypatch.setattr(engine, "_forward", recording_forward)
    running = [GenerationRequest(prompt(20, 4), max_tokens=40, temperature=1.0, seed=0)]
    later = [GenerationRequest(prompt(21, 60), max_tokens=3, seed=1),  # wide prompt, leaves soon
             GenerationRequest(prompt(22, 5), max_tokens=3, seed=2)]  # must wait for a free row
    asyncio.run(staggered(engine, running, later))
    assert max(rows for rows, _, _ in shapes) == 2
    assert any(width >= 60 for _, width, _ in shapes)  # the wide newcomer widened the cache...
    assert all(width == longest for _, width, longest in shapes[-5:])  # ...and its padding left with it
    asyncio.run(engine.close())


def test_unmergeable_cache_admits_only_into_an_empty_batch(model, monkeypatch):
    monkeypatch.setattr(hf_batch, "_mergeable", lambda cache: False)
    engine = HFEngine(model)
    long = [GenerationRequest(prompt(8, 6), max_tokens=30, temperature=1.0, seed=0)]
    short = [GenerationRequest(prompt(9, 6), max_tokens=3, temperature=1.0, seed=1)]
    _, short_results, order = asyncio.run(staggered(engine, long, short))
    assert order == ["first", "later:0"] and short_results[0].finish_reason == "length"
    asyncio.run(engine.close())


def test_failure_mid_session_fails_in_flight_rows_only_and_engine_keeps_serving(model, monkeypatch):
    engine = HFEngine(model)
    original = engine._prefill
    calls = 0

    def second_prefill_fails(requests, held=None):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected fault")
        return original(requests, held)

    monkeypatch.setattr(engine, "_prefill", second_prefill_fails)
    running = [GenerationRequest(prompt(30, 5), max_tokens=4, seed=0),  # done before the fault
               GenerationRequest(prompt(31, 5), max_tokens=40, seed=1)]
    later = [GenerationRequest([5, 10**6], max_tokens=3),  # out of vocabulary: fails alone, at once
             GenerationRequest(prompt(32, 5), max_tokens=3, seed=2)]
    first_results, later_results, _ = asyncio.run(staggered(engine, running, later, after_steps=5))
    assert first_results[0].finish_reason == "length" and len(first_results[0].output_ids) == 4
    assert first_results[1].finish_reason == "error" and "injected fault" in first_results[1].error
    assert "vocabulary" in later_results[0].error
    assert later_results[1].finish_reason == "error" and "injected fault" in later_results[1].error
    ok = asyncio.run(engine.generate([GenerationRequest(prompt(33, 5), max_tokens=3)]))[0]
    assert ok.finish_reason == "length"


def test_close_during_a_running_batch_fails_pending_requests_and_stops_computing(model):
    engine = HFEngine(model)

    async def main():
        running = asyncio.ensure_future(engine.generate(
            [GenerationRequest(prompt(40, 5), max_tokens=100_000, temperature=1.0, seed=0)]))
        while engine.stats.decode_steps < 3:
            await asyncio.sleep(0.001)
        queued = asyncio.ensure_future(engine.generate([GenerationRequest(prompt(41, 5), max_tokens=5)]))
        await asyncio.sleep(0)
        await engine.close()
        return await asyncio.wait_for(asyncio.gather(running, queued), 5)

    results = asyncio.run(main())
    assert [r[0].finish_reason for r in results] == ["error", "error"]
    assert engine._lock.acquire(timeout=5)  # the decode thread left its session
    engine._lock.release()


def test_timed_out_row_leaves_the_running_batch(model):
    engine = HFEngine(model, request_timeout_s=0.3)
    original = engine._forward
    seen_rows: list[int] = []

    def slow_forward(input_ids, *args):
        seen_rows.append(input_ids.shape[0])
        if len(seen_rows) > 1:
            threading.Event().wait(0.02)  # 20 ms per step: 50 steps outlast the timeout
        return original(input_ids, *args)

    engine._forward = slow_forward
    requests = [GenerationRequest(prompt(50, 5), max_tokens=50, seed=0),
                GenerationRequest(prompt(51, 5), max_tokens=5, seed=1)]
    results = asyncio.run(engine.generate(requests))
    assert results[0].finish_reason == "error" and "timed out" in results[0].error
    assert results[1].finish_reason == "length"
    assert engine._lock.acquire(timeout=5)
    engine._lock.release()
    assert len(seen_rows) < 40  # the session ended soon after the timeout instead of running 50 steps
