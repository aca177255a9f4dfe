"""FSDP2 in the actor, on two CPU processes (gloo) without Ray: sharded checkpoints resume exactly and are
the same files a one-process run reads. (Ray runs of the same code: tests/distributed/test_ray_runtime.py.)"""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_actor import make_rows, tiny_model
from torch.distributed.tensor import DTensor

from memrl.config import Config
from memrl.train import fsdp
from memrl.train.actor import Actor
from memrl.train.checkpoint import save_checkpoint

WORLD = 2
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def fsdp_cfg() -> Config:
    return Config.model_validate({"train": {"lr": 1e-2, "dp_size": WORLD, "pad_to_dp": True, "strategy": "fsdp",
                                            "runtime": "ray", "micro_batch_tokens": 40},
                                  "algorithm": {"kl_coef": 0.01}})


def _rank_main(rank: int, port: int, root: str) -> None:
    """Rank `rank`: train, checkpoint, resume into a fresh sharded actor, train both on: they must agree."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # a failing peer ends the other's wait
    try:
        cfg, rows = fsdp_cfg(), make_rows(n_groups=3)
        first = Actor(tiny_model(), cfg, pad_token_id=0, rank=rank, world_size=WORLD)
        assert sum(p.numel() for p in first.model.parameters()) == sum(p.numel() for p in tiny_model().parameters())
        local = sum(p.to_local().numel() for p in first.model.parameters())
        assert local < sum(p.numel() for p in tiny_model().parameters())  # really sharded: each rank holds a part
        first.train_rollout(rows, 0)
        # after a step nothing stays gathered: not the policy, nor the reference (which has no backward)
        for model in (first.model, first.ref_model):
            assert all(isinstance(p, DTensor) for p in model.parameters())
        first.log_probs(rows[:2])  # a forward with no backward, as the old log-probs of several steps
        assert all(isinstance(p, DTensor) for p in first.model.parameters())
        saved = first.save_checkpoint(root, 0, {"config": None})
        assert (saved is None) == (rank != 0)
        dist.barrier()
        # gradient checkpointing under FSDP (recomputed blocks re-gather their shards): the same step
        recomputing = Actor(tiny_model(), fsdp_cfg().model_copy(update={"train": cfg.train.model_copy(
            update={"gradient_checkpointing": True})}), pad_token_id=0, rank=rank, world_size=WORLD)
        recomputing.train_rollout(rows, 0)
        same_step = recomputing.full_state_dict()
        if rank == 0:
            from safetensors.torch import load_file

            after_first = load_file(f"{root}/checkpoints/iter_0000000/model/model.safetensors")
            for name, value in after_first.items():
                torch.testing.assert_close(same_step[name], value, atol=1e-6, rtol=0, msg=name)
        # the same base model (the reference of the KL term); the trained weights come from the checkpoint
        resumed = Actor(tiny_model(), cfg, pad_token_id=0, rank=rank, world_size=WORLD,
                        load=f"{root}/checkpoints/iter_0000000")
        assert resumed.global_step == first.global_step == 1
        for actor in (first, resumed):
            actor.train_rollout(rows, 1)
        a, b = first.full_state_dict(), resumed.full_state_dict()
        oa = fsdp.full_optimizer_state(first.model, first.optimizer, rank)
        ob = fsdp.full_optimizer_state(resumed.model, resumed.optimizer, rank)
        if rank == 0:
            for name, value in a.items():
                torch.testing.assert_close(b[name], value, atol=0, rtol=0, msg=name)
            for index, state in oa["state"].items():
                for key, value in state.items():
                    torch.testing.assert_close(ob["state"][index][key], value, atol=0, rtol=0)
            # rank 0 also writes a plain checkpoint of the step-2 weights for the one-process comparison
            torch.save(a, f"{root}/fsdp_step2.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_checkpoint_resumes_exactly_and_loads_in_one_process(tmp_path):
    mp.start_processes(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, start_method="spawn")

    # The FSDP checkpoint is the same files a one-process run writes: resume it without sharding, train the
    # same second rollout, and land on the sharded run's weights.
    single = Config.model_validate({"train": {"lr": 1e-2, "dp_size": WORLD, "pad_to_dp": True,
                                              "micro_batch_tokens": 40}, "algorithm": {"kl_coef": 0.01}})
    one = Actor(tiny_model(), single, pad_token_id=0, load=tmp_path / "checkpoints" / "iter_0000000")
    assert one.global_step == 1
    one.train_rollout(make_rows(n_groups=3), 1)
    sharded = torch.load(tmp_path / "fsdp_step2.pt", weights_only=True)
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=0, msg=name)


def test_full_optimizer_state_round_trips_the_parameter_order():
    # the numbering of a plain optimizer: parameters in `model.parameters()` order, tied weights once
    model = tiny_model()
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # tied to the embeddings: one parameter, one optimizer slot
    blocks = fsdp.transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["Qwen3DecoderLayer"] * 2


def test_save_checkpoint_takes_gathered_weights_and_optimizer_state(tmp_path):
    model = tiny_model()
    weights = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    optimizer_state = torch.optim.AdamW(model.parameters()).state_dict()
    path = save_checkpoint(tmp_path, 3, model, optimizer_state, None, {}, weights=weights)
    from safetensors.torch import load_file

    saved = load_file(str(path / "model" / "model.safetensors"))
    assert all(torch.count_nonzero(v) == 0 for v in saved.values())  # the given weights, not the model's
    assert torch.load(path / "optimizer.pt", weights_only=True) == optimizer_state
