"""The one place engines are made: for training (a private copy of the policy, or the configured server),
for Ray rollout workers, for evaluation and for Pass@k (a model folder, or a server URL).

Every engine gets its limits from `engine` (batch size and tokens, concurrency, the request timeout)
and the local one its device and dtype from `model` (`auto` resolved by `resolve_device_dtype`, the one
rule for it), so an engine behaves the same whichever command built it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from memrl.config import Config, ConfigError
from memrl.engines.base import Engine


def build_engine(cfg: Config, *, server_url: str | None = None, model: torch.nn.Module | None = None,
                 tokenizer: Any = None, model_path: str | Path | None = None,
                 tokenizer_path: str | Path | None = None) -> Engine:
    """An engine over exactly one of: a server (`server_url`), an in-memory `model` (copied: the engine
    never shares tensors with a trainer), or a Hugging Face folder or hub id (`model_path`)."""
    given = [name for name, value in (("server_url", server_url), ("model", model), ("model_path", model_path))
             if value is not None]
    if len(given) != 1:
        raise ConfigError(f"an engine needs exactly one of server_url, model, model_path; got {given or 'none'}")
    settings = cfg.engine
    if server_url is not None:
        from memrl.engines.openai import OpenAIEngine

        return OpenAIEngine(server_url, api_key=settings.api_key, max_concurrency=settings.max_concurrency,
                            timeout_s=settings.request_timeout_s)
    from memrl.engines.hf import HFEngine

    limits = {"max_batch_size": settings.max_batch_size, "max_batch_tokens": settings.max_batch_tokens,
              "request_timeout_s": settings.request_timeout_s,  # a stuck local batch fails its requests, no hang
              "static_kv": settings.static_kv, "cuda_graphs": settings.cuda_graphs,
              "share_prefixes": settings.share_prefixes}
    if model is not None:
        return HFEngine(copy.deepcopy(model), tokenizer, device=cfg.model.device, dtype=cfg.model.dtype, **limits)
    # The recipe's pinned revision applies to the recipe's own hub id, not to a folder given on the CLI.
    revision = cfg.model.revision if str(model_path) == cfg.model.path else None
    return HFEngine.from_pretrained(model_path, device=cfg.model.device, dtype=cfg.model.dtype,
                                    tokenizer_path=tokenizer_path, revision=revision, **limits)


def served_engine(cfg: Config) -> bool:
    """A served engine (`engine.kind = openai`) reloads weights from a folder its server reads; an
    in-process one copies tensors. Rollout sources declare it (`takes_folders`); the loop reads that."""
    return cfg.engine.kind == "openai"


def training_engine(cfg: Config, model: torch.nn.Module | None, tokenizer: Any) -> Engine:
    """The rollout engine of a training run: `engine.kind` = `openai` (its `server_url`), else a
    private copy of the policy `model`."""
    if served_engine(cfg):
        if not cfg.engine.server_url:
            raise ConfigError("engine.kind = 'openai' needs engine.server_url")
        return build_engine(cfg, server_url=cfg.engine.server_url)
    return build_engine(cfg, model=model, tokenizer=tokenizer)
