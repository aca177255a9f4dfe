"""Shared-prefix (tree-packed) micro-batches: rows that start with the same tokens forward that prefix once.

A GRPO group's n rows of one turn share a prompt prefix: at turn 0 the whole prompt, at later turns the
instructions and question (and, in the `chunk_first` layout, the chunk). `train.share_prefixes` lays such
rows out as one [1, T] sequence: per cluster of rows sharing p tokens, those p tokens once, then each
row's suffix (its tokens from p on), position ids p..len-1 so that rotary embeddings see every row as
unshared. Attention (`attention`, behind `memrl.train.packing`'s registered function) lets the prefix
attend causally to itself and each suffix attend to the prefix's keys and values and causally to itself;
every other layer works per token. So one model call computes each prefix once, and autograd sums every
suffix's gradient through the prefix's keys and values: the same function as forwarding each row whole,
equal to float32 rounding (tests/train/test_shared_prefix.py). A cluster shares at most its shortest
prompt less one token, so every position that predicts a response token lies in a suffix.

Clusters are single-level: rows sorted by tokens, cut into runs that maximise the tokens saved
((members - 1) x shared length), a run sharing at least `min_tokens` (`train.share_prefix_min_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from memrl.engines.prefix import shared_length
from memrl.types import TrainRow

# One cluster in the attention's terms: (shared prefix length, each member's suffix length), in sequence order.
Layout = tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Cluster:
    """Rows (indices into the list clustered, ascending) whose first `shared` tokens are the same."""

    members: tuple[int, ...]
    shared: int  # 0 for a row alone


def computed_tokens(lengths: Sequence[int], shared: int) -> int:
    """Token positions a cluster's rows of these lengths run: the prefix once, then every suffix."""
    return sum(lengths) - (len(lengths) - 1) * shared if len(lengths) > 1 else sum(lengths)


def prefix_clusters(rows: Sequence[TrainRow], min_tokens: int) -> list[Cluster]:
    """Every row in exactly one cluster, clusters in order of their first member. In token order the rows a
    run shares with each other are contiguous and a run shares the least of its neighbours' common prefixes,
    so one pass of dynamic programming over that order finds the contiguous runs that save the most tokens."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].tokens)
    tokens = [rows[i].tokens for i in order]
    # a member keeps at least its last prompt token: the position predicting its first response token
    cap = [rows[i].prompt_length - 1 for i in order]
    lcp = [shared_length(a, b) for a, b in zip(tokens, tokens[1:], strict=False)]
    saved = [0] * (len(order) + 1)  # saved[j]: the most tokens the first j sorted rows can save
    start = list(range(len(order) + 1))  # start[j]: where the last run of that best cut begins
    for j in range(1, len(order) + 1):
        saved[j], start[j], shared = saved[j - 1], j - 1, cap[j - 1]
        for i in range(j - 2, -1, -1):  # the run i..j-1; its shared length only falls as i moves left
            shared = min(shared, lcp[i], cap[i])
            if shared < min_tokens:
                break
            if saved[i] + (j - 1 - i) * shared > saved[j]:
                saved[j], start[j] = saved[i] + (j - 1 - i) * shared, i
    clusters, j = [], len(order)
    while j > 0:
        i = start[j]
        members = tuple(sorted(order[i:j]))
        shared = min([*cap[i:j], *lcp[i:j - 1]]) if j - i > 1 else 0
        clusters.append(Cluster(members, shared))
        j = i
    return sorted(clusters, key=lambda c: c.members[0])


def shares(clusters: Sequence[Cluster]) -> bool:
    return any(len(c.members) > 1 for c in clusters)


def attention(query: Tensor, key: Tensor, value: Tensor, layout: Layout, scaling: float | None,
              enable_gqa: bool) -> Tensor:
    """query [1, H, T, D], key/value [1, H_kv, T, D] of a shared-prefix sequence -> [1, T, H, D].

    A suffix of s tokens after a prefix of p attends to [prefix ; itself], the prefix wholly and itself
    causally. sdpa's `is_causal` aligns top-left when queries and keys differ in length, so either an explicit
    [s, p + s] mask, or the prefix's queries run again in front of the suffix's (a plain causal call of
    p + s, whose first p outputs are dropped). The masked kernel computes every one of its s (p + s) pairs,
    the causal one about half of its (p + s)^2 at ~1.3x the cost per pair (CPU, torch 2.13: equal at s = 2p),
    so the repeat is used only for suffixes longer than twice their prefix."""
    def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=enable_gqa)

    outs, at = [], 0
    for p, suffixes in layout:
        prefix = [x[:, :, at:at + p] for x in (query, key, value)]
        if p:
            outs.append(causal(*prefix))
        at += p
        for s in suffixes:
            q, k, v = (x[:, :, at:at + s] for x in (query, key, value))
            if p == 0:  # a row alone: the packed path's call
                outs.append(causal(q, k, v))
            elif s > 2 * p:
                outs.append(causal(*(torch.cat([a, b], dim=2) for a, b in zip(prefix, (q, k, v), strict=True)))
                            [:, :, p:])
            else:
                mask = torch.ones(s, p + s, dtype=torch.bool, device=q.device).tril(p)  # column j <= p + row
                outs.append(F.scaled_dot_product_attention(q, torch.cat([prefix[1], k], dim=2),
                                                           torch.cat([prefix[2], v], dim=2), attn_mask=mask,
                                                           scale=scaling, enable_gqa=enable_gqa))
            at += s
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
