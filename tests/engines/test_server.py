"""`memrl serve` (memrl.engines.server) over a fake engine, on a real uvicorn server on loopback.

Also home of `FakeEngine` and `serve_in_thread`, which tests/engines/test_openai_client.py imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from memrl.engines.base import GenerationRequest, GenerationResult
from memrl.engines.sampling import sampling_log_probs
from memrl.engines.server import create_app
from memrl.engines.server_requests import MAX_TEMPERATURE, MIN_TEMPERATURE, TEXT_PROMPT_MESSAGE

FAIL_TOKEN = 99  # a prompt holding it gets an `error` result
RAISE_TOKEN = 98  # a prompt holding it makes generate() raise


class FakeEngine:
    """Deterministic Engine: output token k = (sum(prompt) + 7k + seed) % 97, log-prob -(k+1)/10.

    Generation stops after a stop token (included) or at max_tokens. Records the largest number of
    concurrent generate() calls, every request, reloads and the order of events.
    """

    vocab_size = 100

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.active = 0
        self.max_active = 0
        self.requests: list[GenerationRequest] = []
        self.reloads: list[str] = []  # the folders loaded: each a private copy of the folder asked for
        self.reload_files: list[dict[str, bytes]] = []  # their files, read before the server deletes the copy
        self.events: list[str] = []
        self.closed = False

    @staticmethod
    def expected(request: GenerationRequest) -> GenerationResult:
        if FAIL_TOKEN in request.prompt_ids:
            return GenerationResult.failed("fake failure on token 99")
        ids: list[int] = []
        for k in range(request.max_tokens):
            ids.append((sum(request.prompt_ids) + 7 * k + (request.seed or 0)) % 97)
            if ids[-1] in request.stop_token_ids:
                break
        reason = "stop" if ids[-1] in request.stop_token_ids else "length"
        return GenerationResult(ids, [-(k + 1) / 10 for k in range(len(ids))], reason)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.events.append("generate_start")
        try:
            self.requests.extend(requests)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if any(RAISE_TOKEN in r.prompt_ids for r in requests):
                raise RuntimeError("fake engine exploded")
            return [self.expected(r) for r in requests]
        finally:
            self.active -= 1
            self.events.append("generate_end")

    def reload_from_path(self, path: str) -> None:
        self.events.append("reload")
        self.reloads.append(path)
        self.reload_files.append({p.relative_to(path).as_posix(): p.read_bytes()
                                  for p in sorted(Path(path).rglob("*")) if p.is_file()})

    async def close(self) -> None:
        self.closed = True


def make_fake_engine(model_path: str) -> FakeEngine:
    """`--engine test_server:make_fake_engine` for the server subprocess tests."""
    return FakeEngine()


def bound_loopback_socket() -> socket.socket:
    """A socket bound to a free loopback port, not yet listening (connections to it are refused)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve_in_thread(app, sock: socket.socket | None = None, start_delay_s: float = 0.0) -> Iterator[str]:
    """Run `app` with uvicorn in a thread on loopback; yields the base URL; stops it on exit."""
    sock = sock or bound_loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))

    def run() -> None:
        time.sleep(start_delay_s)
        server.run(sockets=[sock])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not start_delay_s:
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start within 10 s")
            time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def reload_root(tmp_path_factory) -> Path:
    """The folder `served` may reload from."""
    return tmp_path_factory.mktemp("reload_root")


@pytest.fixture(scope="module")
def served(reload_root) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    app = create_app(
        engine,
        "fake",
        max_prompt_tokens=8,
        max_tokens_limit=32,
        max_batch_prompts=4,
        max_request_bytes=2000,
        vocab_size=FakeEngine.vocab_size,
        reload_roots=[reload_root],
    )
    with serve_in_thread(app) as url:
        yield url, engine


def post(url: str, body, **kwargs) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=10, **kwargs)


def test_completion_returns_token_ids_logprobs_and_usage(served):
    url, _ = served
    r = post(
        url,
        {
            "model": "fake",
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "seed": 4,
            "logprobs": 1,
            "stop_token_ids": [33],
        },
    )
    assert r.status_code == 200, r.text
    want = FakeEngine.expected(GenerationRequest([1, 2, 3], 5, seed=4, stop_token_ids=[33]))
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want.output_ids
    assert choice["logprobs"]["token_logprobs"] == want.log_probs
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want.output_ids]
    assert choice["finish_reason"] == want.finish_reason == "length"
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


def test_stop_token_gives_stop_and_logprobs_only_when_asked(served):
    url, _ = served
    first = FakeEngine.expected(GenerationRequest([5], 4)).output_ids
    r = post(url, {"prompt": [5], "max_tokens": 4, "stop_token_ids": [first[1]]})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == first[:2]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None


def test_batch_prompts_answer_in_order_with_distinct_seeds(served):
    url, engine = served
    r = post(url, {"prompt": [[1, 2], [3], [1, 2]], "max_tokens": 3, "seed": 10, "logprobs": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    seeds = [r.seed for r in engine.requests[-3:]]
    assert seeds == [10, 11, 12]
    want = [
        FakeEngine.expected(GenerationRequest(p, 3, seed=s))
        for p, s in zip([[1, 2], [3], [1, 2]], seeds, strict=True)
    ]
    assert [c["token_ids"] for c in choices] == [w.output_ids for w in want]
    assert choices[0]["token_ids"] != choices[2]["token_ids"]  # same prompt, different seed


@pytest.mark.parametrize("prompt", ["Hello there", ["Hello", "there"]])
def test_text_prompts_are_refused_with_a_clear_400(served, prompt):
    r = post(served[0], {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400
    assert TEXT_PROMPT_MESSAGE in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": [1, "a"], "max_tokens": 2}, "must be ints"),
        ({"prompt": [1.5], "max_tokens": 2}, "must be ints"),
        ({"prompt": [1, True], "max_tokens": 2}, "must be ints"),
        ({"prompt": [], "max_tokens": 2}, "non-empty"),
        ({"prompt": [[1], []], "max_tokens": 2}, "prompt 1"),
        ({"prompt": {"ids": [1]}, "max_tokens": 2}, "non-empty list"),
        ({"max_tokens": 2}, "prompt"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1], "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [1], "temperature": -1}, "temperature"),
        ({"prompt": [1], "top_p": 0}, "top_p"),
        ({"prompt": [1], "stream": True}, "stream"),
        ({"prompt": [1], "n": 2}, "n"),
        ({"prompt": [1], "stop": ["\n"]}, "stop_token_ids"),
        ({"prompt": [1], "stop_token_ids": ["x"]}, "stop_token_ids"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(served, body, words):
    r = post(served[0], body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_invalid_json_is_a_400(served):
    r = httpx.post(
        served[0] + "/v1/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert "invalid request" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"prompt": list(range(9)), "max_tokens": 2}, "at most 8"),
        ({"prompt": [1], "max_tokens": 33}, "limit of 32"),
        ({"prompt": [[1]] * 5, "max_tokens": 2}, "limit is 4"),
        ({"prompt": [1, 100], "max_tokens": 2}, "token id 100 is outside"),
        ({"prompt": [1, -1], "max_tokens": 2}, "token id -1 is outside"),
        ({"prompt": [1], "max_tokens": 2, "stop_token_ids": [500]}, "token id 500"),
    ],
)
def test_server_limits_give_400(served, body, words):
    r = post(served[0], body)
    assert r.status_code == 400
    assert words in r.json()["error"]["message"]


def post_json_text(url: str, text: str) -> httpx.Response:
    """POST a body as written: JSON with Infinity/NaN, which httpx's `json=` refuses to encode."""
    headers = {"content-type": "application/json"}
    return httpx.post(url + "/v1/completions", content=text.encode(), headers=headers, timeout=10)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ('"temperature": Infinity', "temperature: Input should be a finite number"),
        ('"temperature": -Infinity', "temperature: Input should be a finite number"),
        ('"temperature": NaN', "temperature: Input should be a finite number"),
        ('"temperature": 1e-300', "temperature: must be 0 (greedy) or between 1e-06 and 100"),
        ('"temperature": 1e9', "temperature: must be 0 (greedy) or between"),
        ('"temperature": true', "temperature"),
        ('"temperature": "0.7"', "temperature"),
        ('"top_p": NaN', "top_p"),
        ('"top_p": Infinity', "top_p"),
        ('"top_p": true', "top_p"),
        (f'"seed": {2**70}', "seed: must be in [0, 2**63 - 1]"),
        (f'"seed": {2**63}', "seed: must be in [0, 2**63 - 1]"),
        ('"seed": -1', "seed: must be in [0, 2**63 - 1]"),
        ('"seed": 1.5', "seed"),
        ('"seed": true', "seed"),
        ('"max_tokens": true', "max_tokens"),
        ('"max_tokens": Infinity', "max_tokens"),
        ('"logprobs": true', "logprobs"),
        ('"n": true', "n"),
        ('"stop_token_ids": [true]', "stop_token_ids"),
    ],
)
def test_numeric_fields_must_be_finite_in_range_numbers(served, fields, words):
    # Before: temperature=Infinity was sampled (200) and seed=2**70 reached torch.Generator (a 500).
    r = post_json_text(served[0], '{"prompt": [1], "max_tokens": 2, ' + fields + "}")
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_batch_seeds_must_all_fit_int64(served):
    # Prompt i samples with seed + i: the last prompt's seed must be an int64 too.
    edge = 2**63 - 1
    one = post(served[0], {"prompt": [1], "max_tokens": 1, "seed": edge})
    two = post(served[0], {"prompt": [[1], [2]], "max_tokens": 1, "seed": edge})
    assert one.status_code == 200, one.text
    assert two.status_code == 400
    assert "passes 2**63 - 1; send a smaller seed" in two.json()["error"]["message"]


class TorchSeededEngine(FakeEngine):
    """Seeds a torch.Generator per request as HFEngine does, so a seed torch refuses fails here too."""

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        for r in requests:
            if r.seed is not None:
                torch.Generator().manual_seed(r.seed)
        return await super().generate(requests)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0},
        {"temperature": 1e-6},
        {"temperature": 100},
        {"temperature": 1, "top_p": 1e-9},
        {"seed": 0},
        {"seed": 2**63 - 1},
    ],
)
def test_numeric_range_edges_are_accepted_and_sample(fields):
    with serve_in_thread(create_app(TorchSeededEngine(), "fake")) as url:
        r = post(url, {"prompt": [1], "max_tokens": 2, **fields})
    assert r.status_code == 200, r.text


def test_temperature_bounds_keep_sampling_log_probs_finite():
    # Why the bounds: below MIN_TEMPERATURE logits / T overflows float32 and log-probs turn NaN.
    logits = torch.linspace(-30, 30, 50)[None, :]
    for temperature in (MIN_TEMPERATURE, MAX_TEMPERATURE):
        for top_p in (1.0, 0.9):
            log_probs = sampling_log_probs(logits, torch.tensor([temperature]), torch.tensor([top_p]))
            assert not torch.isnan(log_probs).any(), (temperature, top_p)
    tiny = sampling_log_probs(logits, torch.tensor([1e-40]), torch.tensor([1.0]))
    assert torch.isnan(tiny).any()  # what a 1e-40 temperature would have sampled from


def test_token_ids_beyond_int64_are_a_400_without_a_known_vocabulary():
    # With no vocab_size, ids still go into int64 tensors: past 2**63 - 1 the engine would overflow.
    with serve_in_thread(create_app(FakeEngine(), "fake")) as url:
        prompt = post(url, {"prompt": [1, 2**70], "max_tokens": 1})
        stop = post(url, {"prompt": [1], "max_tokens": 1, "stop_token_ids": [2**64]})
        fine = post(url, {"prompt": [1, 2**63 - 1], "max_tokens": 1})
    assert prompt.status_code == 400 and f"token id {2**70} is outside [0, 2**63)" in prompt.text
    assert stop.status_code == 400 and f"token id {2**64}" in stop.text
    assert fine.status_code == 200, fine.text


def test_unknown_model_name_is_a_404(served):
    r = post(served[0], {"model": "other", "prompt": [1]})
    assert r.status_code == 404
    assert "'fake'" in r.json()["error"]["message"]


def test_oversized_body_is_a_413_with_and_without_content_length(served):
    big = {"prompt": [1], "padding": "x" * 3000}
    assert post(served[0], big).status_code == 413

    def chunks():  # a generator body goes out with chunked transfer encoding, no Content-Length
        yield b'{"prompt": [1], "padding": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    r = httpx.post(
        served[0] + "/v1/completions",
        content=chunks(),
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413
    assert "2000 bytes" in r.json()["error"]["message"]


def test_models_and_health(served):
    models = httpx.get(served[0] + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["fake"]
    assert models["data"][0]["owned_by"] == "memrl"
    assert httpx.get(served[0] + "/health", timeout=10).json() == {"status": "ok"}


def test_engine_failures_become_500_with_the_message(served):
    r = post(served[0], {"prompt": [1, RAISE_TOKEN], "max_tokens": 2})
    assert r.status_code == 500
    assert "fake engine exploded" in r.json()["error"]["message"]
    r = post(served[0], {"prompt": [[1], [FAIL_TOKEN]], "max_tokens": 2})
    assert r.status_code == 500
    assert "prompt 1: fake failure" in r.json()["error"]["message"]


def test_api_key_required_on_v1_routes_but_not_health():
    app = create_app(FakeEngine(), "fake", api_key="s3cret")
    with serve_in_thread(app) as url:
        body = {"prompt": [1], "max_tokens": 1}
        assert post(url, body).status_code == 401
        wrong = post(url, body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert "API key" in wrong.json()["error"]["message"]
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(url + "/v1/reload_weights", json={"path": "/"}, timeout=10).status_code == 401
        assert post(url, body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_without_the_key_a_malformed_request_is_refused_as_unauthorized_not_explained():
    # The key is checked before the body is validated: a client without it learns nothing about the API.
    app = create_app(FakeEngine(), "fake", api_key="s3cret")
    with serve_in_thread(app) as url:
        r = post(url, {"prompt": "text", "max_tokens": True}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert "API key" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/score", json={"prompt_ids": []}, timeout=10)
        assert r.status_code == 401


class LetterTokenizer:
    """Token t is the letter chr(65 + t % 26); token 0 is special."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(65 + t % 26) for t in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.convert_ids_to_tokens([t for t in ids if t or not skip_special_tokens]))


def test_text_is_decoded_with_the_tokenizer_honouring_skip_special_tokens():
    tokenizer = LetterTokenizer()
    request = GenerationRequest([40, 50], 6)
    want = FakeEngine.expected(request).output_ids
    assert 0 in want  # (40+50+7k) % 97 hits 0 at k=1: the special token is in the output
    with serve_in_thread(create_app(FakeEngine(), "fake", tokenizer=tokenizer)) as url:
        body = {"prompt": [40, 50], "max_tokens": 6, "logprobs": 1}
        kept = post(url, {**body, "skip_special_tokens": False}).json()["choices"][0]
        skipped = post(url, body).json()["choices"][0]
    assert kept["token_ids"] == skipped["token_ids"] == want
    assert kept["text"] == tokenizer.decode(want) and len(kept["text"]) == 6
    assert skipped["text"] == tokenizer.decode(want, skip_special_tokens=True) and len(skipped["text"]) == 5
    assert kept["logprobs"]["tokens"] == tokenizer.convert_ids_to_tokens(want)


def test_an_unexpected_server_error_is_a_json_500():
    class BrokenTokenizer(LetterTokenizer):
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a bug in the server's own code path")

    with serve_in_thread(create_app(FakeEngine(), "fake", tokenizer=BrokenTokenizer())) as url:
        r = post(url, {"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "UnicodeDecodeError" in r.json()["error"]["message"]


def test_reload_calls_the_engine_and_checks_the_folder(served, reload_root):
    url, engine = served
    folder = reload_root / "step-1"
    folder.mkdir()
    r = httpx.post(url + "/v1/reload_weights", json={"path": str(folder)}, timeout=10)
    assert r.status_code == 200, r.text
    assert Path(engine.reloads[-1]).name == folder.name  # a private copy of it, named as it is
    # Inside the allowed root the caller may learn that a folder is missing (outside it: a plain 403).
    missing = httpx.post(url + "/v1/reload_weights", json={"path": str(reload_root / "nope")}, timeout=10)
    assert missing.status_code == 400
    assert "not a folder" in missing.json()["error"]["message"]
    assert httpx.post(url + "/v1/reload_weights", json={}, timeout=10).status_code == 400


def test_reload_of_an_async_engine_and_of_one_that_cannot(tmp_path):
    class AsyncReloading(FakeEngine):
        async def reload_from_path(self, path: str) -> None:
            await asyncio.sleep(0)
            self.reloads.append(path)

    class Broken(FakeEngine):
        def reload_from_path(self, path: str) -> None:
            raise OSError("no safetensors here")

    class NoReload(FakeEngine):
        reload_from_path = None  # type: ignore[assignment]

    async_engine = AsyncReloading()
    replies = {}
    for engine in (async_engine, Broken(), NoReload()):
        with serve_in_thread(create_app(engine, "fake", reload_roots=[tmp_path])) as url:
            replies[type(engine).__name__] = httpx.post(
                url + "/v1/reload_weights", json={"path": str(tmp_path)}, timeout=10
            )
    assert replies["AsyncReloading"].status_code == 200
    assert [Path(p).name for p in async_engine.reloads] == [tmp_path.name]
    assert replies["Broken"].status_code == 500
    assert "no safetensors here" in replies["Broken"].json()["error"]["message"]
    assert replies["NoReload"].status_code == 501


def test_reload_waits_for_in_flight_generation(tmp_path):
    engine = FakeEngine(delay_s=0.4)
    with serve_in_thread(create_app(engine, "fake", reload_roots=[tmp_path])) as url:
        worker = threading.Thread(target=post, args=(url, {"prompt": [1], "max_tokens": 2}))
        worker.start()
        deadline = time.monotonic() + 5
        while "generate_start" not in engine.events and time.monotonic() < deadline:
            time.sleep(0.01)
        r = httpx.post(url + "/v1/reload_weights", json={"path": str(tmp_path)}, timeout=10)
        worker.join(timeout=10)
    assert r.status_code == 200
    assert engine.events == ["generate_start", "generate_end", "reload"]


HOLD_TOKEN = 97  # a prompt holding it keeps generate() running until the test releases it


class HeldEngine(FakeEngine):
    """FakeEngine whose reload (run in a server thread, as a real weight load is) and whose generations
    of HOLD_TOKEN prompts block until the test sets `release`, so tests see a reload or a generation
    mid-way by flags, not by timing. Every block ends by itself after 10 s, so nothing can hang."""

    def __init__(self, reload_error: str | None = None) -> None:
        super().__init__()
        self.reload_error = reload_error
        self.release = threading.Event()
        self.reload_started = threading.Event()
        self.reload_finished = threading.Event()

    def reload_from_path(self, path: str) -> None:
        self.events.append("reload_start")
        self.reload_started.set()
        self.release.wait(timeout=10)
        self.events.append("reload_end")
        self.reload_finished.set()
        if self.reload_error:
            raise OSError(self.reload_error)
        self.reloads.append(path)

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if any(HOLD_TOKEN in r.prompt_ids for r in requests):
            self.events.append("held_generate_start")
            await asyncio.to_thread(self.release.wait, 10)
        return await super().generate(requests)


def post_reload(url: str, path, timeout: float = 15) -> httpx.Response:
    return httpx.post(url + "/v1/reload_weights", json={"path": str(path)}, timeout=timeout)


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached within the no-hang bound"
        time.sleep(0.01)


def test_health_and_models_answer_while_a_slow_reload_runs(tmp_path):
    # A trainer's weight sync must not make the server look dead to health checks (open-instruct
    # PR #1454): /health and /v1/models answer while the reload is provably still running.
    engine = HeldEngine()
    app = create_app(engine, "fake", reload_roots=[tmp_path])
    with serve_in_thread(app) as url, ThreadPoolExecutor(1) as pool:
        try:
            reload = pool.submit(post_reload, url, tmp_path)
            assert engine.reload_started.wait(timeout=5)
            health = httpx.get(url + "/health", timeout=5)
            models = httpx.get(url + "/v1/models", timeout=5)
            still_reloading = not engine.reload_finished.is_set()
        finally:
            engine.release.set()
        assert reload.result(timeout=15).status_code == 200
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert models.status_code == 200
    assert still_reloading, "/health only answered after the reload had finished"


def test_generation_arriving_during_a_reload_waits_for_it_then_succeeds(tmp_path):
    engine = HeldEngine()
    body = {"prompt": [1, 2], "max_tokens": 3}
    app = create_app(engine, "fake", reload_roots=[tmp_path])
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            reload = pool.submit(post_reload, url, tmp_path)
            assert engine.reload_started.wait(timeout=5)
            generation = pool.submit(post, url, body)
            time.sleep(0.3)  # time for it to reach the gate; the order check below holds either way
            held_back = not generation.done()
        finally:
            engine.release.set()
        assert reload.result(timeout=15).status_code == 200
        r = generation.result(timeout=15)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == FakeEngine.expected(GenerationRequest([1, 2], 3)).output_ids
    assert held_back
    # No response may mix two weight versions: the generation ran entirely after the reload.
    assert engine.events == ["reload_start", "reload_end", "generate_start", "generate_end"]


def test_generation_held_past_the_gate_timeout_gets_a_503_not_a_hang(tmp_path):
    engine = HeldEngine()
    app = create_app(engine, "fake", gate_timeout_s=0.2, reload_roots=[tmp_path])
    with serve_in_thread(app) as url, ThreadPoolExecutor(1) as pool:
        try:
            reload = pool.submit(post_reload, url, tmp_path)
            assert engine.reload_started.wait(timeout=5)
            # The client timeout (5 s) is only a no-hang bound, far above the 0.2 s gate timeout.
            busy = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=5)
            still_reloading = not engine.reload_finished.is_set()
        finally:
            engine.release.set()
        # The gate timeout bounds waits at the gate, not the reload itself: it still completes.
        assert reload.result(timeout=15).status_code == 200
        after = post(url, {"prompt": [1], "max_tokens": 2})
    assert busy.status_code == 503, busy.text
    message = busy.json()["error"]["message"]
    assert "0.2 s" in message and "reload" in message and "gate_timeout_s" in message
    assert still_reloading
    assert after.status_code == 200, after.text
    assert engine.events == ["reload_start", "reload_end", "generate_start", "generate_end"]


def test_failed_reload_answers_500_and_releases_the_gate_for_waiting_and_new_generations(tmp_path):
    engine = HeldEngine(reload_error="torn checkpoint")
    # A gate timeout well under the no-hang bounds: a gate left shut shows up as a 503, not a hang.
    app = create_app(engine, "fake", gate_timeout_s=3, reload_roots=[tmp_path])
    body = {"prompt": [4], "max_tokens": 2}
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            reload = pool.submit(post_reload, url, tmp_path)
            assert engine.reload_started.wait(timeout=5)
            waiting = pool.submit(post, url, body)
            time.sleep(0.3)  # time for it to reach the gate and wait on the failing reload
        finally:
            engine.release.set()
        failed = reload.result(timeout=15)
        waited = waiting.result(timeout=15)
        after = post(url, body)
    assert failed.status_code == 500
    assert "torn checkpoint" in failed.json()["error"]["message"]
    assert waited.status_code == 200, waited.text  # woken by the failure, not left to time out
    assert after.status_code == 200, after.text
    assert engine.reloads == []


def test_reload_that_gives_up_waiting_lets_generations_held_behind_it_run(tmp_path):
    # A waiting reload holds new generations back (so a busy server still reloads); when it gives up
    # at its gate timeout, those generations must be woken then, not left waiting for their own timeout.
    engine = HeldEngine()
    app = create_app(engine, "fake", gate_timeout_s=1.0, reload_roots=[tmp_path])
    with serve_in_thread(app) as url, ThreadPoolExecutor(2) as pool:
        try:
            slow = pool.submit(post, url, {"prompt": [HOLD_TOKEN], "max_tokens": 1})
            wait_until(lambda: "held_generate_start" in engine.events)
            reload = pool.submit(post_reload, url, tmp_path)
            time.sleep(0.2)  # time for the reload to reach the gate, so the next request queues behind it
            quick = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 2}, timeout=5)
            slow_still_running = not slow.done()
        finally:
            engine.release.set()
        gave_up = reload.result(timeout=15)
        assert slow.result(timeout=15).status_code == 200
    assert gave_up.status_code == 503
    assert "in-flight generations" in gave_up.json()["error"]["message"]
    assert quick.status_code == 200, quick.text
    assert slow_still_running
    assert "reload_start" not in engine.events


def test_gate_timeout_must_be_positive():
    with pytest.raises(ValueError, match="gate_timeout_s"):
        create_app(FakeEngine(), "fake", gate_timeout_s=0)


def test_engine_is_closed_when_the_server_stops():
    engine = FakeEngine()
    with serve_in_thread(create_app(engine, "fake")):
        assert not engine.closed
    assert engine.closed


def test_a_cancelled_reload_keeps_the_gate_closed_until_its_thread_ends(tmp_path):
    # The reload handler may be cancelled (shutdown, client gone) while its thread still writes weights:
    # generations must keep waiting for the thread, not start on half-loaded weights.
    engine = HeldEngine()
    app = create_app(engine, "fake", reload_roots=[tmp_path])

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            reload = asyncio.ensure_future(client.post("/v1/reload_weights", json={"path": str(tmp_path)}))
            assert await asyncio.to_thread(engine.reload_started.wait, 5)
            reload.cancel()  # cancels the handler mid-reload (the ASGI app runs in this task)
            generation = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}))
            await asyncio.sleep(0.3)  # time to reach the gate; the event order below is the real check
            held_back = not generation.done()
            engine.release.set()
            response = await asyncio.wait_for(generation, 15)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(reload, 15)
        return held_back, response

    held_back, response = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert held_back
    assert engine.events.index("reload_end") < engine.events.index("generate_start"), engine.events
