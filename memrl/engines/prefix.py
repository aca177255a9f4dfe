"""Prefix sharing at admission: the prompts of one admission wave compute what they share only once.

`plan_prefill` (pure) makes a prefix tree over the wave's distinct prompts, `run_plan` runs it one model
call per level and leaves the cache laid out as the plain left-padded prefill would. A wave that shares
nothing gets no plan (the plain prefill, bitwise); otherwise results agree within float32 rounding. The
tree, held prompts and the numbers: docs/engines.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# A node saves (prompts below it - 1) x its segment's tokens but adds a row to a model call (and a level,
# i.e. a call, when it is the first of its depth); a few tokens (every chat prompt starts with
# `<|im_start|>user\n`) would only add the call. 32 tokens is about one short instruction sentence.
MIN_SHARED_PREFIX = 32

# A row that continues from copied keys/values attends through an explicit mask, and SDPA's masked kernel
# costs ~2x per query-key pair of the mask-free causal one and skips no pair (CPU, torch 2.13, 5,400-token
# rows: 23 vs 11 ns per pair), so computing s of a prompt's L tokens that way costs ~4 s/L of its plain
# attention: 4.2x slower than plain at s/L = 0.98 (measured), 0.19x at 0.07. Hence a plan that continues
# rows from copies is used only when it computes at most this share of the plain prefill's positions
# (MemAgent's cases are far from it: a repeated prompt ~1/n, a chunk-first later turn ~0.05-0.2, a
# MemAgent-layout later turn, sharing only the instruction, ~0.9).
MAX_COMPUTED_SHARE = 0.25


KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [rows, kv heads, columns, head dim]


class HeldPrompts(Protocol):
    """A running batch's rows, as prompts whose keys/values a newcomer may copy (hf_batch, static_decode)."""

    def held_prompts(self) -> list[tuple[int, ...]]:
        """Row i's prompt ids."""
        ...

    def prefix_block(self, sources: Sequence[tuple[int, int] | None], width: int) -> tuple[KeyValues, torch.Tensor]:
        """One row per source: (running row i, n) copies the keys/values of row i's first n prompt tokens into
        the row's last n of `width` columns, zeros before them (None: all zeros); and the block's mask."""
        ...


@dataclass(frozen=True)
class Node:
    """One row of one level: tokens [start, end) of distinct prompt `prompt` (shared by all its leaves)."""

    parent: int | None  # its row in the previous level (None on the first level)
    prompt: int  # a distinct prompt the segment is taken from
    start: int
    end: int
    leaf: bool  # the segment ends `prompt`: its row's logits and keys/values are that prompt's
    held: int | None = None  # first level only: the running row whose keys/values of prompt[:start] it copies


@dataclass(frozen=True)
class PrefillPlan:
    """How one admission wave is prefilled with sharing (docs/engines.md, Prefix sharing)."""

    prompts: tuple[tuple[int, ...], ...]  # the distinct prompts, in order of first use
    rows: tuple[int, ...]  # request r's prompt is prompts[rows[r]]
    stages: tuple[tuple[Node, ...], ...]  # the tree's levels, one model call each

    def segments(self, stage: int) -> list[tuple[int, ...]]:
        return [self.prompts[n.prompt][n.start:n.end] for n in self.stages[stage]]

    @property
    def computed_tokens(self) -> int:
        """Token positions the model runs: per level, its rows x its longest segment."""
        return sum(len(nodes) * max(n.end - n.start for n in nodes) for nodes in self.stages)


def shared_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest prefix `a` and `b` share: a binary search on slice equality, each comparison in C
    (a Python loop over 5,000-token prompts, for every pair an admission compares, would cost milliseconds)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix all `prompts` start with."""
    if not prompts:
        return 0
    ordered = [tuple(p) for p in prompts]
    # In lexicographic order, what the smallest and the largest share, every prompt between them shares.
    return shared_length(min(ordered), max(ordered))


def _held_matches(held: Sequence[tuple[int, ...]], prompts: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
    """Per prompt: (running row, tokens it shares with the prompt) of its longest match among `held`, (-1, 0)
    when none. In lexicographic order the longest match is a neighbour of where the prompt would be inserted."""
    order = sorted(range(len(held)), key=held.__getitem__)
    ordered = [held[i] for i in order]
    matches = []
    for prompt in prompts:
        at = bisect.bisect_left(ordered, prompt)
        best = (-1, 0)
        for i in range(max(at - 1, 0), min(at + 1, len(ordered))):
            shared = shared_length(prompt, ordered[i])
            if shared > best[1]:
                best = (order[i], shared)
        matches.append(best)
    return matches


def plan_prefill(prompts: Sequence[Sequence[int]], min_prefix: int = MIN_SHARED_PREFIX,
                 held: Sequence[tuple[int, ...]] = (), max_share: float = MAX_COMPUTED_SHARE) -> PrefillPlan | None:
    """The sharing plan for a wave of (non-empty) prompts, given the prompts running rows hold (`held`), or
    None when it would share nothing: no prompt repeats and none shares `min_prefix` leading tokens with
    another or with a held prompt. Prefixes are shared only if that leaves at most `max_share` of the plain
    prefill's token positions to compute (MAX_COMPUTED_SHARE); repeated prompts always are."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = tuple(distinct.setdefault(tuple(p), len(distinct)) for p in prompts)
    unique = tuple(distinct)
    stages: list[list[Node]] = []
    matches = _held_matches(held, unique)

    def shared(members: Sequence[int]) -> int:
        """Tokens all `members` share, one short of the shortest: every leaf keeps a token."""
        return min(common_prefix_length([unique[u] for u in members]), min(len(unique[u]) for u in members) - 1)

    def add(stage: int, node: Node) -> int:
        if stage == len(stages):
            stages.append([])
        stages[stage].append(node)
        return len(stages[stage]) - 1

    def grow(members: list[int], start: int, parent: int | None, stage: int) -> None:
        """Add the subtree of `members` (sorted, sharing their first `start` tokens, computed above or held)."""
        first = members[0]
        end = len(unique[first]) if len(members) == 1 else shared(members)
        source = None
        if parent is None:  # nothing computed above: copy what a running row holds, up to this subtree's end
            row, length = matches[first]
            copied = min(length, end, len(unique[first]) - 1)
            # start > 0 without a parent: an ancestor's copy covered it, so this row must copy (>= start) too.
            if start > 0 or copied >= min_prefix:
                source, start = row, max(start, copied)
        if len(members) == 1:
            add(stage, Node(parent, first, start, end, leaf=True, held=source))
            return
        if end - start >= min_prefix:
            node = Node(parent, first, start, end, leaf=False, held=source)
            parent, start, stage = add(stage, node), end, stage + 1
        # Sorted prompts: a run whose neighbours share min_prefix tokens beyond `start` shares them all.
        run = [members[0]]
        for before, after in zip(members, members[1:], strict=False):
            if shared([before, after]) - start < min_prefix:
                grow(run, start, parent, stage)
                run = []
            run.append(after)
        grow(run, start, parent, stage)

    grow(sorted(range(len(unique)), key=unique.__getitem__), 0, None, 0)
    plan = PrefillPlan(unique, rows, tuple(tuple(s) for s in stages))
    copies = len(stages) > 1 or any(n.held is not None for n in stages[0])
    if copies and plan.computed_tokens > max_share * len(rows) * max(len(p) for p in unique):
        plan = PrefillPlan(unique, rows, (tuple(Node(None, u, 0, len(p), leaf=True) for u, p in enumerate(unique)),))
    if len(unique) == len(rows) and len(plan.stages) == 1 and all(n.leaf and n.held is None for n in plan.stages[0]):
        return None  # every prompt distinct, alone at the root, nothing held: the plain prefill
    return plan


def left_padded_mask(lengths: Sequence[int], width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The [rows, width] attention mask of left-padded rows: row i's last lengths[i] columns 1."""
    lengths = torch.as_tensor(lengths, device=device)
    return (torch.arange(width, device=lengths.device)[None, :] >= width - lengths[:, None]).long()


def copy_columns(layers: KeyValues, picks: Sequence[tuple[int, int, torch.Tensor]], rows: int, width: int,
                 into: KeyValues | None = None, *, at_start: bool = False) -> KeyValues:
    """For each pick (dst row, src row, src columns): layers[src, :, columns] copied into the last len(columns)
    of `width` columns of row dst of `into` (`at_start`: its first len(columns); None: new zero blocks
    [rows, H, width, D]), all in one gather and one scatter per tensor."""
    if into is None:
        # zeros, not garbage, before each row: masked columns still enter attention (0 * NaN = NaN)
        into = [tuple(kv.new_zeros((rows, kv.shape[1], width, kv.shape[3])) for kv in pair) for pair in layers]
    if picks:
        device = layers[0][0].device
        src_rows = torch.cat([torch.full((len(cols),), src) for _, src, cols in picks]).to(device)
        src_cols = torch.cat([cols.to(device) for _, _, cols in picks])
        dst_rows = torch.cat([torch.full((len(cols),), dst) for dst, _, cols in picks]).to(device)
        dst_cols = torch.cat([torch.arange(len(cols)) + (0 if at_start else width - len(cols))
                              for _, _, cols in picks]).to(device)
        for out, pair in zip(into, layers, strict=True):
            for buffer, kv in zip(out, pair, strict=True):
                buffer[dst_rows, :, dst_cols] = kv[src_rows, :, src_cols]
    return into


def held_block(layers: KeyValues, sources: Sequence[tuple[int, int] | None], width: int, rows: Sequence[int],
               starts: Sequence[int]) -> tuple[KeyValues, torch.Tensor]:
    """`HeldPrompts.prefix_block` of a running batch whose row i is row rows[i] of `layers`, its prompt
    starting at column starts[i]."""
    picks, lengths = [], []
    for dst, source in enumerate(sources):
        row, n = source or (0, 0)
        lengths.append(n)
        if n:
            picks.append((dst, rows[row], torch.arange(starts[row], starts[row] + n)))
    return (copy_columns(layers, picks, len(sources), width),
            left_padded_mask(lengths, width, layers[0][0].device))


class Leaves:
    """Collects each distinct prompt's keys/values as its leaf's level computes them, and lays them out for
    the requests as a plain left-padded prefill of `plan`'s prompts would."""

    def __init__(self, plan: PrefillPlan) -> None:
        self.plan = plan
        self.width = max(len(p) for p in plan.prompts)
        self.layers: KeyValues = []  # per layer: keys, values [distinct, H, width, D]
        self.logits: torch.Tensor | None = None

    def take(self, stage: int, layers: KeyValues, mask: torch.Tensor, logits: torch.Tensor) -> None:
        """After level `stage`'s call: copy its leaf rows' unmasked columns (mask [rows, W]) right-aligned."""
        nodes = self.plan.stages[stage]
        leaf_rows = [i for i, n in enumerate(nodes) if n.leaf]
        if not leaf_rows:
            return
        if self.logits is None:
            self.logits = logits.new_zeros((len(self.plan.prompts), logits.shape[1]))
        prompts = [nodes[i].prompt for i in leaf_rows]
        self.logits[torch.tensor(prompts, device=logits.device)] = logits[leaf_rows]
        picks = [(nodes[i].prompt, i, mask[i].nonzero().squeeze(1)) for i in leaf_rows]
        self.layers = copy_columns(layers, picks, len(self.plan.prompts), self.width, self.layers or None)

    def requests(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
        """Per layer (keys, values), the attention mask and the last logits, one row per request."""
        device = self.logits.device
        rows = torch.tensor(self.plan.rows, device=device)
        mask = left_padded_mask([len(self.plan.prompts[u]) for u in self.plan.rows], self.width, device)
        layers = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.layers]
        return layers, mask, self.logits.index_select(0, rows)


# The engine's left-padded model call into a cache (HFEngine._padded_forward).
PaddedForward = Callable[[list, Any, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def run_plan(plan: PrefillPlan, cache, held: HeldPrompts | None,
             padded_forward: PaddedForward) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan` into `cache` (a fresh cache of plain layers) one level per call, each row continuing from a
    copy of its parent's row (first level: of a running row's prompt, or nothing); leaves the cache holding
    every request's row as a plain left-padded prefill would. Returns that prefill's mask and last logits."""
    leaves, mask = Leaves(plan), None
    sources = [(node.held, node.start) if node.held is not None else None for node in plan.stages[0]]
    if any(sources):
        block, mask = held.prefix_block(sources, max(n for _, n in filter(None, sources)))
        for i, (keys, values) in enumerate(block):
            cache.update(keys, values, i)  # a fresh layer takes them as they are
    for stage, nodes in enumerate(plan.stages):
        if stage:
            parents = torch.tensor([node.parent for node in nodes], device=mask.device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, parents), layer.values.index_select(0, parents)
            mask = mask.index_select(0, parents)
        mask, logits = padded_forward(plan.segments(stage), cache, mask)
        leaves.take(stage, [(layer.keys, layer.values) for layer in cache.layers], mask, logits)
    layers, mask, logits = leaves.requests()
    for layer, (keys, values) in zip(cache.layers, layers, strict=True):
        layer.keys, layer.values = keys, values
    return mask, logits
