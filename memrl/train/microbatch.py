"""A micro-batch's tensors (`MicroBatch`) and the forward that gives its response tokens' log-probs and
entropy (`ResponseStats`). Only response positions go through the LM head, a chunk at a time
(`memrl.train.logprobs`): prompt tokens carry no loss and are most of every MemAgent row (docs/design.md,
pitfall "Prompt-heavy actor update").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from memrl.train import packing, shared_prefix
from memrl.train.logprobs import TokenStats, response_token_stats
from memrl.types import TrainRow


@dataclass
class MicroBatch:
    """The tensors of a micro-batch; response values live in [rows, max_response] tensors. Padded: rows
    right-padded to the longest, with a 2-D mask. Packed: one [1, T] sequence whose position ids restart at
    each row and whose attention gets the row boundaries, so every token sees what it sees padded. Shared
    (`train.share_prefixes`): one [1, T] sequence holding what rows share once (memrl.train.shared_prefix)."""

    input_ids: Tensor              # [B, L] padded, [1, T] packed
    attention_mask: Tensor | None  # [B, L] padded; None packed
    position_ids: Tensor | None    # [1, T] packed; None padded (the model counts 0..L-1)
    row_lengths: list[int] | None  # packed: each row's length, in order (the attention's row boundaries)
    cu_seq_lens: Tensor | None     # packed: [B + 1] int32 cumulative lengths (FlashAttention's argument)
    shared_layout: shared_prefix.Layout | None  # shared: each cluster's prefix and suffix lengths, in order
    positions: Tensor              # [N, 2]: (row, position) of the hidden state predicting each response token
    targets: Tensor                # [N]
    resp_index: Tensor             # [N, 2]: (row, k) of each response token in the [B, R] tensors
    loss_mask: Tensor              # [B, R]
    rollout_log_probs: Tensor      # [B, R]
    advantages: Tensor             # [B]
    row_weights: Tensor            # [B]

    @classmethod
    def build(cls, rows: list[TrainRow], weights: list[float], pad_id: int, device: torch.device,
              packed: bool = False, share_min: int | None = None) -> MicroBatch:
        """`share_min`: lay out rows that share at least that many leading tokens with their prefix once
        (`memrl.train.shared_prefix`); a micro-batch sharing nothing is built padded or packed as without."""
        clusters = shared_prefix.prefix_clusters(rows, share_min) if share_min is not None else []
        lengths = [len(r.tokens) for r in rows]
        layout = None
        if shared_prefix.shares(clusters):
            ids, position_ids, layout, lines = _shared_sequence(rows, clusters)
            attn = cu_seq_lens = None
        elif packed:
            ids = torch.tensor([[t for r in rows for t in r.tokens]], dtype=torch.long)
            position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            attn = None
            lines = [(0, start) for start in itertools.accumulate([0, *lengths[:-1]])]
        else:
            ids = _right_padded([r.tokens for r in rows], torch.long, pad_id)
            attn = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
            position_ids = cu_seq_lens = None
            lines = [(b, 0) for b in range(len(rows))]
        pos, tgt, ridx = [], [], []
        for b, (r, (line, shift)) in enumerate(zip(rows, lines, strict=True)):
            p = r.prompt_length
            for k in range(r.response_length):
                pos.append((line, shift + p + k - 1))  # the hidden state at position t predicts token t + 1
                tgt.append(r.tokens[p + k])
                ridx.append((b, k))
        mask = _right_padded([r.loss_mask for r in rows], torch.float)
        old = _right_padded([r.rollout_log_probs for r in rows], torch.float)

        def put(t: Tensor | None) -> Tensor | None:
            # From pinned memory without blocking: a pageable host-to-GPU copy waits for every kernel queued
            # before it, a host sync per tensor per micro-batch.
            if t is None or device.type != "cuda":
                return None if t is None else t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        return cls(put(ids), put(attn), put(position_ids), lengths if cu_seq_lens is not None else None,
                   put(cu_seq_lens), layout,
                   put(torch.tensor(pos, dtype=torch.long).reshape(-1, 2)), put(torch.tensor(tgt, dtype=torch.long)),
                   put(torch.tensor(ridx, dtype=torch.long).reshape(-1, 2)), put(mask), put(old),
                   put(torch.tensor([r.advantage for r in rows])), put(torch.tensor(weights, dtype=torch.float)))

    def inputs(self) -> tuple[Any, ...]:
        """The arguments of `ResponseStats.forward` (tensors as arguments: DDP and FSDP hook the forward)."""
        return (self.input_ids, self.attention_mask, self.position_ids, self.row_lengths, self.cu_seq_lens,
                self.shared_layout, self.positions, self.targets)

    def scatter(self, flat: Tensor) -> Tensor:
        out = flat.new_zeros(self.loss_mask.shape)
        out[self.resp_index[:, 0], self.resp_index[:, 1]] = flat
        return out


def _shared_sequence(rows: list[TrainRow], clusters: list[shared_prefix.Cluster]
                     ) -> tuple[Tensor, Tensor, shared_prefix.Layout, list[tuple[int, int]]]:
    """The one sequence of a sharing micro-batch: per cluster its prefix, then each member's suffix, with the
    position ids each token has in its own row; the layout; per row (0, shift) with token t of the row at
    shift + t (t >= the cluster's prefix: every predicting position and target is in the row's suffix)."""
    ids: list[int] = []
    position_ids: list[int] = []
    layout = []
    lines = [(0, 0)] * len(rows)
    for c in clusters:
        p = c.shared
        ids += rows[c.members[0]].tokens[:p]
        position_ids += range(p)
        for b in c.members:
            lines[b] = (0, len(ids) - p)
            ids += rows[b].tokens[p:]
            position_ids += range(p, len(rows[b].tokens))
        layout.append((p, tuple(len(rows[b].tokens) - p for b in c.members)))
    return (torch.tensor([ids], dtype=torch.long), torch.tensor([position_ids]), tuple(layout), lines)


def _right_padded(values: list[Any], dtype: torch.dtype, fill: float = 0) -> Tensor:
    """[rows, longest] of each row's values, filled after its end."""
    return pad_sequence([torch.tensor(v, dtype=dtype) for v in values], batch_first=True, padding_value=fill)


def response_log_probs(model: torch.nn.Module, mb: MicroBatch, temperature: float,
                       head_chunk: int | None) -> Tensor:
    """Log-probs [N] of the micro-batch's response tokens under `model` at the sampling temperature."""
    return ResponseStats(model, temperature, head_chunk)(*mb.inputs()).log_probs


class ResponseStats(torch.nn.Module):
    """Response tokens' log-probs and entropy as a module's forward, so DDP (whose gradient hooks its own
    forward arms) and FSDP (which gathers the root's parameters in a hook on it) can wrap it; `self.model`
    is the plain Hugging Face model, shared, never copied."""

    def __init__(self, model: torch.nn.Module, temperature: float, head_chunk: int | None,
                 with_entropy: bool = True) -> None:
        super().__init__()
        self.model, self.temperature, self.head_chunk = model, temperature, head_chunk
        self.with_entropy = with_entropy  # the reference model needs log-probs only

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                row_lengths: list[int] | None, cu_seq_lens: Tensor | None, shared_layout: shared_prefix.Layout | None,
                positions: Tensor, targets: Tensor) -> TokenStats:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if row_lengths is not None:  # packed: the attention gets the row boundaries and no mask
            packing.check_enabled(self.model)
            kwargs = packing.packed_kwargs(self.model, row_lengths, cu_seq_lens)
        elif shared_layout is not None:  # shared prefixes: the attention gets the layout and no mask
            packing.check_enabled(self.model, shared=True)
            kwargs = packing.shared_kwargs(self.model, shared_layout)
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        return response_token_stats(hidden[positions[:, 0], positions[:, 1]], targets,
                                    self.model.get_output_embeddings(), self.temperature, self.head_chunk,
                                    self.with_entropy)
