"""OpenAIEngine (memrl.engines.openai) against real servers on loopback: `memrl serve` in a thread and
in a subprocess, and small stand-ins for vLLM and SGLang that answer in their shapes."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from memrl.engines.base import EngineError, GenerationRequest
from memrl.engines.openai import MISSING_IDS_HINT, OpenAIEngine
from memrl.engines.server import create_app

sys.path.insert(0, str(Path(__file__).parent))  # FakeEngine & co. live in the server's test file
from test_server import FakeEngine, bound_loopback_socket, serve_in_thread  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]


def requests_for_test() -> list[GenerationRequest]:
    first = FakeEngine.expected(GenerationRequest([3, 4], 6)).output_ids
    return [
        GenerationRequest([1, 2, 3], 5, seed=1),
        GenerationRequest([3, 4], 6, stop_token_ids=[first[2]]),  # stops on its third token
        GenerationRequest([7], 1, temperature=0.0),
    ]


def run(coro):
    return asyncio.run(coro)


async def generate_and_close(engine: OpenAIEngine, requests: list[GenerationRequest]):
    try:
        return await engine.generate(requests)
    finally:
        await engine.close()


def test_results_through_memrl_serve_equal_the_engine_s():
    with serve_in_thread(create_app(FakeEngine(), "fake")) as url:
        engine = OpenAIEngine(url)
        results = run(generate_and_close(engine, requests_for_test()))
    assert engine.server_kind == "memrl" and engine.model == "fake"  # found through /v1/models
    for request, result in zip(requests_for_test(), results, strict=True):
        assert result == FakeEngine.expected(request)
    assert [r.finish_reason for r in results] == ["length", "stop", "length"]


def test_concurrency_limit_is_respected():
    fake = FakeEngine(delay_s=0.05)
    with serve_in_thread(create_app(fake, "fake")) as url:
        engine = OpenAIEngine(url + "/v1", max_concurrency=3)
        results = run(generate_and_close(engine, [GenerationRequest([i + 1], 2) for i in range(12)]))
    assert all(r.finish_reason == "length" for r in results)
    assert 2 <= fake.max_active <= 3  # without the limit all 12 would overlap


def test_connection_refused_is_retried_then_fails_clearly_in_bounded_time():
    sock = bound_loopback_socket()  # bound, never listening: every connection is refused
    port = sock.getsockname()[1]
    engine = OpenAIEngine(
        f"http://127.0.0.1:{port}", model="m", server_kind="memrl", max_retries=2, backoff_s=0.05
    )
    start = time.monotonic()
    [result] = run(generate_and_close(engine, [GenerationRequest([1], 2)]))
    elapsed = time.monotonic() - start
    sock.close()
    assert result.finish_reason == "error" and result.output_ids == []
    assert "failed after 3 attempts" in result.error and "cannot reach the server" in result.error
    assert 0.15 <= elapsed < 5  # two backoffs of 0.05 and 0.1 s


def test_many_requests_to_a_dead_server_fail_in_one_retry_cycle():
    sock = bound_loopback_socket()
    engine = OpenAIEngine(f"http://127.0.0.1:{sock.getsockname()[1]}", max_retries=2, backoff_s=0.2)
    start = time.monotonic()
    results = run(generate_and_close(engine, [GenerationRequest([1], 2) for _ in range(20)]))
    elapsed = time.monotonic() - start
    sock.close()
    assert all(
        r.finish_reason == "error" and "/v1/models failed after 3 attempts" in r.error for r in results
    )
    assert elapsed < 3  # one discovery cycle (0.2 + 0.4 s), not one per request (20 x 0.6 s)


def test_a_server_that_comes_up_late_is_reached_by_retries():
    sock = bound_loopback_socket()
    with serve_in_thread(create_app(FakeEngine(), "fake"), sock=sock, start_delay_s=0.3) as url:
        engine = OpenAIEngine(url, max_retries=8, backoff_s=0.1)
        [result] = run(generate_and_close(engine, [GenerationRequest([5], 3)]))
    assert result == FakeEngine.expected(GenerationRequest([5], 3))


def vllm_like_app(mode: str, calls: list[dict]) -> FastAPI:
    """Answers /v1/completions as vLLM would, in a few variants chosen by `mode`."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "served-model", "object": "model", "owned_by": "vllm"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        calls.append(body)
        if mode == "unavailable_twice" and len(calls) <= 2:
            return JSONResponse({"error": {"message": "warming up"}}, status_code=503)
        if mode == "slow":
            await asyncio.sleep(3)
        ids = FakeEngine.expected(GenerationRequest(body["prompt"], body["max_tokens"])).output_ids
        logprobs = {
            "tokens": [f"t{t}" for t in ids],
            "token_logprobs": [-0.5] * len(ids),
            "top_logprobs": None,
        }
        choice = {"index": 0, "text": "some text", "logprobs": logprobs, "finish_reason": "length"}
        if mode == "token_id_strings":
            logprobs["tokens"] = [f"token_id:{t}" for t in ids]
        elif mode == "no_logprobs":
            choice["token_ids"], choice["logprobs"] = ids, None
        elif mode != "no_ids":
            choice["token_ids"] = ids
        return {"choices": [choice]}

    return app


def test_vllm_request_fields_and_response_parsing():
    calls: list[dict] = []
    with serve_in_thread(vllm_like_app("ok", calls)) as url:
        engine = OpenAIEngine(url)
        [result] = run(generate_and_close(engine, [GenerationRequest([1, 2], 4, seed=9, stop_token_ids=[5])]))
    assert engine.server_kind == "vllm"
    assert result.output_ids == FakeEngine.expected(GenerationRequest([1, 2], 4)).output_ids
    assert result.log_probs == [-0.5] * 4
    sent = calls[0]
    assert sent["model"] == "served-model" and sent["prompt"] == [1, 2]
    assert sent["return_token_ids"] is True and sent["logprobs"] == 1 and sent["skip_special_tokens"] is False
    assert sent["seed"] == 9 and sent["stop_token_ids"] == [5] and sent["max_tokens"] == 4


def test_missing_token_ids_fail_with_the_flag_to_enable():
    with serve_in_thread(vllm_like_app("no_ids", [])) as url:
        [result] = run(generate_and_close(OpenAIEngine(url), [GenerationRequest([1], 2)]))
    assert result.finish_reason == "error"
    assert result.error == MISSING_IDS_HINT
    assert "return_token_ids" in result.error and "--return-tokens-as-token-ids" in result.error


def test_missing_logprobs_fail_clearly():
    with serve_in_thread(vllm_like_app("no_logprobs", [])) as url:
        [result] = run(generate_and_close(OpenAIEngine(url), [GenerationRequest([1], 2)]))
    assert result.finish_reason == "error" and "token_logprobs" in result.error


def test_token_ids_are_read_from_token_id_strings():
    with serve_in_thread(vllm_like_app("token_id_strings", [])) as url:
        [result] = run(generate_and_close(OpenAIEngine(url), [GenerationRequest([8], 3)]))
    assert result.output_ids == FakeEngine.expected(GenerationRequest([8], 3)).output_ids


def test_503_is_retried():
    calls: list[dict] = []
    with serve_in_thread(vllm_like_app("unavailable_twice", calls)) as url:
        [result] = run(
            generate_and_close(OpenAIEngine(url, model="m", backoff_s=0.01), [GenerationRequest([8], 2)])
        )
    assert result.finish_reason == "length" and len(calls) == 3


def test_a_slow_server_times_out_without_retrying():
    calls: list[dict] = []
    with serve_in_thread(vllm_like_app("slow", calls)) as url:
        engine = OpenAIEngine(url, model="m", server_kind="vllm", timeout_s=0.5, max_retries=3)
        start = time.monotonic()
        [result] = run(generate_and_close(engine, [GenerationRequest([8], 2)]))
        elapsed = time.monotonic() - start
    assert result.finish_reason == "error" and "timed out after 0.5 s" in result.error
    assert elapsed < 2.5 and len(calls) == 1


def test_4xx_from_the_server_is_reported_not_retried():
    fake = FakeEngine()
    with serve_in_thread(create_app(fake, "fake", api_key="k", max_prompt_tokens=4)) as url:
        no_key = OpenAIEngine(url, model="fake", server_kind="memrl", backoff_s=0.01)
        [denied] = run(generate_and_close(no_key, [GenerationRequest([1], 2)]))
        with_key = OpenAIEngine(url, api_key="k")
        too_long, fine = run(
            generate_and_close(with_key, [GenerationRequest([1] * 5, 2), GenerationRequest([1], 2)])
        )
    assert "HTTP 401" in denied.error and "API key" in denied.error
    assert "HTTP 400" in too_long.error and "at most 4" in too_long.error
    assert fine == FakeEngine.expected(GenerationRequest([1], 2))
    assert len(fake.requests) == 1  # neither refusal reached the engine, nor was retried into it


def test_reload_weights_on_memrl_serve(tmp_path):
    fake = FakeEngine()
    with serve_in_thread(create_app(fake, "fake", reload_roots=[tmp_path])) as url:
        engine = OpenAIEngine(url)
        run(engine.reload_weights(str(tmp_path)))
        with pytest.raises(EngineError, match="not a folder"):
            run(engine.reload_weights(str(tmp_path / "missing")))
    assert [Path(p).name for p in fake.reloads] == [tmp_path.name]  # a private copy of it


def test_reload_weights_on_vllm_is_a_clear_error():
    with serve_in_thread(vllm_like_app("ok", [])) as url:
        with pytest.raises(EngineError, match="no reload endpoint"):
            run(OpenAIEngine(url).reload_weights("/tmp"))


def sglang_like_app(calls: list[dict]) -> FastAPI:
    """SGLang's native API: /generate with meta_info.output_token_logprobs, /update_weights_from_disk."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "qwen", "object": "model", "owned_by": "sglang"}]}

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        calls.append(body)
        params = body["sampling_params"]
        want = FakeEngine.expected(
            GenerationRequest(
                body["input_ids"],
                params["max_new_tokens"],
                stop_token_ids=params["stop_token_ids"],
                seed=params.get("sampling_seed"),
            )
        )
        entries = [[lp, t, None] for lp, t in zip(want.log_probs, want.output_ids, strict=True)]
        finish = {"type": want.finish_reason, "matched": want.output_ids[-1]}
        return {"text": "...", "meta_info": {"output_token_logprobs": entries, "finish_reason": finish}}

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        calls.append(await request.json())
        return {"success": True, "message": "ok"}

    return app


def test_sglang_native_generate_and_reload():
    calls: list[dict] = []
    requests = requests_for_test()
    with serve_in_thread(sglang_like_app(calls)) as url:
        engine = OpenAIEngine(url)
        results = run(engine.generate(requests))
        run(engine.reload_weights("/models/step-7"))
        run(engine.close())
    assert engine.server_kind == "sglang"
    for request, result in zip(requests, results, strict=True):
        want = FakeEngine.expected(request)
        assert (result.output_ids, result.log_probs, result.finish_reason) == (
            want.output_ids,
            want.log_probs,
            want.finish_reason,
        )
    first = calls[0]
    assert first["return_logprob"] is True and first["input_ids"] == [1, 2, 3]
    assert first["sampling_params"]["sampling_seed"] == 1
    assert calls[-1] == {"model_path": "/models/step-7"}


def test_sync_from_reloads_the_folder_the_weight_source_saved():
    # The engine contract's weight sync: a served engine takes the source's folder, never its tensors.
    class Source:
        saved = 0

        def whole_weights(self):
            raise AssertionError("a served engine must not ask for the weights in memory")

        def saved_folder(self):
            Source.saved += 1
            return "/runs/r/weights_sync"

    calls: list[dict] = []
    with serve_in_thread(sglang_like_app(calls)) as url:
        engine = OpenAIEngine(url)
        run(engine.sync_from(Source()))
        run(engine.close())
    assert Source.saved == 1 and calls[-1] == {"model_path": "/runs/r/weights_sync"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server_process(
    args: list[str], env: dict[str, str], timeout_s: float = 60
) -> tuple[subprocess.Popen, str]:
    """`python -m memrl.cli serve ARGS` on a free loopback port; waits for /health."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memrl.cli", "serve", *args, "--port", str(port), "--log-level", "warning"],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not answer /health within {timeout_s} s:\n{proc.communicate()[0]}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def test_client_against_a_server_subprocess(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)]),
        "MEMRL_API_KEY": "from-env",
    }
    engine_args = ["--engine", "test_server:make_fake_engine", "--served-model-name", "sub"]
    folders = ["--model", str(tmp_path), "--reload-root", str(tmp_path)]
    proc, url = start_server_process([*folders, *engine_args], env)
    try:
        engine = OpenAIEngine(url, api_key="from-env", max_concurrency=2)
        results = run(generate_and_close(engine, requests_for_test()))
        run(OpenAIEngine(url, api_key="from-env").reload_weights(str(tmp_path)))
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 401  # the key came from the env
    finally:
        stop(proc)
    assert engine.model == "sub"
    assert results == [FakeEngine.expected(r) for r in requests_for_test()]


@pytest.mark.slow
def test_greedy_through_memrl_serve_equals_hf_engine_in_process(tmp_path):
    # Imported here, not at collection: torch and transformers take seconds to import.
    try:
        from memrl.engines.hf import HFEngine
        from memrl.tiny import save_tiny_model
    except ImportError as err:
        pytest.skip(f"memrl.engines.hf / memrl.tiny.save_tiny_model not available: {err}")

    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir)
    requests = [
        GenerationRequest([5, 6, 7, 8], 8, temperature=0.0),
        GenerationRequest([9, 10, 11], 6, temperature=0.0, stop_token_ids=[2]),
    ]

    async def local():
        engine = HFEngine.from_pretrained(str(model_dir), device="cpu")
        try:
            return await engine.generate(requests)
        finally:
            await engine.close()

    want = run(local())
    proc, url = start_server_process(
        ["--model", str(model_dir), "--device", "cpu"], dict(os.environ), timeout_s=180
    )
    try:
        got = run(generate_and_close(OpenAIEngine(url, timeout_s=120), requests))
    finally:
        stop(proc)
    from numerics import logprob_atol
    from transformers import AutoModelForCausalLM

    atol = logprob_atol(AutoModelForCausalLM.from_pretrained(model_dir), [r.prompt_ids for r in requests])
    for w, g in zip(want, got, strict=True):
        assert g.error is None, g.error
        assert g.output_ids == w.output_ids and g.finish_reason == w.finish_reason
        assert g.log_probs == pytest.approx(w.log_probs, abs=atol)  # another process: other thread blocking
