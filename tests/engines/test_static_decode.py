"""HFEngine's static-shape decode path (memrl/engines/static_decode.py) against the dynamic path.

On CPU the static path runs eagerly (`static_kv="on"`), so these tests check its arithmetic and its
bookkeeping: slots, buckets, rows joining and leaving, stop/length, weight sync. Numbers: the prefill is
the same call in both paths, so each request's first log-prob is bitwise equal; later steps attend over
a bucket's C columns with rows left-aligned (the dynamic cache right-aligns them in the longest row's
width), and grouped-query attention runs as one SDPA call instead of repeated kv heads, so float32
reductions run in another order and log-probs agree within numerics.logprob_atol (derived from the
float32 arithmetic there). Tokens must be equal: a flip would need a uniform within ~1e-5 of a CDF
boundary, and the seeds here are fixed.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from numerics import logprob_atol, sharp_model, token_ids
from staggering import generate, staggered

from memrl.config import Config, ConfigError, load_config
from memrl.engines.base import EngineError, GenerationRequest, WeightsInMemory
from memrl.engines.factory import build_engine
from memrl.engines.hf import HFEngine
from memrl.engines.static_decode import MIN_CAPACITY, length_bucket, slot_bucket

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/engines/conftest.py


def mixed_requests(n: int, stops: list[int] | None = None) -> list[GenerationRequest]:
    """Every sampling mode: T 1.0 / 0.7 / greedy, top_p 1 / 0.9, prompts of 3..40 tokens, own seeds."""
    return [GenerationRequest(token_ids(i, 3 + (7 * i) % 38), max_tokens=4 + (5 * i) % 23,
                              temperature=(1.0, 0.7, 0.0)[i % 3], top_p=(1.0, 0.9)[(i // 3) % 2], seed=100 + i,
                              stop_token_ids=stops or []) for i in range(n)]


def assert_same(dynamic, static, atol: float, same_prefill: bool = True) -> None:
    for a, b in zip(dynamic, static, strict=True):
        assert b.finish_reason == a.finish_reason and b.output_ids == a.output_ids
        if same_prefill:  # the same prefill call (same requests, same padding): bitwise
            assert b.log_probs[0] == a.log_probs[0]
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= atol


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous", "whole"])
def test_static_path_gives_the_dynamic_paths_tokens_and_log_probs(model, continuous):
    requests = mixed_requests(12)
    dynamic = generate(HFEngine(model, max_batch_size=16, continuous_batching=continuous), requests)
    engine = HFEngine(model, max_batch_size=16, continuous_batching=continuous, static_kv="on")
    assert engine.static_decoder is not None and not engine.static_decoder.graphs  # CPU: eager
    static = generate(engine, requests)
    assert_same(dynamic, static, logprob_atol(model, [r.prompt_ids for r in requests]))
    assert {r.finish_reason for r in static} == {"length"}
    assert engine._lock.acquire(timeout=5)  # the decode thread left its session (it may outlive the results)
    engine._lock.release()
    assert engine.static_decoder.storage is None  # closing freed the KV storage


def test_a_timed_out_row_leaves_and_its_slot_is_reused():
    # Its own model: the abandoned batch may still be decoding when generate returns, and a decode step
    # switches the model's attention implementation (an engine owns its model; build_engine copies it).
    engine = HFEngine(sharp_model(), request_timeout_s=1.0, static_kv="on")
    decoder, seen = engine.static_decoder, []
    original = decoder.forward

    def slow(slots, capacity):
        seen.append(slots)
        threading.Event().wait(0.05)  # 50 ms per step: 50 steps outlast the timeout
        return original(slots, capacity)

    decoder.forward = slow
    requests = [GenerationRequest(token_ids(50, 5), max_tokens=50, seed=0),
                GenerationRequest(token_ids(51, 5), max_tokens=5, seed=1)]
    results = generate(engine, requests)
    assert results[0].finish_reason == "error" and "timed out" in results[0].error
    assert results[1].finish_reason == "length" and len(results[1].output_ids) == 5
    assert len(seen) < 40  # the abandoned row left instead of decoding 50 steps
    assert engine._lock.acquire(timeout=10)  # and its decode thread ends
    engine._lock.release()


def test_cpu_default_is_the_dynamic_path(model):
    assert HFEngine(model).static_decoder is None
    assert HFEngine(model, static_kv="auto", cuda_graphs="auto").static_decoder is None


def test_stop_tokens_and_length_limits(model):
    stops = list(range(0, 512, 3))  # about a third of the vocabulary stops a request
    requests = mixed_requests(16, stops)
    dynamic = generate(HFEngine(model, max_batch_size=16), requests)
    static = generate(HFEngine(model, max_batch_size=16, static_kv="on"), requests)
    assert_same(dynamic, static, logprob_atol(model, [r.prompt_ids for r in requests]))
    assert {r.finish_reason for r in static} == {"stop", "length"}
    for request, result in zip(requests, static, strict=True):
        assert not any(t in stops for t in result.output_ids[:-1])
        assert len(result.output_ids) == request.max_tokens or result.output_ids[-1] in stops


def test_buckets_are_powers_of_two_up_to_the_batch_limit():
    assert [slot_bucket(n, 48) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32, 48, 48]
    assert [slot_bucket(n, 64) for n in (63, 64)] == [64, 64]
    assert [length_bucket(n) for n in (1, MIN_CAPACITY, MIN_CAPACITY + 1, 1000, 1024, 1025)] == \
        [MIN_CAPACITY, MIN_CAPACITY, 2 * MIN_CAPACITY, 1024, 1024, 2048]


def recorded_buckets(engine: HFEngine) -> list[tuple[int, int]]:
    """(slots, columns) of every static decode step, recorded on the engine's decoder."""
    decoder, seen = engine.static_decoder, []
    original = decoder.forward

    def recording(slots, capacity):
        seen.append((slots, capacity))
        return original(slots, capacity)

    decoder.forward = recording
    return seen


def test_rows_join_and_leave_mid_generation_with_the_same_results(model):
    first = [GenerationRequest(token_ids(0, 5), max_tokens=40, temperature=1.0, seed=1),
             GenerationRequest(token_ids(1, 12), max_tokens=6, temperature=0.7, top_p=0.9, seed=2)]  # leaves early
    later = [GenerationRequest(token_ids(2, 3), max_tokens=12, temperature=1.0, seed=3),
             GenerationRequest(token_ids(3, 60), max_tokens=30, temperature=0.7, top_p=0.9,
                               seed=4),  # widens the bucket
             GenerationRequest(token_ids(4, 9), max_tokens=5, temperature=0.0),
             GenerationRequest(token_ids(5, 7), max_tokens=3, temperature=1.0, seed=6)]
    engine = HFEngine(model, max_batch_size=8, static_kv="on")
    buckets = recorded_buckets(engine)
    first_results, later_results, _ = asyncio.run(staggered(engine, first, later,
                                                            hold=(engine.static_decoder, "forward")))
    asyncio.run(engine.close())
    assert engine.stats.prefills == 2 and engine.stats.prefill_requests == 6  # the later ones joined mid-batch
    # Each request alone on the dynamic path: the same tokens whatever batch it decoded in (its prefill
    # was padded among other prompts here, so even its first log-prob may round differently).
    alone = [generate(HFEngine(model), [r])[0] for r in first + later]
    assert_same(alone, first_results + later_results, logprob_atol(model, [r.prompt_ids for r in first + later]),
                same_prefill=False)
    slots = [s for s, _ in buckets]
    assert slots[0] == 2 and max(slots) == 8  # 2 rows, then 6 after the joins (bucket 8)
    assert max(c for _, c in buckets) == length_bucket(60 + 30)  # the long newcomer's columns
    # Rows left: the bucket shrank once its rows fit a quarter of it (8 -> 2), not at every departure.
    changes = [b for i, b in enumerate(buckets) if i == 0 or b != buckets[i - 1]]
    assert [s for s, _ in changes] == [2, 8, 2], changes


def test_weight_sync_keeps_parameter_storage_and_takes_effect():
    engine = HFEngine(sharp_model(seed=0), static_kv="on")
    trainer = sharp_model(seed=1)
    request = GenerationRequest(token_ids(4, 9), max_tokens=8, temperature=1.0, seed=9)

    async def main():
        before = (await engine.generate([request]))[0]
        pointers = [p.data_ptr() for p in engine.model.parameters()]
        await engine.sync_from(WeightsInMemory(trainer.state_dict()))
        assert [p.data_ptr() for p in engine.model.parameters()] == pointers  # in place: graphs stay valid
        after = (await engine.generate([request]))[0]
        await engine.close()
        return before, after

    before, after = asyncio.run(main())
    expected = generate(HFEngine(sharp_model(seed=1)), [request])[0]
    assert after.output_ids == expected.output_ids != before.output_ids
    assert after.log_probs == pytest.approx(expected.log_probs, abs=logprob_atol(trainer, [request.prompt_ids]))


def test_settings_that_cannot_work_are_refused(model):
    with pytest.raises(EngineError, match="needs a CUDA device"):
        HFEngine(model, cuda_graphs="on")
    with pytest.raises(EngineError, match="auto, on or off"):
        HFEngine(model, static_kv="yes")
    sliding = sharp_model()
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(EngineError, match="sliding_attention"):
        HFEngine(sliding, static_kv="on")
    with pytest.raises(ConfigError, match="static_kv"):
        load_config(RECIPE, ["engine.cuda_graphs=on", "engine.static_kv=off"])


def test_the_factory_passes_the_rollout_settings(model):
    cfg = Config.model_validate({"model": {"device": "cpu", "dtype": "float32"}, "engine": {"static_kv": "on"}})
    engine = build_engine(cfg, model=model, tokenizer=None)
    try:
        assert engine.static_decoder is not None
    finally:
        asyncio.run(engine.close())
    with pytest.raises(EngineError, match="needs a CUDA device"):
        build_engine(Config.model_validate({"model": {"device": "cpu"},
                                            "engine": {"static_kv": "auto", "cuda_graphs": "on"}}), model=model)


@pytest.mark.parametrize("recipe", [None, *sorted(RECIPE.parent.glob("*.yaml"))],
                         ids=lambda r: getattr(r, "name", "defaults"))
def test_static_decode_and_cuda_graphs_are_off_unless_asked_for(recipe):
    """The static path has never run on a GPU (bench/README.md): neither the defaults nor a shipped recipe
    may send a user's first GPU run down it; `auto` (on with CUDA) is opt-in until GPU figures decide."""
    engine = load_config(recipe).engine
    assert (engine.static_kv, engine.cuda_graphs) == ("off", "off")


class ColumnsCheckingGraph:
    """A CPU stand-in for a captured decode step: it holds the column-index tensor of its capture, as a
    CUDA graph holds its pointer, and refuses to replay once the decoder has replaced that tensor."""

    def __init__(self, decoder, slots: int, capacity: int) -> None:
        self.decoder, self.slots, self.capacity = decoder, slots, capacity
        self.logits = decoder._eager(slots, capacity).clone()  # as the real capture: warm-up first
        self.columns = decoder._columns

    def replay(self) -> None:
        assert self.decoder._columns is self.columns, "a graph replayed over a reallocated column index"
        self.logits.copy_(self.decoder._eager(self.slots, self.capacity))


def test_a_longer_row_drops_the_graphs_that_hold_the_old_column_index(model):
    """Short rows (a (slots, 32-column) bucket, captured), then one long row in fewer slots (64 columns: the
    KV storage has room in place, but the column index is reallocated), then short rows again: the first
    bucket's graph must not be replayed over the freed column index."""
    engine = HFEngine(model, max_batch_size=8, static_kv="on")
    decoder = engine.static_decoder
    decoder.graphs = True

    def capture(slots, capacity):
        graph = ColumnsCheckingGraph(decoder, slots, capacity)
        decoder._graphs[(slots, capacity)] = (graph, graph.logits)
        decoder.captures += 1
        return graph, graph.logits

    decoder._capture = capture
    short = [GenerationRequest(token_ids(i, 4 + i), max_tokens=6, temperature=0.0) for i in range(8)]
    long = [GenerationRequest(token_ids(9, 50), max_tokens=6, temperature=0.0)]

    async def main():
        try:
            return [await engine.generate(batch) for batch in (short, long, short)]
        finally:
            await engine.close()

    first, _, again = asyncio.run(main())
    assert [(r.finish_reason, r.output_ids) for r in again] == [(r.finish_reason, r.output_ids) for r in first]
    assert decoder.captures >= 3  # (8, 32), (1, 64), then (8, 32) captured anew


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU; this machine has none")
def test_cuda_graphs_decode_with_the_weights_of_the_last_sync():
    """Graphs on: the captured step reads the parameters' storage, so an in-place weight sync must show
    in the next generation without a recapture. bf16: tokens of greedy requests compared, log-probs
    within bf16 rounding of the eager static path."""
    requests = [GenerationRequest(token_ids(i, 5 + 3 * i), max_tokens=16, temperature=0.0) for i in range(6)]
    engine = HFEngine(sharp_model(seed=0), device="cuda", cuda_graphs="on")
    trainer = sharp_model(seed=1)

    async def main():
        before = await engine.generate(requests)
        captures = engine.static_decoder.captures
        await engine.sync_from(WeightsInMemory(trainer.state_dict()))
        after = await engine.generate(requests)
        await engine.close()
        return before, after, captures

    before, after, captures = asyncio.run(main())
    assert captures > 0 and engine.static_decoder.captures == captures  # the same graphs, replayed
    eager = generate(HFEngine(sharp_model(seed=1), device="cuda", cuda_graphs="off", static_kv="on"), requests)
    old = generate(HFEngine(sharp_model(seed=0), device="cuda", cuda_graphs="off", static_kv="on"), requests)
    assert [r.output_ids for r in after] == [r.output_ids for r in eager]
    assert [r.output_ids for r in before] == [r.output_ids for r in old]
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    for a, b in zip(after, eager, strict=True):
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) < 0.1
