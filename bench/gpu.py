"""GPU throughput of memrl's own engine and actor on a random-initialised Qwen3-0.6B-shaped model (bf16).

Prints (and writes as JSON with --out) from one run:
- generation: HFEngine tokens/s at 1, 16, 64 and 256 concurrent requests (MemAgent-shaped: prompts of
  ~700 tokens, up to 128 new tokens), and plain batched `model.generate` at 64 for reference;
- training: Actor.train_rollout tokens/s on MemAgent-shaped rows (prompt 500-900, response 16-128 tokens),
  with model FLOPs utilization (6·N·T over all tokens, N = non-embedding parameters, + LM head on
  response tokens, + the reference model's forward; H200 dense bf16 peak taken as 989 TFLOP/s), before vs
  after chunked log-probs and packing (TRAIN_VARIANTS), each at growing `train.micro_batch_tokens` until one
  runs out of memory, with the ratios against `before`.
Run: `bash bench/gpu.sh` on a CUDA machine (a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config
from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.train.actor import Actor
from memrl.types import TrainRow

PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16


def qwen3_06b_config() -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1_000_000)


def build_model(dtype: torch.dtype) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(qwen3_06b_config())
    return model.to(dtype)


def bench_generation(model: Qwen3ForCausalLM, concurrency: int, rng: random.Random, max_tokens: int = 128) -> dict:
    engine = HFEngine(model, None, max_batch_size=256, max_batch_tokens=256 * 1024)
    requests = [GenerationRequest([rng.randrange(1000, 150000) for _ in range(rng.randint(600, 800))], max_tokens,
                                  temperature=1.0, top_p=1.0, stop_token_ids=[], seed=k) for k in range(concurrency)]

    async def run() -> list:
        return await asyncio.gather(*(engine.generate([r]) for r in requests))

    torch.cuda.synchronize()
    start = time.perf_counter()
    results = asyncio.run(run())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r[0].output_ids) for r in results)
    return {"concurrency": concurrency, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def bench_plain_generate(model: Qwen3ForCausalLM, batch: int, rng: random.Random, max_tokens: int = 128) -> dict:
    prompt_len = 700
    ids = torch.tensor([[rng.randrange(1000, 150000) for _ in range(prompt_len)] for _ in range(batch)], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    return {"batch": batch, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def memagent_rows(n: int, rng: random.Random) -> list[TrainRow]:
    rows = []
    for k in range(n):
        p, r = rng.randint(500, 900), rng.randint(16, 128)
        rows.append(TrainRow(tokens=[rng.randrange(1000, 150000) for _ in range(p + r)], response_length=r,
                             loss_mask=[1] * r, rollout_log_probs=[-rng.random() * 5 for _ in range(r)],
                             advantage=rng.uniform(-1, 1), group_id=f"g{k // 40}", trajectory_id=f"t{k // 5}",
                             turn_index=k % 5, rollout_id=0))
    return rows


# Training rows, before vs after (issue 14): (name, train overrides, micro-batch token budgets to try). `before`
# is the former path (whole [tokens x vocab] fp32 logits kept for the backward, padded micro-batches) at the
# budget it was measured at; the others go up in budget until the GPU runs out of memory.
TRAIN_VARIANTS: list[tuple[str, dict, list[int]]] = [
    ("before", {"logprob_chunk_tokens": None, "packing": False}, [16384]),
    ("chunked", {"packing": False}, [16384, 32768, 65536, 131072]),
    ("chunked+packed", {"packing": True}, [16384, 32768, 65536, 131072]),
]


def bench_training(n_rows: int, steps: int, micro_batch_tokens: int, rng: random.Random,
                   train: dict | None = None) -> dict:
    model = build_model(torch.float32)
    cfg = Config.model_validate({"train": {"lr": 1e-6, "micro_batch_tokens": micro_batch_tokens, **(train or {})},
                                 "algorithm": {"kl_coef": 0.001}})
    actor = Actor(model, cfg, pad_token_id=0, device=torch.device("cuda"))
    rows = memagent_rows(n_rows, rng)
    actor.train_rollout(rows[: max(8, n_rows // 8)], 0)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = {}
    for step in range(steps):
        metrics = actor.train_rollout(rows, step + 1)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in rows) * steps
    resp = sum(r.response_length for r in rows) * steps
    c = model.config
    embed = c.vocab_size * c.hidden_size
    body = sum(p.numel() for p in model.parameters()) - embed
    # policy fwd+bwd over all tokens (6NT), LM head fwd+bwd on response tokens, reference forward (2NT + head)
    flops = 6 * body * tokens + 6 * embed * resp + 2 * body * tokens + 2 * embed * resp
    return {"rows": n_rows, "steps": steps, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "mfu": flops / elapsed / PEAK_BF16_FLOPS, "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            "padding_fraction": metrics.get("padding_fraction"), "micro_batches": metrics.get("micro_batches")}


def training_rows(n_rows: int) -> list[dict]:
    """Every TRAIN_VARIANTS row on the same rows (same seed), each budget until one runs out of memory; then
    each variant's best against `before`."""
    out = []
    for name, train, budgets in TRAIN_VARIANTS:
        for budget in budgets:
            try:
                r = bench_training(n_rows, 2, budget, random.Random(1), train)
            except torch.cuda.OutOfMemoryError:
                out.append({"variant": name, "micro_batch_tokens": budget, "oom": True})
                print(f"train {name:<15} micro_batch_tokens {budget:6d}: out of memory", flush=True)
                break
            finally:
                gc.collect()
                torch.cuda.empty_cache()
            out.append({"variant": name, "micro_batch_tokens": budget, **train, **r})
            print(f"train {name:<15} micro_batch_tokens {budget:6d}: {r['tokens_per_s']:9.0f} tokens/s, MFU "
                  f"{100 * r['mfu']:.1f}%, peak {r['peak_memory_gb']:.1f} GiB, padding {r['padding_fraction']:.3f}",
                  flush=True)
    before = next(r for r in out if r["variant"] == "before" and not r.get("oom"))
    for name, _, _ in TRAIN_VARIANTS[1:]:
        ran = [r for r in out if r["variant"] == name and not r.get("oom")]
        if ran:
            best = max(ran, key=lambda r: r["tokens_per_s"])
            print(f"train {name} (best, micro_batch_tokens {best['micro_batch_tokens']}) vs before: "
                  f"{best['tokens_per_s'] / before['tokens_per_s']:.2f}x tokens/s (goal >= 3x), MFU "
                  f"{100 * best['mfu']:.1f}% vs {100 * before['mfu']:.1f}% (goal >= 30%)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py needs a CUDA device")
    rng = random.Random(0)
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import transformers

    results["transformers"] = transformers.__version__
    model = build_model(torch.bfloat16)
    results["parameters"] = sum(p.numel() for p in model.parameters())
    bench_generation(model, 4, rng, max_tokens=8)  # warm-up
    results["generation"] = []
    for conc in ([1, 16, 64] if args.quick else [1, 16, 64, 256]):
        r = bench_generation(model, conc, rng)
        results["generation"].append(r)
        print(f"generate  concurrency {conc:4d}: {r['tokens_per_s']:9.0f} tokens/s ({r['tokens']} tokens, {r['seconds']:.1f} s)",
              flush=True)
    r = bench_plain_generate(model, 64, rng)
    results["plain_generate"] = r
    print(f"plain model.generate batch 64: {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    del model
    torch.cuda.empty_cache()
    results["training"] = training_rows(256 if not args.quick else 128)
    base = results["generation"][0]["tokens_per_s"]
    print("generation speed-up vs 1 request: " + ", ".join(
        f"{g['concurrency']}: {g['tokens_per_s'] / base:.1f}x" for g in results["generation"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
