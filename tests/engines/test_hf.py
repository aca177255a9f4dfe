"""HFEngine: batching of concurrent calls, stop/length, determinism, exact log-probs, failures, weight sync.

Every engine test runs in both modes (continuous batching and whole-request batching); the behaviour
specific to continuous batching is tested in test_hf_continuous.py.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from numerics import logprob_atol, sharp_model

from memrl.engines.base import Engine, EngineError, GenerationRequest, GenerationResult, WeightsInMemory
from memrl.engines.hf import HFEngine
from memrl.engines.sampling import sample_tokens, sampling_log_probs
from memrl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs on one torch thread (the fixture is in tests/engines/conftest.py)."""


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(params=[True, False], ids=["continuous", "whole"])
def continuous(request) -> bool:
    return request.param


@pytest.fixture
def engine(model, continuous):
    eng = HFEngine(model, max_batch_size=16, continuous_batching=continuous)
    yield eng
    asyncio.run(eng.close())


def prompt(i: int, length: int | None = None) -> list[int]:
    length = length or 3 + (5 * i) % 11
    return [(7 * i + 3 * k + 11) % 500 + 5 for k in range(length)]


def run(coro):
    return asyncio.run(coro)


def teacher_forced_log_probs(model, request: GenerationRequest, output: list[int]) -> list[float]:
    """Log-probs of `output` under the sampling distribution, from one full forward pass (no cache)."""
    device = next(model.parameters()).device
    ids = torch.tensor([request.prompt_ids + output[:-1]], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(request.prompt_ids) - 1:].float().cpu()
    n = logits.shape[0]
    log_probs = sampling_log_probs(logits, torch.full((n,), request.temperature), torch.full((n,), request.top_p))
    return log_probs.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, Engine)


def count_prefills(engine, monkeypatch) -> list[int]:
    """Sizes of the prefills (one per batch, or per group admitted together in continuous mode)."""
    sizes: list[int] = []
    original = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda reqs, *held: (sizes.append(len(reqs)), original(reqs, *held))[1])
    return sizes


def test_concurrent_calls_are_batched_and_results_stay_in_order(engine, monkeypatch):
    batch_sizes = count_prefills(engine, monkeypatch)
    calls = [[GenerationRequest(prompt(2 * c + j), max_tokens=4 + c, temperature=1.0, seed=100 * c + j)
              for j in range(2)]
             for c in range(8)]

    async def main():
        return await asyncio.gather(*(engine.generate(reqs) for reqs in calls))

    async def one_by_one():
        return [(await engine.generate([request]))[0] for reqs in calls for request in reqs]

    together = run(main())
    atol = logprob_atol(engine.model, [r.prompt_ids for reqs in calls for r in reqs])
    assert sum(batch_sizes) == 16 and len(batch_sizes) < 8, batch_sizes  # calls shared batches
    alone = iter(run(one_by_one()))
    for reqs, results in zip(calls, together, strict=True):
        assert len(results) == len(reqs)
        for request, result in zip(reqs, results, strict=True):
            assert result.finish_reason == "length" and len(result.output_ids) == request.max_tokens
            single = next(alone)  # same seed alone: same tokens, so results came back in order
            assert single.output_ids == result.output_ids
            assert single.log_probs == pytest.approx(result.log_probs, abs=atol)


def test_max_batch_size_and_token_budget_split_batches(model, continuous, monkeypatch):
    engine = HFEngine(model, max_batch_size=3, max_batch_tokens=10_000, continuous_batching=continuous)
    sizes = count_prefills(engine, monkeypatch)
    run(engine.generate([GenerationRequest(prompt(i), max_tokens=2) for i in range(7)]))
    assert sizes == [3, 3, 1]
    sizes.clear()
    engine.max_batch_size, engine.max_batch_tokens = 16, 2 * (10 + 6)  # two padded rows of 10 + 6 tokens
    run(engine.generate([GenerationRequest(prompt(i, 10), max_tokens=6) for i in range(5)]))
    assert sizes == [2, 2, 1]
    run(engine.close())


def test_stop_token_ends_a_request_and_is_kept(engine):
    base = GenerationRequest(prompt(1), max_tokens=12, temperature=0.0)
    free = run(engine.generate([base]))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 12
    stop = free.output_ids[3]
    cut = free.output_ids.index(stop) + 1
    stopped = run(engine.generate([GenerationRequest(base.prompt_ids, max_tokens=12, temperature=0.0,
                                                     stop_token_ids=[stop])]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == free.output_ids[:cut] and len(stopped.log_probs) == cut


def test_sampled_stops_and_lengths_in_one_batch(engine):
    stops = list(range(0, 512, 3))  # about a third of the vocabulary stops a request
    reqs = [GenerationRequest(prompt(i), max_tokens=1 + i % 9, temperature=1.0, seed=i, stop_token_ids=stops)
            for i in range(16)]
    results = run(engine.generate(reqs))
    assert {r.finish_reason for r in results} == {"stop", "length"}
    for request, result in zip(reqs, results, strict=True):
        assert len(result.output_ids) == len(result.log_probs) <= request.max_tokens
        assert not any(t in stops for t in result.output_ids[:-1])
        if result.finish_reason == "stop":
            assert result.output_ids[-1] in stops
        else:
            assert len(result.output_ids) == request.max_tokens and result.output_ids[-1] not in stops


def test_greedy_is_deterministic_and_is_the_argmax(engine, model):
    reqs = [GenerationRequest(prompt(i), max_tokens=8, temperature=0.0) for i in range(4)]
    first, second = run(engine.generate(reqs)), run(engine.generate(reqs[::-1]))[::-1]
    for request, a, b in zip(reqs, first, second, strict=True):
        assert a.output_ids == b.output_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([request.prompt_ids + a.output_ids[:-1]])).logits[0]
        assert logits[len(request.prompt_ids) - 1:].argmax(-1).tolist() == a.output_ids


def test_seeded_sampling_does_not_depend_on_batch_mates(engine):
    target = GenerationRequest(prompt(3), max_tokens=10, temperature=1.0, seed=1234)
    alone = run(engine.generate([target]))[0]
    mates = [GenerationRequest(prompt(i, 2 + 3 * i), max_tokens=3 + i, temperature=0.8, seed=i) for i in range(5)]
    in_batch = run(engine.generate([*mates[:2], target, *mates[2:]]))[2]
    assert in_batch.output_ids == alone.output_ids
    assert in_batch.log_probs == pytest.approx(alone.log_probs, abs=logprob_atol(engine.model, [target.prompt_ids]))
    other_seed = run(engine.generate([GenerationRequest(target.prompt_ids, 10, temperature=1.0, seed=4321)]))[0]
    assert other_seed.output_ids != alone.output_ids


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.7, 0.9), (0.0, 1.0)])
def test_log_probs_match_teacher_forcing(engine, model, temperature, top_p):
    reqs = [GenerationRequest(prompt(i), max_tokens=12, temperature=temperature, top_p=top_p, seed=i)
            for i in range(6)]
    results = run(engine.generate(reqs))
    for request, result in zip(reqs, results, strict=True):
        expected = teacher_forced_log_probs(model, request, result.output_ids)
        assert max(abs(a - b) for a, b in zip(result.log_probs, expected, strict=True)) <= 1e-4
        assert all(lp > -1e9 for lp in result.log_probs)  # every sampled token lies inside the nucleus


def test_sampling_log_probs_temperature_and_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    out = sampling_log_probs(logits, torch.tensor([1.0, 0.5, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.75, 0.5]))
    assert out[0].exp().tolist() == pytest.approx(probs[0].tolist(), abs=1e-6)
    tempered = probs[0] ** 2 / (probs[0] ** 2).sum()
    assert out[1].exp().tolist() == pytest.approx(tempered.tolist(), abs=1e-6)
    assert out[2].exp().tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)  # 0.5 + 0.3 reaches 0.75
    assert out[3].exp().tolist() == pytest.approx(probs[0].tolist(), abs=1e-6)  # greedy: raw distribution


def test_sample_tokens_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    n = 20_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens = sample_tokens(probs.log().expand(n, 4), torch.ones(n), uniforms)
    frequencies = torch.bincount(tokens, minlength=4).float() / n
    assert frequencies.tolist() == pytest.approx(probs.tolist(), abs=0.015)
    greedy = sample_tokens(probs.log()[None], torch.zeros(1), torch.tensor([0.99]))
    assert greedy.tolist() == [0]


def test_failing_batch_fails_its_waiters_and_engine_keeps_serving(engine, monkeypatch):
    original = engine.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.model, "forward", broken)
    results = run(engine.generate([GenerationRequest(prompt(i), max_tokens=3) for i in range(3)]))
    assert all(r.finish_reason == "error" and "injected fault" in r.error and r.output_ids == [] for r in results)
    monkeypatch.setattr(engine.model, "forward", original)

    async def again():  # same loop: the worker survived the failure
        monkeypatch.setattr(engine.model, "forward", broken)
        failed = await engine.generate([GenerationRequest(prompt(1), max_tokens=3)])
        monkeypatch.setattr(engine.model, "forward", original)
        return failed, await engine.generate([GenerationRequest(prompt(2), max_tokens=3)])

    failed, ok = run(again())
    assert failed[0].finish_reason == "error" and ok[0].finish_reason == "length"


def test_dead_worker_fails_pending_requests_and_restarts(engine, monkeypatch):
    original = engine._take_batch

    def crash(*args):
        raise RuntimeError("worker bug")

    monkeypatch.setattr(engine, "_take_batch", crash)
    results = run(engine.generate([GenerationRequest(prompt(i), max_tokens=2) for i in range(2)]))
    assert [r.finish_reason for r in results] == ["error", "error"] and "worker stopped" in results[0].error
    monkeypatch.setattr(engine, "_take_batch", original)
    assert run(engine.generate([GenerationRequest(prompt(0), max_tokens=2)]))[0].finish_reason == "length"


def test_event_loop_stays_responsive_during_a_batch(engine, monkeypatch):
    original = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda reqs, *held: (time.sleep(0.3), original(reqs, *held))[1])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.ensure_future(ticker())
        await engine.generate([GenerationRequest(prompt(0), max_tokens=2)])
        task.cancel()
        return ticks

    assert run(main()) >= 10  # the blocking torch work ran off the event loop


def test_out_of_vocabulary_request_fails_alone(engine):
    results = run(engine.generate([GenerationRequest([5, 10**6], max_tokens=2),
                                   GenerationRequest(prompt(0), max_tokens=2)]))
    assert results[0].finish_reason == "error" and "vocabulary" in results[0].error
    assert results[1].finish_reason == "length"


def test_timeout_and_close_never_hang(model, continuous, monkeypatch):
    engine = HFEngine(model, request_timeout_s=0.2, continuous_batching=continuous)
    original = engine._prefill
    monkeypatch.setattr(engine, "_prefill", lambda reqs, *held: (time.sleep(0.6), original(reqs, *held))[1])
    result = run(engine.generate([GenerationRequest(prompt(0), max_tokens=2)]))[0]
    assert result.finish_reason == "error" and "timed out after 0.2 s" in result.error
    assert "raise engine.request_timeout_s" in result.error  # what a user on a slow machine changes

    async def close_while_waiting():
        task = asyncio.ensure_future(engine.generate([GenerationRequest(prompt(1), max_tokens=2)] * 2))
        await asyncio.sleep(0.05)
        await engine.close()
        return await asyncio.wait_for(task, 5)

    engine.request_timeout_s = None
    results = run(close_while_waiting())
    assert [r.finish_reason for r in results] == ["error", "error"]
    with pytest.raises(EngineError, match="closed"):
        run(engine.generate([GenerationRequest(prompt(0), max_tokens=2)]))


def test_weight_sync_copies_and_reload_from_path(tmp_path):
    engine = HFEngine(sharp_model(seed=0))
    trainer_model = sharp_model(seed=1)
    reference = HFEngine(sharp_model(seed=1))
    request = GenerationRequest(prompt(4), max_tokens=6, temperature=0.0)
    before = run(engine.generate([request]))[0]
    run(engine.sync_from(WeightsInMemory(trainer_model.state_dict())))
    synced = run(engine.generate([request]))[0]
    expected = run(reference.generate([request]))[0]
    assert synced.output_ids == expected.output_ids != before.output_ids
    assert synced.log_probs == pytest.approx(expected.log_probs, abs=1e-6)
    with torch.no_grad():
        trainer_model.model.embed_tokens.weight.zero_()  # training on: the engine's copy must not move
    assert run(engine.generate([request]))[0].log_probs == synced.log_probs
    with pytest.raises(EngineError, match="do not fit"):
        engine.load_weights({"nonsense.weight": torch.zeros(1)})

    folder = save_tiny_model(tmp_path / "m", seed=3)
    from_folder = HFEngine.from_pretrained(folder, device="cpu")
    assert from_folder.tokenizer is not None and from_folder.dtype == torch.float32
    engine.reload_from_path(folder)
    assert run(engine.generate([request]))[0].output_ids == run(from_folder.generate([request]))[0].output_ids
    with pytest.raises(EngineError, match="cannot load"):
        engine.reload_from_path(tmp_path / "missing")


def test_empty_call(model, continuous):
    engine = HFEngine(model, continuous_batching=continuous)
    assert run(engine.generate([])) == []
    results = run(engine.generate([GenerationRequest(prompt(i), max_tokens=2) for i in range(3)]))
    assert all(isinstance(r, GenerationResult) and r.finish_reason == "length" for r in results)
    run(engine.close())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_float32_log_probs_and_bfloat16_default():
    model = sharp_model()
    engine = HFEngine(model, device="cuda", dtype="float32")
    reqs = [GenerationRequest(prompt(i), max_tokens=12, temperature=0.7, top_p=0.9, seed=i) for i in range(6)]
    cpu_model = sharp_model()
    for request, result in zip(reqs, run(engine.generate(reqs)), strict=True):
        expected = teacher_forced_log_probs(cpu_model, request, result.output_ids)
        assert max(abs(a - b) for a, b in zip(result.log_probs, expected, strict=True)) <= 1e-4

    auto = HFEngine(sharp_model(), device="auto", dtype="auto")
    assert auto.device.type == "cuda" and auto.dtype == torch.bfloat16
    results = run(auto.generate(reqs))
    assert all(r.finish_reason == "length" and len(r.output_ids) == 12 for r in results)
    bf16_model = sharp_model().to("cuda", torch.bfloat16)
    for request, result in zip(reqs, results, strict=True):
        expected = teacher_forced_log_probs(bf16_model, request, result.output_ids)
        gap = sum(abs(a - b) for a, b in zip(result.log_probs, expected, strict=True)) / len(expected)
        assert gap < 0.1, f"bf16 cached decode drifts from the teacher-forced pass by {gap:.3f} nats per token"


def test_from_pretrained_pins_the_revision(monkeypatch, tmp_path):
    """A hub id is loaded at the recipe's pinned revision (checked without a download)."""
    import memrl.engines.hf as hf

    seen = {}
    tok = build_tiny_tokenizer()

    def fake_model(path, **kw):
        seen["model"] = (path, kw.get("revision"))
        return build_tiny_model(len(tok), layers=1, hidden=32)

    def fake_tok(path, **kw):
        seen["tokenizer"] = (path, kw.get("revision"))
        return tok

    monkeypatch.setattr(hf.AutoModelForCausalLM, "from_pretrained", fake_model)
    monkeypatch.setattr(hf.AutoTokenizer, "from_pretrained", fake_tok)
    hf.HFEngine.from_pretrained("Qwen/Qwen3-0.6B", device="cpu", revision="c1899de2")
    assert seen == {"model": ("Qwen/Qwen3-0.6B", "c1899de2"), "tokenizer": ("Qwen/Qwen3-0.6B", "c1899de2")}


@pytest.mark.parametrize("config", [None, '{"model_type": "no-such-architecture"}'])
def test_a_folder_without_a_loadable_model_is_an_engine_error_naming_it(tmp_path, config):
    # transformers says OSError for a missing config and ValueError for an architecture it does not know;
    # every caller (memrl serve, the factory, a reload) gets the same EngineError, which the CLI prints in one line.
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(EngineError, match=f"cannot load a model from {tmp_path}"):
        HFEngine.from_pretrained(tmp_path, device="cpu", dtype="float32")
