"""Which HTTP call `OpenAIEngine.reload_weights` makes for each server kind (the table in docs/servers.md).

A recording server answers every route with success and logs each request, so the test sees the whole
conversation: the reload endpoint used for memrl serve and SGLang, and for vLLM none at all (memrl does
not drive vLLM's weight-transfer or pause routes).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from memrl.engines.base import EngineError
from memrl.engines.openai import OpenAIEngine

sys.path.insert(0, str(Path(__file__).parent))
from test_server import serve_in_thread  # noqa: E402


def recording_server(owned_by: str, calls: list[tuple[str, str, object]]) -> FastAPI:
    """Lists one model owned by `owned_by`; any other request is recorded and answered with success."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owned_by}]}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def anything(path: str, request: Request) -> dict:
        body = await request.body()
        calls.append((request.method, "/" + path, await request.json() if body else None))
        return {"success": True, "message": "ok"}

    return app


@pytest.mark.parametrize(
    ("owned_by", "expected"),
    [
        ("memrl", [("POST", "/v1/reload_weights", {"path": "/runs/r/weights_sync"})]),
        ("sglang", [("POST", "/update_weights_from_disk", {"model_path": "/runs/r/weights_sync"})]),
    ],
)
def test_reload_calls_the_servers_reload_from_disk_endpoint(owned_by, expected):
    calls: list = []
    with serve_in_thread(recording_server(owned_by, calls)) as url:
        engine = OpenAIEngine(url)
        asyncio.run(engine.reload_weights("/runs/r/weights_sync"))
    assert calls == expected


def test_reload_on_vllm_sends_nothing_and_says_what_to_use():
    # vLLM's RL routes (/init_weight_transfer_engine ... /finish_weight_update, /pause, /sleep) take tensors
    # over NCCL or CUDA IPC, not a folder; memrl's weight sync is a folder, so it sends none of them.
    calls: list = []
    with serve_in_thread(recording_server("vllm", calls)) as url:
        with pytest.raises(EngineError, match="no reload endpoint.*`memrl serve` or SGLang"):
            asyncio.run(OpenAIEngine(url).reload_weights("/runs/r/weights_sync"))
    assert calls == []
