"""Prefix sharing at admission: the prompts of one admission wave compute what they share only once.

Why: a MemAgent step is mostly prompt tokens, and the n samples of a GRPO group read the same document:
their turn-0 prompts are identical, and every prompt starts with the same chat template and instruction
(with `rollout.prompt_layout = chunk_first`, also the question and the chunk). HFEngine's `_prefill`
(memrl/engines/hf.py) runs a wave of newly admitted requests in up to two model calls:

1. plan (`plan_prefill`, pure): the wave's distinct prompts, which request uses which, and the prefix
   every distinct prompt starts with (kept only when at least MIN_SHARED_PREFIX tokens long, and cut one
   token short of the shortest distinct prompt, so every prompt keeps a token whose logits are computed);
2. the shared prefix, once, as a single row;
3. the distinct prompts' remaining tokens (suffixes), left-padded among themselves, each row continuing
   from a copy of the prefix's keys/values: the attention mask is the prefix's ones, then the row's
   padding and suffix, and position ids continue from the prefix;
4. `align_rows`: each request's keys/values in the layout a plain left-padded prefill gives (the row's
   tokens right-aligned, zeros before them), so the dynamic and static batches admit them unchanged;
   a repeated prompt's rows are copies of its distinct prompt's row, its logits too.

A wave with no repeated prompt and a common prefix shorter than MIN_SHARED_PREFIX gets no plan: the
plain prefill runs, bit for bit as before. Otherwise the arithmetic is the same but runs under other
batch shapes (and the suffix rows see a padding gap after the prefix), so results agree with the plain
prefill within float32 rounding (tests/engines/numerics.py), not bitwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A shared prefix saves (distinct prompts - 1) x prefix token positions but costs one more model call and
# a copy of every row's keys/values; a few tokens (every chat prompt starts `<|im_start|>user\n`) would
# only add the call. 32 is about a short instruction sentence.
MIN_SHARED_PREFIX = 32


@dataclass(frozen=True)
class PrefillPlan:
    """How one admission wave is prefilled with sharing (see the module docstring)."""

    prompts: tuple[tuple[int, ...], ...]  # the distinct prompts, in order of first use
    rows: tuple[int, ...]  # request r's prompt is prompts[rows[r]]
    prefix: int  # leading tokens every distinct prompt shares, computed once (0: none)

    @property
    def suffixes(self) -> list[tuple[int, ...]]:
        return [p[self.prefix:] for p in self.prompts]

    @property
    def computed_tokens(self) -> int:
        """Token positions the model runs: the prefix once, then the suffixes padded to the longest."""
        return self.prefix + len(self.prompts) * max(len(s) for s in self.suffixes)


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all `prompts` start with."""
    # commonprefix compares only the lexicographic min and max element by element, for any sequences.
    return len(os.path.commonprefix([tuple(p) for p in prompts])) if prompts else 0


def plan_prefill(prompts: Sequence[Sequence[int]], min_prefix: int = MIN_SHARED_PREFIX) -> PrefillPlan | None:
    """The sharing plan for a wave of (non-empty) prompts, or None when nothing worth sharing: no prompt
    repeats and they share fewer than `min_prefix` leading tokens."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = tuple(distinct.setdefault(tuple(p), len(distinct)) for p in prompts)
    unique = tuple(distinct)
    prefix = 0
    if len(unique) > 1:
        prefix = min(common_prefix_length(unique), min(len(p) for p in unique) - 1)
        if prefix < min_prefix:
            prefix = 0
    if prefix == 0 and len(unique) == len(rows):
        return None
    return PrefillPlan(unique, rows, prefix)


def align_rows(tensor: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """A suffix forward's keys or values [distinct, H, W, D] (row u: the prefix in columns [0, prefix),
    its suffix in the last columns, padding between) as the plain prefill lays them out: one row per
    request [requests, H, W, D], its prompt in the last columns, zeros before it.

    W is prefix + the longest suffix, i.e. the longest prompt: the plain prefill's width. Each suffix
    already ends at column W, so only the prefix moves right, by the row's padding."""
    rows = torch.tensor(plan.rows, device=tensor.device)
    out = tensor.index_select(0, rows)  # a copy: `tensor` keeps the prefix in place for the moves below
    prefix, longest = plan.prefix, max(len(s) for s in plan.suffixes)
    pads = [longest - len(plan.suffixes[u]) for u in plan.rows]
    for pad in sorted(set(pads) - {0}) if prefix else ():
        moved = torch.tensor([r for r, p in enumerate(pads) if p == pad], device=tensor.device)
        out[moved, :, pad:pad + prefix] = tensor[:1, :, :prefix]
        out[moved, :, :pad] = 0  # zeros, not garbage: masked columns still enter attention (0 * NaN = NaN)
    return out


def aligned_mask(plan: PrefillPlan, width: int, device: torch.device) -> torch.Tensor:
    """The attention mask of `align_rows`' layout: [requests, width], each prompt's last columns 1."""
    lengths = torch.tensor([len(plan.prompts[u]) for u in plan.rows], device=device)
    return (torch.arange(width, device=device)[None, :] >= width - lengths[:, None]).long()
