"""The engine tests' sharp tiny model and the token ids they prompt it with, and tolerances for float32 results
computed under different batch shapes, derived from the arithmetic.

The same tokens decoded alone, with batch mates, after a mid-batch admission or in a full teacher-forced
pass reduce in different orders: the CPU/GPU kernels block matrix products by shape, and padding changes
the softmax sums. So every dot product of length K may round differently, by about sqrt(K) * eps * |terms|
(rounding errors add as a random walk, Higham, "Accuracy and Stability of Numerical Algorithms" §3.1),
and each of the model's L layers and the LM head adds its own. A log-prob z_i - logsumexp(z) moves by at
most twice the largest logit error, and logit errors scale with the logits' magnitude. Hence

    atol = 2 * eps32 * max|logit| * (L + 1) * sqrt(max(hidden, intermediate))

(1.6e-4 for test_hf's sharp 2-layer model with logits up to 20; differences seen on real machines are
~1e-5). A bound set from one machine's figure (abs=1e-5) fails on another whose kernels round differently.
A real defect (a token scored at the wrong position, a wrong temperature) moves log-probs by >= 1e-2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP32_EPS = torch.finfo(torch.float32).eps


def max_abs_logit(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> float:
    """The largest |logit| the model gives over the prompts' positions (sets the error's scale)."""
    with torch.no_grad():
        return max(float(model(input_ids=torch.tensor([list(p)])).logits.abs().max()) for p in prompts)


def logprob_atol(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> float:
    """Absolute tolerance between two float32 log-probs of the same token under different batch shapes."""
    cfg = model.config
    depth = cfg.num_hidden_layers + 1  # the layers and the LM head
    width = max(cfg.hidden_size, getattr(cfg, "intermediate_size", cfg.hidden_size))
    return 2 * FP32_EPS * max(1.0, max_abs_logit(model, prompts)) * depth * math.sqrt(width)


def sharp_model(seed: int = 0) -> torch.nn.Module:
    """A tiny model with peaked, context-dependent next-token distributions (entropy ~1.7 nats).

    Random init gives near-uniform logits that just echo the input token; larger layer weights make
    the layers matter and a larger final norm sharpens the logits, so top_p and stop tokens bite and
    numerical errors show in tokens and log-probs.
    """
    from memrl.tiny import build_tiny_model, build_tiny_tokenizer

    model = build_tiny_model(len(build_tiny_tokenizer()), seed=seed)
    with torch.no_grad():
        for weight in model.model.layers.parameters():
            if weight.dim() == 2:
                weight.mul_(10.0)
        model.model.norm.weight.mul_(30.0)
    return model


def token_ids(seed: int, length: int) -> list[int]:
    """`length` prompt ids inside the tiny tokenizer's vocabulary; seeds that differ mod 500 start with
    different ids, so their prompts share no prefix."""
    return [(7 * seed + 3 * k + 11) % 500 + 5 for k in range(length)]
