"""Generation throughput, side by side in one run: HFEngine at 1 vs N concurrent requests, against plain
batched `model.generate` and transformers' continuous batching (`generate_batch`), same model and prompts.

    python bench/engine.py                      # ~4M-parameter random Qwen3, CPU, well under 2 minutes
    python bench/engine.py --device cuda --concurrency 64 --new-tokens 128
    python bench/engine.py --model /path/to/hf_model_folder

Every row generates exactly `--new-tokens` tokens per request (no stop tokens, sampling at T=1), so
tokens/s compare like with like. Timings are wall-clock after one warm-up of each method.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine, resolve_device_dtype
from memrl.tiny import build_tiny_model


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hugging Face model folder; default: a random ~4M-parameter Qwen3")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--sequential", type=int, default=4, help="requests timed one at a time (batch 1)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        model = build_tiny_model(512, layers=5, hidden=256, heads=4, kv_heads=2, intermediate=768)
    model = model.to(device=device, dtype=dtype).eval()
    vocab = model.get_input_embeddings().num_embeddings
    n, new = args.concurrency, args.new_tokens
    prompts = [[(31 * i + 7 * k) % (vocab - 10) + 5 for k in range(args.prompt_tokens - i % 8)] for i in range(n)]
    requests = [GenerationRequest(p, max_tokens=new, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {device}, {dtype}, "
          f"torch threads {torch.get_num_threads()}; {n} requests x {len(prompts[0])} prompt / {new} new tokens")

    engine = HFEngine(model, max_batch_size=max(n, 1))
    rows: list[tuple[str, float, int]] = []

    async def sequential() -> int:
        tokens = 0
        for request in requests[: args.sequential]:
            tokens += len((await engine.generate([request]))[0].output_ids)
        return tokens

    async def concurrent() -> int:
        results = await asyncio.gather(*(engine.generate([r]) for r in requests))
        return sum(len(res[0].output_ids) for res in results)

    asyncio.run(engine.generate(requests[:2]))  # warm-up
    rows.append(("HFEngine, batch 1 (sequential)", *timed(lambda: asyncio.run(sequential()))))
    rows.append((f"HFEngine, {n} concurrent requests", *timed(lambda: asyncio.run(concurrent()))))

    # Plain batched generate: one left-padded batch, no per-request sampling settings or log-probs.
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0,
                              top_k=0, pad_token_id=0, eos_token_id=None)

    def plain(scores: bool) -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config,
                                 output_logits=scores, return_dict_in_generate=scores)
        sequences = out.sequences if scores else out
        return (sequences.shape[1] - width) * n

    plain(False)
    rows.append((f"model.generate, batch {n}", *timed(lambda: plain(False))))
    rows.append((f"model.generate, batch {n}, output_logits", *timed(lambda: plain(True))))

    # transformers' continuous batching (paged KV cache), when this version ships it.
    if hasattr(model, "generate_batch"):
        def continuous() -> int:
            out = model.generate_batch(inputs=prompts, generation_config=config)
            return sum(len(o.generated_tokens) for o in out.values())
        try:
            continuous()
            rows.append((f"model.generate_batch (continuous), {n}", *timed(continuous)))
        except Exception as error:  # report, don't hide: the table says why this row is missing
            print(f"generate_batch unusable here: {type(error).__name__}: {error}")
    else:
        print("generate_batch: not in this transformers version")

    print(f"\n{'method':<44} {'seconds':>8} {'tokens':>7} {'tokens/s':>9} {'vs batch 1':>10}")
    base = rows[0][2] / rows[0][1]
    for name, seconds, tokens in rows:
        rate = tokens / seconds
        print(f"{name:<44} {seconds:>8.2f} {tokens:>7d} {rate:>9.0f} {rate / base:>9.1f}x")
    asyncio.run(engine.close())


if __name__ == "__main__":
    main()
