"""memrl.engines.factory: the one place engines are made, with the config's limits, device and dtype."""

import asyncio

import pytest
import torch

from memrl.config import Config, ConfigError
from memrl.engines.factory import build_engine, training_engine
from memrl.engines.openai import OpenAIEngine
from memrl.tiny import build_tiny_model, build_tiny_tokenizer, save_tiny_model


def cfg(**engine) -> Config:
    return Config.model_validate({"model": {"device": "cpu", "dtype": "float32"},
                                  "engine": {"max_batch_size": 3, "max_batch_tokens": 999, "request_timeout_s": 5.0,
                                             "max_concurrency": 7, **engine}})


def test_every_kind_of_engine_gets_the_configs_limits(tmp_path):
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    folder = save_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    for engine in (build_engine(cfg(), model=model, tokenizer=tok), build_engine(cfg(), model_path=folder)):
        try:
            assert (engine.max_batch_size, engine.max_batch_tokens, engine.request_timeout_s) == (3, 999, 5.0)
            assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
        finally:
            asyncio.run(engine.close())
    client = build_engine(cfg(), server_url="http://127.0.0.1:9")
    assert isinstance(client, OpenAIEngine) and client.max_concurrency == 7


def test_the_engine_never_shares_tensors_with_the_trainer():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    engine = build_engine(cfg(), model=model, tokenizer=tok)
    try:
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(model.parameters(), engine.model.parameters(),
                                                                 strict=True))
    finally:
        asyncio.run(engine.close())


def test_exactly_one_source_and_a_server_url_for_openai():
    with pytest.raises(ConfigError, match="exactly one"):
        build_engine(cfg())
    with pytest.raises(ConfigError, match="exactly one"):
        build_engine(cfg(), server_url="http://x", model_path="m")
    with pytest.raises(ConfigError, match="engine.server_url"):
        training_engine(cfg(kind="openai"), None, None)
    assert isinstance(training_engine(cfg(kind="openai", server_url="http://127.0.0.1:9"), None, None), OpenAIEngine)
