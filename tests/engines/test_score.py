"""`Engine.score`, the weight-sync canary's engine side: the local engine's teacher-forced log-probs, memrl
serve's POST /v1/score and the client reading it, and servers that cannot score saying so."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import httpx
import pytest
import torch

from memrl.engines.base import EngineError, ScoreResult
from memrl.engines.hf import HFEngine
from memrl.engines.openai import OpenAIEngine
from memrl.engines.server import create_app

sys.path.insert(0, str(Path(__file__).parent))
from numerics import logprob_atol, sharp_model  # noqa: E402
from test_openai_client import vllm_like_app  # noqa: E402
from test_server import FakeEngine, serve_in_thread  # noqa: E402

PROMPT, CONTINUATION = [5, 17, 42, 8, 99, 3], [61, 7, 200, 14]


def teacher_forced(model: torch.nn.Module, temperature: float) -> list[float]:
    """Log-probs of CONTINUATION after PROMPT, from one plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + CONTINUATION])).logits[0].float()
    log_p = torch.log_softmax(logits[len(PROMPT) - 1:-1] / temperature, dim=-1)
    return log_p.gather(-1, torch.tensor(CONTINUATION)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_local_engine_scores_each_continuation_token_from_its_own_position(one_torch_thread, temperature):
    model = sharp_model()
    engine = HFEngine(sharp_model(), device="cpu", dtype="float32")
    scored = asyncio.run(engine.score(PROMPT, CONTINUATION, temperature))
    assert scored.dtype == "float32"
    assert scored.log_probs == pytest.approx(teacher_forced(model, temperature),
                                             abs=logprob_atol(model, [PROMPT + CONTINUATION]))
    shifted = teacher_forced(model, temperature)[1:] + [0.0]  # one position off: far from it
    assert max(abs(a - b) for a, b in zip(scored.log_probs, shifted, strict=True)) > 0.1
    with pytest.raises(EngineError, match="in the vocabulary"):
        asyncio.run(engine.score(PROMPT, [10**6], temperature))


def test_a_score_behind_a_stuck_batch_fails_within_the_request_timeout(one_torch_thread):
    engine = HFEngine(sharp_model(), device="cpu", dtype="float32", request_timeout_s=0.2)
    engine._lock.acquire()  # what a running batch holds
    try:
        with pytest.raises(EngineError, match="score timed out after 0.2 s"):
            asyncio.run(engine.score(PROMPT, CONTINUATION, 1.0))
    finally:
        engine._lock.release()


def test_memrl_serve_scores_with_its_engine_and_the_client_reads_it(one_torch_thread):
    engine = HFEngine(sharp_model(), device="cpu", dtype="float32")
    direct = asyncio.run(engine.score(PROMPT, CONTINUATION, 1.0))
    app = create_app(engine, "tiny", vocab_size=engine.model.config.vocab_size, close_engine_on_shutdown=False)
    with serve_in_thread(app) as url:
        assert asyncio.run(OpenAIEngine(url).score(PROMPT, CONTINUATION, 1.0)) == direct
        bad = {"prompt_ids": PROMPT, "continuation_ids": [10**6]}
        assert httpx.post(url + "/v1/score", json=bad, timeout=10).status_code == 400
        empty = {"prompt_ids": PROMPT, "continuation_ids": []}
        assert httpx.post(url + "/v1/score", json=empty, timeout=10).status_code == 400


def test_a_non_finite_score_reaches_the_client_as_nan():
    # JSON has no NaN: the server sends null, the client reads NaN, which the canary then reports.
    class NaNScorer(FakeEngine):
        async def score(self, prompt_ids, continuation_ids, temperature):
            return ScoreResult([math.nan, -1.0], "bfloat16")

    with serve_in_thread(create_app(NaNScorer(), "fake")) as url:
        scored = asyncio.run(OpenAIEngine(url).score([1], [2, 3], 1.0))
    assert math.isnan(scored.log_probs[0]) and scored.log_probs[1:] == [-1.0] and scored.dtype == "bfloat16"


def test_an_engine_or_server_that_cannot_score_says_how_to_train_without_the_canary():
    with serve_in_thread(create_app(FakeEngine(), "fake")) as url:  # an --engine without score()
        response = httpx.post(url + "/v1/score", json={"prompt_ids": [1], "continuation_ids": [2]}, timeout=10)
        assert response.status_code == 501 and "cannot score" in response.json()["error"]["message"]
        with pytest.raises(EngineError, match="scoring the weight-sync probe failed: .*HTTP 501"):
            asyncio.run(OpenAIEngine(url).score([1], [2], 1.0))
    with serve_in_thread(vllm_like_app("ok", [])) as url:
        with pytest.raises(EngineError, match="server kind 'vllm' .* set train.sync_check=false"):
            asyncio.run(OpenAIEngine(url).score([1], [2], 1.0))
