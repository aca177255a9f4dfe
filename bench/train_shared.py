"""Prefix sharing in the actor (`train.share_prefixes`): one optimizer step shared vs unshared, alternating in
one process, at the seed's training shape and at the official MemAgent one, both prompt layouts.

    python bench/train.py --share-prefixes                # the full shapes (long on CPU: see bench/README.md)
    python bench/train.py --share-prefixes --quick        # shapes scaled down for a CPU, one question each
    python bench/train.py --share-prefixes --share-model tiny --quick    # a smoke run of the script (~1 min)
    python bench/train.py --share-prefixes --quick --share-model-path models/smollm2-135m   # a trained model

Rows (synthetic ids, MemAgent's layout; one row per turn): per question an instruction head (60 tokens every
question's template shares + a 65-token question), its document's chunks, and n samples whose memories (each
turn's response, 1..memory tokens) differ. A memory turn's prompt is head + memory + chunk + a 20-token tail
(`memagent`) or head + chunk + memory + tail (`chunk_first`); turn 0's memory is the same 4 "No memory yet."
tokens for every sample; the final turn's prompt is a final head (another 60-token instruction + the
question) + memory + tail, its response 1..final tokens. Shapes:
- seed (recipes/qwen3-0.6b-hotpotqa.yaml): n = 8, 3 chunks of 512, memory 128, final 64;
- official (MemAgent's chunk and memory): n = 8, 2 chunks of 5,000, memory 1,024, final 1,024 (two chunks
  only: a CPU step of longer documents takes hours);
`--quick`: one question, chunk, memory and final limits / 4 (seed) and / 8 (official), said in the output.

Both actors (the same random Qwen3 of >= 50M parameters, `--share-model`, float32, KL on: the reference
forward runs too) take the same rows with `train.share_prefixes` on and off, in alternating order
(`--share-repeats` pairs; ratios of the medians). Printed per shape and layout: computed / requested token
positions (the step's `computed_fraction`), the step time ratio unshared / shared (> 1: sharing is faster), and
the ratio of the step's peak memory growth shared / unshared (process RSS sampled during the step after
returning freed heap to the OS; on CUDA the allocator's peak), then one line each:

    train prefix sharing LAYOUT SHAPE: computed/requested R, step S.SSx, peak memory M.MMx
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import gc
import math
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
from train import MODEL_SHAPES, PAD_ID, BenchError, build_model, peak_memory

from memrl.config import AlgorithmConfig, Config, SamplingConfig, TrainConfig
from memrl.train.actor import Actor
from memrl.types import TrainRow

# A random Qwen3 where matrix work dominates (55.6M parameters: 12 layers of hidden 512, a 16,384-token vocabulary).
SHARE_MODELS = {"qwen3-55m": dict(vocab_size=16384, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=64),
                "tiny": MODEL_SHAPES["tiny"]}
INSTRUCTION_TOKENS, QUESTION_TOKENS, TAIL_TOKENS, EMPTY_MEMORY_TOKENS = 60, 65, 20, 4
LAYOUTS = ("memagent", "chunk_first")


@dataclass(frozen=True)
class Shape:
    questions: int
    n: int
    chunks: int
    chunk_tokens: int
    memory_tokens: int
    final_tokens: int


SHAPES = {"seed": Shape(1, 8, 3, 512, 128, 64), "official": Shape(1, 8, 2, 5000, 1024, 1024)}
QUICK_SCALE = {"seed": 4, "official": 8}


def shared_rows(shape: Shape, layout: str, vocab: int, seed: int) -> list[TrainRow]:
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    instructions, final_instructions = ids(INSTRUCTION_TOKENS), ids(INSTRUCTION_TOKENS)
    tail, empty = ids(TAIL_TOKENS), ids(EMPTY_MEMORY_TOKENS)
    rows: list[TrainRow] = []
    for q in range(shape.questions):
        question, document = ids(QUESTION_TOKENS), [ids(shape.chunk_tokens) for _ in range(shape.chunks)]
        for s in range(shape.n):
            memory, advantage = empty, rng.gauss(0.0, 1.0)
            for turn in range(shape.chunks + 1):
                if turn < shape.chunks:
                    chunk = document[turn]
                    body = memory + chunk if layout == "memagent" else chunk + memory
                    prompt, limit = instructions + question + body + tail, shape.memory_tokens
                else:
                    prompt, limit = final_instructions + question + memory + tail, shape.final_tokens
                response = ids(rng.randint(1, limit))
                rows.append(TrainRow(tokens=prompt + response, response_length=len(response),
                                     loss_mask=[1] * len(response),
                                     rollout_log_probs=[-rng.uniform(0.5, 6.0) for _ in response], advantage=advantage,
                                     group_id=f"q{q}", trajectory_id=f"q{q}:s{s}", turn_index=turn, rollout_id=0))
                memory = response
    return rows


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def release_freed_memory() -> None:
    """Freed tensors back to the OS (glibc keeps freed heap mapped), so each step's RSS growth is its own."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@dataclass
class Step:
    seconds: float
    growth_mb: float
    metrics: dict[str, float]


def run_step(actor: Actor, rows: list[TrainRow], device: torch.device) -> Step:
    release_freed_memory()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with peak_memory(device) as peak:
        start = time.perf_counter()
        metrics = actor.train_rollout(rows, rollout_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    growth = peak.cuda_mb if device.type == "cuda" else peak.rss_mb - peak.rss_start_mb
    return Step(seconds, growth, metrics)


def share_prefixes_bench(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    unknown = sorted(set(args.share_shapes.split(",")) - SHAPES.keys())
    if unknown or args.share_repeats < 1:
        raise BenchError(f"--share-shapes takes {', '.join(SHAPES)} (got {', '.join(unknown)}) and --share-repeats "
                         f"must be >= 1" if unknown else "--share-repeats must be >= 1")
    shapes = {name: SHAPES[name] for name in args.share_shapes.split(",")}
    if args.quick:
        shapes = {name: replace(s, questions=1, chunk_tokens=s.chunk_tokens // QUICK_SCALE[name],
                                memory_tokens=s.memory_tokens // QUICK_SCALE[name],
                                final_tokens=s.final_tokens // QUICK_SCALE[name]) for name, s in shapes.items()}
    if args.share_model_path:  # a Hugging Face folder (e.g. SmolLM2-135M from `memrl import-gguf`)
        from transformers import AutoModelForCausalLM

        base, name = AutoModelForCausalLM.from_pretrained(args.share_model_path).float().to(device), \
            args.share_model_path
    else:
        MODEL_SHAPES.setdefault(args.share_model, SHARE_MODELS[args.share_model])
        base, name = build_model(args.share_model, device, args.seed), f"random Qwen3 {args.share_model}"
    vocab = base.config.vocab_size
    params = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"model: {name}, {params:.1f}M parameters, {device}"
          f"{', bf16 autocast' if device.type == 'cuda' else ', float32'}, torch threads {torch.get_num_threads()}; "
          f"KL on (reference forward), micro_batch_tokens {args.share_budget}, packing {args.packing}")
    actors = {}
    for share in (True, False):
        cfg = Config(sampling=SamplingConfig(temperature=1.0), algorithm=AlgorithmConfig(kl_coef=0.001),
                     train=TrainConfig(micro_batch_tokens=args.share_budget, lr=1e-6, packing=args.packing,
                                       share_prefixes=share))
        actors[share] = Actor(copy.deepcopy(base), cfg, pad_token_id=PAD_ID, device=device)
    del base
    lines = []
    for shape_name, shape in shapes.items():
        for layout in LAYOUTS:
            rows = shared_rows(shape, layout, vocab, args.seed)
            warm = [r for r in rows if r.turn_index == shape.chunks]  # the short final turns: AdamW state, kernels
            for actor in actors.values():
                actor.train_rollout(warm, rollout_id=0)
            steps: dict[bool, list[Step]] = {True: [], False: []}
            for repeat in range(args.share_repeats):
                for share in (True, False) if repeat % 2 == 0 else (False, True):
                    steps[share].append(run_step(actors[share], rows, device))
            requested = sum(len(r.tokens) for r in rows)
            scaled = f" (scaled: chunk {shape.chunk_tokens}, memory {shape.memory_tokens}, final " \
                     f"{shape.final_tokens})" if args.quick else ""
            print(f"\n{shape_name} {layout}{scaled}: {len(rows)} rows ({shape.questions} question x n = {shape.n}, "
                  f"{shape.chunks} chunks), {requested} tokens requested")
            print(f"{'sharing':<8} {'seconds':>8} {'growth_MB':>10} {'computed':>9} {'micro_batches':>13}")
            for share in (True, False):
                for step in steps[share]:
                    print(f"{'on' if share else 'off':<8} {step.seconds:>8.2f} {step.growth_mb:>10.0f} "
                          f"{step.metrics['computed_fraction']:>9.3f} {step.metrics['micro_batches']:>13.0f}")
            seconds = {s: statistics.median(x.seconds for x in steps[s]) for s in steps}
            growth = {s: statistics.median(x.growth_mb for x in steps[s]) for s in steps}
            memory = growth[True] / growth[False] if growth[False] > 0 else math.nan
            fraction = steps[True][0].metrics["computed_fraction"]
            lines.append(f"train prefix sharing {layout} {shape_name}: computed/requested {fraction:.2f}, "
                         f"step {seconds[False] / seconds[True]:.2f}x, peak memory {memory:.2f}x")
            print(lines[-1])
    print("\n" + "\n".join(lines))
