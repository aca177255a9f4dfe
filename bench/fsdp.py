"""What FSDP2 saves per trainer rank, and what it costs, side by side with DDP in one run.

    python bench/fsdp.py                  # 2 CPU processes (gloo), a 56M-parameter random Qwen3, ~2 min here
    python bench/fsdp.py --quick          # a smaller model, ~30 s
    python bench/fsdp.py --shape qwen3-0.6b --world 4 --backend nccl   # on a GPU node (not run yet)

For each strategy (`train.strategy` = ddp, then fsdp) the script starts `--world` processes, each one
trainer rank of a torch.distributed group, builds the same `memrl.train.actor.Actor` the Ray trainer
workers build (KL on, so the frozen reference model counts too), and trains `--steps` rollout steps
on the same random MemAgent-shaped rows. Each rank reports the bytes it holds in the policy's
parameters, their gradients, the AdamW state and the reference model (a DTensor counts its local shard
only), its peak RSS, and the wall time of the last step. Printed: the per-rank table and FSDP / DDP
ratios. Bytes are exact (deterministic); times are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from train import MODEL_SHAPES  # bench/train.py: run as `python bench/fsdp.py`, bench/ is on the path
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config
from memrl.train.actor import Actor
from memrl.types import TrainRow

SHAPES: dict[str, dict[str, int]] = {
    "quick": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "small": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
    "qwen3-0.6b": MODEL_SHAPES["qwen3-0.6b"],  # Qwen3-0.6B's architecture, random init (bench/train.py)
}


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def make_rows(vocab: int, questions: int, samples: int, seed: int = 0) -> list[TrainRow]:
    """One prompt group per question; each trajectory 1-3 memory turns and a final turn (MemAgent-shaped:
    prompts are most of every row)."""
    rng = random.Random(seed)
    rows = []
    for q in range(questions):
        turns = rng.randint(2, 4)
        for s in range(samples):
            for turn in range(turns):
                final = turn == turns - 1
                prompt = rng.randint(40, 80) if final else rng.randint(200, 320)
                response = rng.randint(2, 16) if final else rng.randint(16, 64)
                rows.append(TrainRow(tokens=[rng.randrange(1, vocab) for _ in range(prompt + response)],
                                     response_length=response, loss_mask=[1] * response,
                                     rollout_log_probs=[-rng.random() * 3 for _ in range(response)],
                                     advantage=rng.uniform(-1, 1), group_id=f"q{q}", trajectory_id=f"q{q}s{s}",
                                     turn_index=turn, rollout_id=0))
    return rows


def rank_main(rank: int, args: argparse.Namespace, strategy: str, port: int, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.world, timeout=timedelta(seconds=600))
    try:
        device = torch.device(f"cuda:{rank}" if args.backend == "nccl" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPES[args.shape], tie_word_embeddings=True)).float()
        cfg = Config.model_validate({
            "train": {"dp_size": args.world, "pad_to_dp": True, "strategy": strategy, "runtime": "ray",
                      "lr": 1e-5, "micro_batch_tokens": args.micro_batch_tokens},
            "algorithm": {"kl_coef": 0.001}})
        actor = Actor(model, cfg, pad_token_id=0, device=device, rank=rank, world_size=args.world)
        rows = make_rows(SHAPES[args.shape]["vocab_size"], args.questions, args.samples)
        seconds = []
        for step in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            metrics = actor.train_rollout(rows, step)
            seconds.append(time.perf_counter() - start)
        optimizer_state = [v for state in actor.optimizer.state.values() for v in state.values()
                           if isinstance(v, torch.Tensor)]
        report = {
            "rank": rank, "strategy": strategy,
            "parameters": local_bytes(actor.model.parameters()),
            "gradients": local_bytes(p.grad for p in actor.model.parameters()),
            "optimizer": local_bytes(optimizer_state),
            "reference": local_bytes(actor.ref_model.parameters()) if actor.ref_model is not None else 0,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": seconds[-1], "loss": metrics["loss/total"], "grad_norm": metrics["grad_norm"],
            "model_parameters": sum(p.numel() for p in model.parameters()),
        }
        if device.type == "cuda":
            report["peak_cuda"] = torch.cuda.max_memory_allocated(device)
        Path(out, f"{strategy}_{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quick", action="store_true", help="--shape quick --questions 2")
    args = parser.parse_args()
    if args.quick:
        args.shape, args.questions = "quick", 2
    reports: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as out:
        for strategy in ("ddp", "fsdp"):
            mp.start_processes(rank_main, args=(args, strategy, free_port(), out), nprocs=args.world,
                               start_method="spawn")
            reports[strategy] = [json.loads(Path(out, f"{strategy}_{r}.json").read_text()) for r in range(args.world)]
    n = reports["ddp"][0]["model_parameters"]
    print(f"{args.shape}: {n / 1e6:.1f}M parameters, {args.world} ranks ({args.backend}), "
          f"{args.questions} questions x {args.samples} samples, KL on (reference model held), "
          f"step time of step {args.steps}")
    mib = 1024 ** 2
    keys = ["parameters", "gradients", "optimizer", "reference"]
    print(f"{'strategy':8} {'rank':>4} " + " ".join(f"{k + '_MiB':>14}" for k in keys)
          + f" {'total_MiB':>10} {'peak_rss_MiB':>12} {'step_s':>7} {'loss':>10} {'grad_norm':>9}")
    for strategy, ranks in reports.items():
        for r in ranks:
            total = sum(r[k] for k in keys)
            print(f"{strategy:8} {r['rank']:>4} " + " ".join(f"{r[k] / mib:>14.1f}" for k in keys)
                  + f" {total / mib:>10.1f} {r['peak_rss'] / mib:>12.0f} {r['step_s']:>7.2f}"
                  f" {r['loss']:>10.6f} {r['grad_norm']:>9.5f}")
    ddp, fsdp = reports["ddp"][0], reports["fsdp"][0]
    held = sum(fsdp[k] for k in keys) / sum(ddp[k] for k in keys)
    print(f"fsdp / ddp, rank 0: training state held {held:.2f}x (ideal 1/{args.world} = {1 / args.world:.2f}x), "
          f"peak RSS {fsdp['peak_rss'] / ddp['peak_rss']:.2f}x, step time {fsdp['step_s'] / ddp['step_s']:.2f}x; "
          f"same loss: {abs(fsdp['loss'] - ddp['loss']) <= 1e-5 * max(1.0, abs(ddp['loss']))}")
    if "peak_cuda" in ddp:
        print(f"peak CUDA memory, rank 0: ddp {ddp['peak_cuda'] / mib:.0f} MiB, fsdp {fsdp['peak_cuda'] / mib:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
