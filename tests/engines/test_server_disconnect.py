"""`memrl serve` stops working for clients that are gone, and stops within a bound when told to.

Generations here are made long by a throttled decode step (10 ms), so that without the cancellation
they would outlast every bound below many times over; the bounds only keep a failure from hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.engines.server import create_app
from memrl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model

sys.path.insert(0, str(Path(__file__).parent))
from test_server import serve_in_thread, wait_until  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
STEP_S = 0.01
LONG = 4000  # tokens: 40 s of throttled decoding, against no-hang bounds of 15-30 s
PROMPT = [5, 6, 7, 8]
MARKER_ENV = "MEMRL_TEST_DECODING_MARKER"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """A tiny model on one torch thread (tests/engines/conftest.py)."""


def throttled(engine: HFEngine, marker: Path | None = None) -> HFEngine:
    """`engine` with every model call taking at least STEP_S (and touching `marker`, if given)."""
    forward = engine._forward

    def slow_forward(*args):
        if marker is not None:
            marker.touch()
        threading.Event().wait(STEP_S)
        return forward(*args)

    engine._forward = slow_forward
    return engine


def tiny_engine(**kwargs) -> HFEngine:
    return throttled(HFEngine(build_tiny_model(len(build_tiny_tokenizer()), layers=1, hidden=32), **kwargs))


def decode_thread_left(engine: HFEngine, timeout_s: float) -> bool:
    """Whether the decode thread ended its batch within `timeout_s` (it holds the lock while decoding)."""
    if not engine._lock.acquire(timeout=timeout_s):
        return False
    engine._lock.release()
    return True


@pytest.mark.parametrize("request_timeout_s", [None, 60.0])
def test_a_cancelled_generate_call_drops_its_row_from_the_batch(request_timeout_s):
    # With request_timeout_s the engine waits on a shielded future: cancelling the caller must still
    # cancel the request, or the row decodes to max_tokens for nobody.
    engine = tiny_engine(request_timeout_s=request_timeout_s)

    async def main() -> bool:
        call = asyncio.ensure_future(engine.generate([GenerationRequest(PROMPT, max_tokens=LONG)]))
        deadline = time.monotonic() + 15
        while engine.stats.decode_steps < 3:
            assert time.monotonic() < deadline, "generation did not start"
            await asyncio.sleep(0.005)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        left = await asyncio.to_thread(decode_thread_left, engine, 15)
        await engine.close()
        return left

    assert asyncio.run(main()), "the cancelled request kept decoding"
    assert engine.stats.decode_steps < LONG


def post_then_hang_up(port: int, body: dict, until) -> None:
    """Send a completions request on a raw socket, wait for `until()`, then close the socket unanswered."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(head.encode() + data)
        wait_until(until, timeout_s=15)


def test_a_client_that_disconnects_mid_generation_frees_the_engine():
    engine = tiny_engine()
    with serve_in_thread(create_app(engine, "tiny")) as url:
        port = int(url.rsplit(":", 1)[1])
        post_then_hang_up(port, {"prompt": PROMPT, "max_tokens": LONG}, lambda: engine.stats.decode_steps >= 3)
        freed = decode_thread_left(engine, 15)
        steps = engine.stats.decode_steps
        after = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
    assert freed, "the engine kept generating for a client that had gone"
    assert steps < LONG
    assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) == 2


def busy_engine(model_path: str) -> HFEngine:
    """`--engine test_server_disconnect:busy_engine`: the tiny model, throttled, telling when it decodes."""
    engine = HFEngine.from_pretrained(model_path, device="cpu")
    return throttled(engine, Path(os.environ[MARKER_ENV]))


@pytest.mark.slow
def test_sigterm_stops_a_server_busy_generating_within_its_shutdown_timeout(tmp_path):
    # Without a bound uvicorn waits for every open request: here 16 prompts x 4000 throttled tokens.
    model = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    marker = tmp_path / "decoding"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO_ROOT)]),
        MARKER_ENV: str(marker),
    }
    cmd = [sys.executable, "-m", "memrl.cli", "serve", "--model", str(model), "--port", str(port),
           "--engine", "test_server_disconnect:busy_engine", "--shutdown-timeout-s", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    body = {"prompt": [PROMPT] * 16, "max_tokens": LONG}
    client = threading.Thread(target=lambda: _post_quietly(f"http://127.0.0.1:{port}", body), daemon=True)
    try:
        deadline = time.monotonic() + 120
        while not _healthy(port):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "memrl serve did not start within 120 s"
            time.sleep(0.2)
        client.start()  # stays connected: the shutdown, not a disconnect, must end its generation
        wait_until(marker.exists, timeout_s=30)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("memrl serve was still running 30 s after SIGTERM (--shutdown-timeout-s 1)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _post_quietly(url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the server goes away under it
        httpx.post(url + "/v1/completions", json=body, timeout=120)
