"""The CPU choices of a real-model step, side by side on SmolLM2-135M's shape: bf16 vs float32 (matrix
product, actor step, engine), torch threads 1 vs 2, KL on vs off (the reference forward).

    python bench/cpu_precision.py                  # random-init SmolLM2-135M shape (Llama, 134.5M), ~5 min
    python bench/cpu_precision.py --model models/smollm2-135m   # the imported model (`memrl import-gguf`)
    python bench/cpu_precision.py --quick          # 4 rows instead of 8, 16 new tokens instead of 32

First a probe: one [1024 x 576] x [576 x 1536] product (SmolLM2's MLP) in float32 and in bf16 at 1 and 2
threads. bf16 rows run only where the probe finds bf16 at least half as fast as float32: a CPU without
AVX512-BF16 / AMX emulates it (`memrl env`: "cpu bfloat16"), and an emulated actor step would take an hour;
such rows are printed as skipped with the probe's figures. Actor step: `Actor.train_rollout` on rows shaped
like docs/real-model.md's smoke (prompts 200-300 tokens, responses 16-48), float32 master weights, bf16 by
autocast; each variant runs twice in alternating order after a warm-up, the median taken. Engine: HFEngine,
8 concurrent requests of a 250-token prompt, `--new-tokens` each. Ratios are from this one run; the machine
may be shared: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from memrl.apps.env import cpu_bf16_native
from memrl.config import Config
from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.train.actor import Actor
from memrl.types import TrainRow

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
                    max_position_embeddings=8192)


def build_model(path: str | None) -> torch.nn.Module:
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))


def matmul_gflops(dtype: torch.dtype, threads: int, repeats: int = 10) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 576).to(dtype), torch.randn(576, 1536).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * 1024 * 576 * 1536 * repeats / (time.perf_counter() - start) / 1e9


def rows(n: int, vocab: int, seed: int = 0) -> list[TrainRow]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        p, r = rng.randint(200, 300), rng.randint(16, 48)
        out.append(TrainRow(tokens=[rng.randrange(100, vocab) for _ in range(p + r)], response_length=r,
                            loss_mask=[1] * r, rollout_log_probs=[-rng.random() * 3 for _ in range(r)],
                            advantage=rng.uniform(-1, 1), group_id=f"g{k // 4}", trajectory_id=f"t{k}",
                            turn_index=0, rollout_id=0))
    return out


def actor_step(model: torch.nn.Module, batch: list[TrainRow], *, bf16: bool, kl: bool, threads: int) -> float:
    """Seconds of one `train_rollout` over `batch` (a fresh actor over a copy: every variant starts alike)."""
    torch.set_num_threads(threads)
    cfg = Config.model_validate({"train": {"lr": 1e-6, "micro_batch_tokens": 4096},
                                 "algorithm": {"kl_coef": 0.001 if kl else 0.0}})
    actor = Actor(model, cfg, pad_token_id=0, device=torch.device("cpu"))
    if bf16:  # what a `train.autocast` option would set on CPU: float32 weights and AdamW, bf16 products
        actor.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    start = time.perf_counter()
    actor.train_rollout(batch, 1)
    return time.perf_counter() - start


def engine_tokens_per_s(model: torch.nn.Module, dtype: torch.dtype, new_tokens: int, threads: int) -> float:
    torch.set_num_threads(threads)
    engine = HFEngine(model, None, dtype=dtype, device="cpu", max_batch_size=8)
    rng, vocab = random.Random(1), model.config.vocab_size
    requests = [GenerationRequest([rng.randrange(100, vocab) for _ in range(250)], new_tokens, temperature=1.0,
                                  top_p=1.0, stop_token_ids=[], seed=k) for k in range(8)]

    async def run() -> float:
        try:
            await engine.generate(requests[:1])  # warm-up
            start = time.perf_counter()
            results = [r[0] for r in await asyncio.gather(*(engine.generate([r]) for r in requests))]
            failed = [r.error for r in results if r.finish_reason == "error"]
            if failed:
                raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
            return sum(len(r.output_ids) for r in results) / (time.perf_counter() - start)
        finally:
            await engine.close()

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face folder (default: random SmolLM2-135M shape)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--new-tokens", type=int, default=None)
    args = parser.parse_args()
    n_rows, new_tokens = (4, 16) if args.quick else (8, 32)
    new_tokens = args.new_tokens or new_tokens
    print(f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_bf16_native()}", flush=True)
    probe = {(dt, t): matmul_gflops(dt, t) for dt in (torch.float32, torch.bfloat16) for t in (1, 2)}
    for (dt, t), g in probe.items():
        print(f"matmul 1024x576x1536 {str(dt).removeprefix('torch.'):<8} {t} thread(s): {g:7.1f} GFLOP/s", flush=True)
    bf16_ok = probe[torch.bfloat16, 2] >= 0.5 * probe[torch.float32, 2]
    model = build_model(args.model)
    batch = rows(n_rows, model.config.vocab_size)
    tokens = sum(len(r.tokens) for r in batch)
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {n_rows} rows, {tokens} tokens",
          flush=True)
    base = dict(bf16=False, kl=False, threads=2)
    variants = {"float32, KL off, 2 threads": base, "float32, KL on": {**base, "kl": True},
                "float32, 1 thread": {**base, "threads": 1}}
    if bf16_ok:
        variants["bf16 autocast"] = {**base, "bf16": True}
    actor_step(model, batch, **base)  # warm-up (allocator, kernels)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(2):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(actor_step(model, batch, **variants[name]))
    ref = statistics.median(times["float32, KL off, 2 threads"])
    for name, ts in times.items():
        mid = statistics.median(ts)
        print(f"actor step {name:<28} {mid:7.1f} s ({', '.join(f'{t:.1f}' for t in ts)}), {tokens / mid:6.0f} "
              f"tokens/s, {ref / mid:.2f}x the float32 2-thread step", flush=True)
    if not bf16_ok:
        print(f"actor step bf16 autocast: skipped (bf16 products at {probe[torch.bfloat16, 2]:.1f} vs "
              f"{probe[torch.float32, 2]:.1f} GFLOP/s in float32: emulated on this CPU)", flush=True)
    for label, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        if dtype == torch.bfloat16 and not bf16_ok:
            print("engine bfloat16: skipped (emulated bf16 on this CPU)")
            continue
        for threads in (2, 1):
            rate = engine_tokens_per_s(build_model(args.model), dtype, new_tokens, threads)
            print(f"engine {label:<8} {threads} thread(s), 8 concurrent: {rate:7.1f} tokens/s", flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
