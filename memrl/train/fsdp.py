"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the actor: shard, gather full weights, move optimizer state.

`train.strategy = "fsdp"` shards parameters, gradients and optimizer state over the trainer ranks. Each
transformer block (`_no_split_modules`) is its own unit, gathered only while it runs; the root unit holds
the rest (embeddings and the tied LM head, which must share a unit). What leaves the ranks is always whole
(weights with Hugging Face keys, the optimizer state in plain `torch.optim` form), so a checkpoint resumes
under any strategy. Every function here is a collective: all ranks call it, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard(root: torch.nn.Module, model: torch.nn.Module, device: torch.device) -> None:
    """Shard `root` (a module whose forward runs `model`) block by block. FSDP2 gathers the root unit in a
    hook on its forward, so the root must be the wrapper the caller calls, not `model`."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(root, mesh=mesh)


def full_weights(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor] | None:
    """CPU copies of a sharded `model`'s weights (Hugging Face keys; None off rank 0), gathered one tensor
    at a time; tied weights stay one tensor under both keys, as `save_pretrained` expects."""
    params = dict(model.named_parameters(remove_duplicate=False))
    # By parameter identity: tied keys name one parameter, gathered once. Every rank takes the same path
    # through this loop (the same gathers in the same order); only rank 0 keeps copies.
    gathered: dict[int, torch.Tensor | None] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        param = params.get(key)
        if param is not None and id(param) in gathered:
            full = gathered[id(param)]
        else:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            full = full.detach().to("cpu", copy=True) if rank == 0 else None
            if param is not None:
                gathered[id(param)] = full
        if full is not None:
            out[key] = full
    return out if rank == 0 else None


def _rekeyed(state: dict[str, Any], key: dict[Any, Any]) -> dict[str, Any]:
    """An optimizer state dict with its parameter keys mapped by `key` (torch's indices <-> FSDP's names)."""
    return {"state": {key[k]: value for k, value in state["state"].items()},
            "param_groups": [{**group, "params": [key[k] for k in group["params"]]}
                             for group in state["param_groups"]]}


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> dict | None:
    """The sharded optimizer's whole state in `optimizer.state_dict()` form; None off rank 0."""
    by_name = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    return _rekeyed(by_name, {name: i for i, (name, _) in enumerate(model.named_parameters())})


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict[str, Any] | None) -> None:
    """Load a whole `optimizer.state_dict()`-form state into a sharded optimizer: only rank 0 passes it
    (others None), broadcast tensor by tensor so no other rank holds all of it."""
    names = [name for name, _ in model.named_parameters()]
    by_name: dict[str, Any] = {}
    if state is not None:
        saved = sum(len(g["params"]) for g in state["param_groups"])
        if saved != len(names):
            # Rank 0 raises; the others fail in the broadcast they were waiting in (named by the runtime).
            raise ValueError(f"the saved optimizer state covers {saved} parameters, this model has "
                             f"{len(names)}; is it the same architecture?")
        by_name = _rekeyed(state, dict(enumerate(names)))
    set_optimizer_state_dict(model, optimizer, by_name,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
