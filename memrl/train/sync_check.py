"""The weight-sync canary: after every weight sync, and once before the first rollout (a server that cannot
score or serves another model fails at start), the engine must score a fixed probe as the trainer does
(docs/design.md says which side scores it when).

A served engine that did not reload, a weight version mixed up on the way, a dtype or temperature that
differs: each makes the engine sample from other weights than the ones the trainer takes ratios against,
and nothing else in the loop says so (the log-prob gap only grows). `check_sync` stops the run when the
two differ beyond the float tolerance of the two forwards.

Tolerance (`default_atol`), from the arithmetic of two forwards of the same weights:
- both float32: they differ only in reduction order (kernels block products by shape). A dot product of
  length K rounds by about sqrt(K) * eps * |terms| (a random walk; Higham, "Accuracy and Stability of
  Numerical Algorithms" §3.1), each of the L layers and the LM head adds its own, and a log-prob
  z_t - logsumexp(z) moves by at most twice the largest logit error:  2 eps32 Z (L + 1) sqrt(W).
- bfloat16 or float16 on either side: products still accumulate in float32, but every layer's output is
  rounded to the half format (relative error u = eps / 2; the engine keeps its residual stream in it, the
  trainer's autocast keeps it in float32), and the L + 1 roundings random-walk; twice that for the
  log-prob:  2 u Z sqrt(L + 1) = eps_half Z sqrt(L + 1).
Z = LOGIT_BOUND bounds the logits' magnitude; W = max(hidden, intermediate). Qwen3-0.6B (28 layers, W =
3072): 1.2e-2 in float32, 1.3 in bfloat16 (so a bf16 engine that did not reload is caught once the probe
moved that far); the tests' 1-layer model: 1.1e-4 in float32. A wrong model or temperature moves
log-probs by nats. `train.sync_check_atol` replaces the default (`sync_check/max_abs_diff` logs the
measured difference every synchronous step).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import torch

from memrl.engines.base import ScoreResult, SyncProbe
from memrl.train.setup import TrainingError

PROMPT_TOKENS = 8
CONTINUATION_TOKENS = 4
PROBE_SEED = 20240917  # any fixed seed: the probe only has to be the same on both sides and for the whole run
# Largest logit magnitude the tolerance allows for (Qwen-family models give |logits| below it on text).
LOGIT_BOUND = 30.0
FLOAT32_EPS = torch.finfo(torch.float32).eps


def probe_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The probe's prompt and continuation ids: drawn with a fixed seed from the tokenizer's ordinary (not
    special) ids, so any tokenizer (byte-level, word-level) gives one, the same in every process."""
    special = set(tokenizer.all_special_ids)
    ordinary = [i for i in range(len(tokenizer)) if i not in special]
    if not ordinary:
        raise TrainingError("the tokenizer has only special tokens: the weight-sync canary has no probe to score; "
                            "set train.sync_check=false")
    ids = random.Random(PROBE_SEED).choices(ordinary, k=PROMPT_TOKENS + CONTINUATION_TOKENS)
    return ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:]


def _eps(dtype: str) -> float:
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype) or not kind.is_floating_point:
        raise TrainingError(f"weight-sync canary: a forward ran in {dtype!r}, which has no float tolerance here; "
                            f"set train.sync_check_atol")
    return torch.finfo(kind).eps


def default_atol(probe: SyncProbe, engine_dtype: str) -> float:
    """The largest |engine - trainer| log-prob difference two forwards of the same weights may show, for the
    trainer's dtype and the engine's (the module docstring derives it)."""
    eps = max(_eps(probe.dtype), _eps(engine_dtype))
    if eps <= FLOAT32_EPS:
        return 2 * FLOAT32_EPS * LOGIT_BOUND * (probe.layers + 1) * math.sqrt(probe.width)
    return eps * LOGIT_BOUND * math.sqrt(probe.layers + 1)


def _rounded(values: list[float]) -> list[float]:
    return [float(f"{v:.5g}") for v in values]


def check_sync(probe: SyncProbe, scores: Mapping[str, ScoreResult], atol: float | None) -> float:
    """The largest |engine - trainer| difference over the probe's tokens and the engines of `scores` (by
    name); TrainingError naming both values, the tolerance and the weight version when one is beyond the
    tolerance (`atol`, else `default_atol`), not finite, or of another length."""
    worst = 0.0
    for engine, score in scores.items():
        if len(score.log_probs) != len(probe.log_probs):
            raise TrainingError(f"weight-sync canary: {engine} scored {len(score.log_probs)} log-probs for the probe's "
                                f"{len(probe.log_probs)} continuation tokens (weight version {probe.version})")
        diff = max(abs(a - b) for a, b in zip(score.log_probs, probe.log_probs, strict=True))
        limit = atol if atol is not None else default_atol(probe, score.dtype)
        if not diff <= limit:  # NaN fails too
            raise TrainingError(
                f"weight-sync canary: at weight version {probe.version}, {engine} scores the probe at "
                f"{_rounded(score.log_probs)} where the trainer has {_rounded(probe.log_probs)}: max |difference| "
                f"{diff:.3g} > tolerance {limit:.3g} (trainer {probe.dtype}, engine {score.dtype}, temperature "
                f"{probe.temperature:g}). The engine does not generate with the trainer's weights: check that a "
                f"served engine serves the model training started from and reloaded every version (memrl serve "
                f"--reload-root above the run root; the server's log), in the dtype it reports; set "
                f"train.sync_check_atol if the difference is expected, or train.sync_check=false to train without "
                f"the check")
        worst = max(worst, diff)
    return worst
