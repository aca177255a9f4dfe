"""Prefix sharing at admission: the prompts of one admission wave compute what they share only once.

Why: a MemAgent step is mostly prompt tokens, and the n samples of a GRPO group read the same document:
their turn-0 prompts are identical, every prompt starts with the same chat template and instruction, and
with `rollout.prompt_layout = chunk_first` a group's prompts share the question and the chunk too. One
wave (the requests HFEngine prefills together, memrl/engines/hf.py `_prefill`) can hold several groups.

The plan (`plan_prefill`, pure) is a prefix tree over the wave's distinct prompts. A node computes one
segment of tokens for every prompt below it: the root the prefix all prompts share, an inner node the
longer prefix of a cluster of prompts (a group's question and chunk), a leaf the rest of one prompt.
A node is made only for at least MIN_SHARED_PREFIX shared tokens beyond its parent, and every leaf keeps
at least one token, so each prompt's last logits are computed. The engine runs the tree level by level:
one model call per level (`PrefillPlan.stages`), each node's row continuing from a copy of its parent's
keys/values, its segment left-padded among the level's segments (attention mask: the parent's mask, then
the row's padding and segment; position ids count the row's unmasked columns). A repeated prompt is one
leaf, its rows copies of it.

`Leaves` then lays every request's keys/values out as a plain left-padded prefill would (its tokens in
the last columns, zeros before them), so the dynamic and static batches admit them unchanged.

A wave with no repeated prompt and nothing shared by MIN_SHARED_PREFIX tokens gets no plan: the plain
prefill runs, bit for bit as before. Otherwise the arithmetic is the same under other batch shapes (and
rows see padding gaps between segments), so results agree with the plain prefill within float32
rounding (tests/engines/numerics.py), not bitwise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A node saves (prompts below it - 1) x its segment's tokens but adds a row to a model call (and a level,
# i.e. a call, when it is the first of its depth); a few tokens (every chat prompt starts with
# `<|im_start|>user\n`) would only add the call. 32 tokens is about one short instruction sentence.
MIN_SHARED_PREFIX = 32


@dataclass(frozen=True)
class Node:
    """One row of one level: tokens [start, end) of distinct prompt `prompt` (shared by all its leaves)."""

    parent: int | None  # its row in the previous level (None on the first level)
    prompt: int  # a distinct prompt the segment is taken from
    start: int
    end: int
    leaf: bool  # the segment ends `prompt`: its row's logits and keys/values are that prompt's


@dataclass(frozen=True)
class PrefillPlan:
    """How one admission wave is prefilled with sharing (see the module docstring)."""

    prompts: tuple[tuple[int, ...], ...]  # the distinct prompts, in order of first use
    rows: tuple[int, ...]  # request r's prompt is prompts[rows[r]]
    stages: tuple[tuple[Node, ...], ...]  # the tree's levels, one model call each

    def segments(self, stage: int) -> list[tuple[int, ...]]:
        return [self.prompts[n.prompt][n.start:n.end] for n in self.stages[stage]]

    @property
    def computed_tokens(self) -> int:
        """Token positions the model runs: per level, its rows x its longest segment."""
        return sum(len(nodes) * max(n.end - n.start for n in nodes) for nodes in self.stages)


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all `prompts` start with."""
    # commonprefix compares only the lexicographic min and max element by element, for any sequences.
    return len(os.path.commonprefix([tuple(p) for p in prompts])) if prompts else 0


def plan_prefill(prompts: Sequence[Sequence[int]], min_prefix: int = MIN_SHARED_PREFIX) -> PrefillPlan | None:
    """The sharing plan for a wave of (non-empty) prompts, or None when it would share nothing: no prompt
    repeats and no two share `min_prefix` leading tokens."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = tuple(distinct.setdefault(tuple(p), len(distinct)) for p in prompts)
    unique = tuple(distinct)
    stages: list[list[Node]] = []

    def shared(members: Sequence[int]) -> int:
        """Tokens all `members` share, one short of the shortest: every leaf keeps a token."""
        return min(common_prefix_length([unique[u] for u in members]), min(len(unique[u]) for u in members) - 1)

    def add(stage: int, node: Node) -> int:
        if stage == len(stages):
            stages.append([])
        stages[stage].append(node)
        return len(stages[stage]) - 1

    def grow(members: list[int], start: int, parent: int | None, stage: int) -> None:
        """Add the subtree of `members` (sorted, sharing their first `start` tokens, computed above)."""
        if len(members) == 1:
            add(stage, Node(parent, members[0], start, len(unique[members[0]]), leaf=True))
            return
        end = shared(members)
        if end - start >= min_prefix:
            parent, start, stage = add(stage, Node(parent, members[0], start, end, leaf=False)), end, stage + 1
        # Sorted prompts: a run whose neighbours share min_prefix tokens beyond `start` shares them all.
        run = [members[0]]
        for before, after in zip(members, members[1:], strict=False):
            if shared([before, after]) - start < min_prefix:
                grow(run, start, parent, stage)
                run = []
            run.append(after)
        grow(run, start, parent, stage)

    grow(sorted(range(len(unique)), key=unique.__getitem__), 0, None, 0)
    if len(unique) == len(rows) and len(stages) == 1 and all(n.leaf for n in stages[0]):
        return None  # every prompt distinct and alone at the root: the plain prefill
    return PrefillPlan(unique, rows, tuple(tuple(s) for s in stages))


class Leaves:
    """Collects each distinct prompt's keys/values as its leaf's level computes them, and lays them out for
    the requests as a plain left-padded prefill of `plan`'s prompts would."""

    def __init__(self, plan: PrefillPlan) -> None:
        self.plan = plan
        self.width = max(len(p) for p in plan.prompts)
        self.layers: list[list[torch.Tensor]] = []  # per layer: keys, values [distinct, H, width, D]
        self.logits: torch.Tensor | None = None

    def take(self, stage: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor,
             logits: torch.Tensor) -> None:
        """After level `stage`'s call: copy its leaf rows' unmasked columns (mask [rows, W]) right-aligned."""
        nodes = self.plan.stages[stage]
        leaf_rows = [i for i, n in enumerate(nodes) if n.leaf]
        if not leaf_rows:
            return
        device = mask.device
        src_rows, src_cols = mask[leaf_rows].nonzero(as_tuple=True)  # row-major: each row's columns in order
        src_rows = torch.tensor(leaf_rows, device=device)[src_rows]
        prompts = [nodes[i].prompt for i in leaf_rows]
        dst_rows = torch.cat([torch.full((len(self.plan.prompts[u]),), u) for u in prompts]).to(device)
        dst_cols = torch.cat([torch.arange(self.width - len(self.plan.prompts[u]), self.width)
                              for u in prompts]).to(device)
        if self.logits is None:
            self.logits = logits.new_zeros((len(self.plan.prompts), logits.shape[1]))
            # zeros, not garbage, before each prompt: masked columns still enter attention (0 * NaN = NaN)
            self.layers = [[kv.new_zeros((len(self.plan.prompts), kv.shape[1], self.width, kv.shape[3])) for kv in pair]
                           for pair in layers]
        self.logits[torch.tensor(prompts, device=device)] = logits[leaf_rows]
        for out, pair in zip(self.layers, layers, strict=True):
            for buffer, kv in zip(out, pair, strict=True):
                buffer[dst_rows, :, dst_cols] = kv[src_rows, :, src_cols]

    def requests(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """Per layer (keys, values), the attention mask and the last logits, one row per request."""
        device = self.logits.device
        rows = torch.tensor(self.plan.rows, device=device)
        lengths = torch.tensor([len(self.plan.prompts[u]) for u in self.plan.rows], device=device)
        mask = (torch.arange(self.width, device=device)[None, :] >= self.width - lengths[:, None]).long()
        layers = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.layers]
        return layers, mask, self.logits.index_select(0, rows)
