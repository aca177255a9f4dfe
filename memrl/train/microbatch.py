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

from memrl.train import packing
from memrl.train.logprobs import TokenStats, response_token_stats
from memrl.types import TrainRow


@dataclass
class MicroBatch:
    """The tensors of a micro-batch; response values live in [rows, max_response] tensors. Padded: rows
    right-padded to the longest, with a 2-D mask. Packed: one [1, T] sequence whose position ids restart at
    each row and whose attention gets the row boundaries, so every token sees what it sees padded."""

    input_ids: Tensor              # [B, L] padded, [1, T] packed
    attention_mask: Tensor | None  # [B, L] padded; None packed
    position_ids: Tensor | None    # [1, T] packed; None padded (the model counts 0..L-1)
    row_lengths: list[int] | None  # packed: each row's length, in order (the attention's row boundaries)
    cu_seq_lens: Tensor | None     # packed: [B + 1] int32 cumulative lengths (FlashAttention's argument)
    positions: Tensor              # [N, 2]: (row, position) of the hidden state predicting each response token
    targets: Tensor                # [N]
    resp_index: Tensor             # [N, 2]: (row, k) of each response token in the [B, R] tensors
    loss_mask: Tensor              # [B, R]
    rollout_log_probs: Tensor      # [B, R]
    advantages: Tensor             # [B]
    row_weights: Tensor            # [B]

    @classmethod
    def build(cls, rows: list[TrainRow], weights: list[float], pad_id: int, device: torch.device,
              packed: bool = False) -> MicroBatch:
        pos, tgt, ridx = [], [], []
        offset = 0  # where row b starts: in its own row (padded) or in the one packed sequence
        for b, r in enumerate(rows):
            p = r.prompt_length
            for k in range(r.response_length):
                # the hidden state at position t predicts token t + 1
                pos.append((0, offset + p + k - 1) if packed else (b, p + k - 1))
                tgt.append(r.tokens[p + k])
                ridx.append((b, k))
            offset += len(r.tokens)
        lengths = [len(r.tokens) for r in rows]
        if packed:
            ids = torch.tensor([[t for r in rows for t in r.tokens]], dtype=torch.long)
            position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            attn = None
        else:
            ids = _right_padded([r.tokens for r in rows], torch.long, pad_id)
            attn = (torch.arange(max(lengths)) < torch.tensor(lengths).unsqueeze(1)).long()
            position_ids = cu_seq_lens = None
        mask = _right_padded([r.loss_mask for r in rows], torch.float)
        old = _right_padded([r.rollout_log_probs for r in rows], torch.float)

        def put(t: Tensor | None) -> Tensor | None:
            # From pinned memory without blocking: a pageable host-to-GPU copy waits for every kernel queued
            # before it, a host sync per tensor per micro-batch.
            if t is None or device.type != "cuda":
                return None if t is None else t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        return cls(put(ids), put(attn), put(position_ids), lengths if packed else None, put(cu_seq_lens),
                   put(torch.tensor(pos, dtype=torch.long).reshape(-1, 2)), put(torch.tensor(tgt, dtype=torch.long)),
                   put(torch.tensor(ridx, dtype=torch.long).reshape(-1, 2)), put(mask), put(old),
                   put(torch.tensor([r.advantage for r in rows])), put(torch.tensor(weights, dtype=torch.float)))

    def inputs(self) -> tuple[Any, ...]:
        """The arguments of `ResponseStats.forward` (tensors as arguments: DDP and FSDP hook the forward)."""
        return (self.input_ids, self.attention_mask, self.position_ids, self.row_lengths, self.cu_seq_lens,
                self.positions, self.targets)

    def scatter(self, flat: Tensor) -> Tensor:
        out = flat.new_zeros(self.loss_mask.shape)
        out[self.resp_index[:, 0], self.resp_index[:, 1]] = flat
        return out


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
                row_lengths: list[int] | None, cu_seq_lens: Tensor | None, positions: Tensor,
                targets: Tensor) -> TokenStats:
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if row_lengths is not None:  # packed: the attention gets the row boundaries and no mask
            packing.check_enabled(self.model)
            kwargs = packing.packed_kwargs(row_lengths, cu_seq_lens)
        hidden = self.model.base_model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state
        return response_token_stats(hidden[positions[:, 0], positions[:, 1]], targets,
                                    self.model.get_output_embeddings(), self.temperature, self.head_chunk,
                                    self.with_entropy)
