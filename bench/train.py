"""Actor training throughput side by side in one run: token-budget micro-batches vs naive padded batches;
and (`--logprob-memory`) the peak memory of one micro-batch's log-prob and loss computation, before vs after.

    python bench/train.py                 # 0.85M-parameter random Qwen3 on CPU, about 2 minutes
                                          # on a shared 2-core machine
    python bench/train.py --quick
    python bench/train.py --device cuda --model-shape qwen3-0.6b     # random-init Qwen3-0.6B shape, bf16 autocast
    python bench/train.py --lora-vs-full 16   # instead: the actor with LoRA rank 16 vs full fine-tuning
                                              # (`lora_vs_full`)
    python bench/train.py --logprob-memory [--profile]               # real 151,936-token vocabulary, ~4 GB of RAM
    python bench/train.py --share-prefixes [--quick]   # instead: train.share_prefixes on vs off (bench/train_shared.py)

`--logprob-memory`: one micro-batch (`--logprob-rows` 4 memory-turn rows, ~800 response tokens) through
`Actor.train_rollout` (forward, PPO + KL loss, backward, AdamW) on a random Qwen3 with Qwen3's vocabulary
and a small body (hidden 64, 2 layers), each variant in a fresh subprocess so its peak RSS
(`ru_maxrss`) is its own: `before` is the former path (`train.logprob_chunk_tokens` unset: the whole
[tokens x vocab] float32 logits kept for the backward), then the chunked, recomputed path at several chunk
sizes, padded and packed. Printed: peak RSS growth over the process before the step, tokens/s (median of
the repeats), and both as ratios to `before`. `--profile` also prints a torch.profiler table of one step of
`before` and of the default.

Both variants run one optimizer step (AdamW, grad clipping) over the same MemAgent-shaped rows, from
the same initial weights:
- measured: `memrl.train.actor.Actor.train_rollout` (rows sorted by length into micro-batches of at most
  `--micro-batch-tokens` padded tokens; only response positions go through the LM head; KL off, so no
  reference forward: the comparison is about batching, not the loss);
- naive: a plain loop in this file: fixed batches of `--batch-size` rows in arrival order, right-padded
  to the batch's longest row, the LM head over every position (full-sequence logits), then the
  response tokens' log-probs picked out for a policy-gradient loss.
By default the token budget is `--batch-size` x the longest row, so both hold at most the same number
of padded tokens per forward.

MemAgent-shaped rows (docs/design.md §1, one row per turn): for each question, documents of 1..max_chunks chunks,
`--samples` trajectories; a memory turn's prompt is the template (~60 tokens) + previous memory +
a chunk, its response 1..memory_tokens; the final turn's prompt is the template + memory, its response
1..final_tokens. So prompts are most of every row, and rows arrive trajectory by trajectory (long
memory rows, then a short final row). Printed: real tokens/s both ways and their ratio, the share of
processed tokens that are padding, and peak memory (process RSS sampled during each variant; on CUDA
also torch.cuda.max_memory_allocated). The machine may be shared: read the per-repeat figures.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import AlgorithmConfig, Config, SamplingConfig, TrainConfig
from memrl.memagent.settings import MemAgentSettings
from memrl.train.actor import Actor
from memrl.types import TrainRow

# Qwen3-0.6B's architecture (config.json of Qwen/Qwen3-0.6B), random init: no download.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
}
# Row shape per model: (chunk_tokens, memory_tokens, final_tokens), MemAgent's 5000/1024 scaled down.
ROW_SHAPES: dict[str, tuple[int, int, int]] = {"tiny": (256, 64, 16), "qwen3-0.6b": (1024, 256, 64)}
MEMORY_TEMPLATE_TOKENS = 60  # chat template + instructions + question of a memory turn (tiny tokenizer)
FINAL_TEMPLATE_TOKENS = 45
PAD_ID = 0


class BenchError(ValueError):
    """Bench arguments that cannot work; the message says which to change."""


def build_model(shape: str, device: torch.device, seed: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(**MODEL_SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=32768,
                         bos_token_id=None, eos_token_id=None, pad_token_id=PAD_ID)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config).float()


def memagent_rows(questions: int, samples: int, max_chunks: int, chunk_tokens: int, memory_tokens: int,
                  final_tokens: int, vocab: int, seed: int) -> list[TrainRow]:
    """Rows in arrival order (trajectory by trajectory, turn by turn); the samples of a question share
    its document, so a group's trajectories have the same turn count (as `validate_groups` requires)."""
    rng = random.Random(seed)
    rows: list[TrainRow] = []

    def row(prompt_len: int, response_len: int, group: str, traj: str, turn: int, advantage: float) -> TrainRow:
        tokens = [rng.randrange(1, vocab) for _ in range(prompt_len + response_len)]
        return TrainRow(tokens=tokens, response_length=response_len, loss_mask=[1] * response_len,
                        rollout_log_probs=[-rng.uniform(0.5, 6.0) for _ in range(response_len)],
                        advantage=advantage, group_id=group, trajectory_id=traj, turn_index=turn, rollout_id=0)

    for q in range(questions):
        n_chunks = 1 + q % max_chunks
        chunks = [chunk_tokens] * (n_chunks - 1) + [rng.randint(chunk_tokens // 2, chunk_tokens)]
        for s in range(samples):
            advantage, memory, traj = rng.gauss(0.0, 1.0), 4, f"q{q}:s{s}"  # 4 = "No memory yet."
            for i, chunk in enumerate(chunks):
                response = rng.randint(1, memory_tokens)
                rows.append(row(MEMORY_TEMPLATE_TOKENS + memory + chunk, response, f"q{q}", traj, i, advantage))
                memory = response
            rows.append(row(FINAL_TEMPLATE_TOKENS + memory, rng.randint(1, final_tokens), f"q{q}", traj,
                            len(chunks), advantage))
    return rows


def naive_batches(rows: list[TrainRow], batch_size: int) -> list[list[TrainRow]]:
    return [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]


def padding_fraction(batches: list[list[TrainRow]]) -> float:
    real = sum(len(r.tokens) for b in batches for r in b)
    return 1.0 - real / sum(len(b) * max(len(r.tokens) for r in b) for b in batches)


def naive_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: list[TrainRow],
                     batch_size: int, device: torch.device) -> None:
    """One optimizer step the plain way: padded fixed batches, full-sequence logits, token-mean PG loss."""
    total_loss_tokens = sum(sum(r.loss_mask) for r in rows)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else None
    optimizer.zero_grad(set_to_none=True)
    for batch in naive_batches(rows, batch_size):
        width = max(len(r.tokens) for r in batch)
        ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width - 1))
        for b, r in enumerate(batch):
            ids[b, :len(r.tokens)], attention[b, :len(r.tokens)] = torch.tensor(r.tokens), 1
            mask[b, r.prompt_length - 1:len(r.tokens) - 1] = torch.tensor(r.loss_mask, dtype=torch.float)
        ids, attention, mask = ids.to(device), attention.to(device), mask.to(device)
        advantages = torch.tensor([r.advantage for r in batch], device=device)
        with autocast if autocast is not None else contextlib.nullcontext():
            logits = model(input_ids=ids, attention_mask=attention).logits  # [B, L, V]: every position
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(log_probs * advantages[:, None] * mask).sum() / total_loss_tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


@dataclass
class Peak:
    rss_mb: float = 0.0
    rss_start_mb: float = 0.0
    cuda_mb: float = float("nan")


@contextmanager
def peak_memory(device: torch.device, interval_s: float = 0.005) -> Iterator[Peak]:
    """Peak process RSS sampled every `interval_s` while the block runs (and CUDA's allocator peak)."""
    process, peak, done = psutil.Process(), Peak(), threading.Event()
    peak.rss_start_mb = peak.rss_mb = process.memory_info().rss / 2**20

    def sample() -> None:
        while not done.wait(interval_s):
            peak.rss_mb = max(peak.rss_mb, process.memory_info().rss / 2**20)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        peak.rss_mb = max(peak.rss_mb, process.memory_info().rss / 2**20)
        if device.type == "cuda":
            peak.cuda_mb = torch.cuda.max_memory_allocated(device) / 2**20


@dataclass
class Run:
    variant: str
    seconds: float
    padding: float
    peak: Peak
    micro_batches: int


def timed(device: torch.device, fn: Callable[[], tuple[float, int]]) -> tuple[float, float, int, Peak]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
    with peak_memory(device) as peak:
        start = time.perf_counter()
        padding, n_batches = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return seconds, padding, n_batches, peak


def state_mb(actor: Actor) -> dict[str, float]:
    """Resident training state of an actor, counted exactly from its tensors (MB): the policy's weights,
    the gradients and AdamW moments of what it trains, and a reference copy if it keeps one."""
    def mb(tensors: Iterator[torch.Tensor]) -> float:
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    trained = [p for group in actor.optimizer.param_groups for p in group["params"]]
    moments = (v for state in actor.optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"weights": mb(actor.model.parameters()), "grads": mb(p for p in trained if p.grad is not None),
            "adam": mb(moments), "reference": mb(actor.ref_model.parameters()) if actor.ref_model is not None else 0.0,
            "trained_params_m": sum(p.numel() for p in trained) / 1e6}


def lora_vs_full(args: argparse.Namespace, rows: list[TrainRow], cfg: Config, base: torch.nn.Module,
                 device: torch.device) -> None:
    """One optimizer step over the same rows, full fine-tuning vs LoRA of rank `args.lora_vs_full`, KL on
    for both (so full keeps its reference copy; LoRA's reference is the base with adapters off): tokens/s,
    peak memory per step (process RSS growth; CUDA allocator peak), and the resident state counted."""
    from memrl.config import LoraConfig

    kl = cfg.algorithm.model_copy(update={"kl_coef": 0.001})
    variants = {"full": cfg.model_copy(update={"algorithm": kl}),
                "lora": cfg.model_copy(update={"algorithm": kl, "model": cfg.model.model_copy(
                    update={"lora": LoraConfig(rank=args.lora_vs_full)})})}
    actors = {name: Actor(copy.deepcopy(base), c, pad_token_id=PAD_ID, device=device) for name, c in variants.items()}
    del base
    for actor in actors.values():  # warm-up: first-call allocations, AdamW state created
        actor.train_rollout([r for r in rows if r.group_id == rows[0].group_id], rollout_id=0)
    real_tokens = sum(len(r.tokens) for r in rows)
    def step(actor: Actor) -> Callable[[], tuple[float, int]]:
        def run() -> tuple[float, int]:
            metrics = actor.train_rollout(rows, rollout_id=0)
            return metrics["padding_fraction"], int(metrics["micro_batches"])
        return run

    runs: list[tuple[str, float, Peak]] = []
    for repeat in range(args.repeats):
        for name in ("full", "lora") if repeat % 2 == 0 else ("lora", "full"):
            seconds, _, _, peak = timed(device, step(actors[name]))
            runs.append((name, seconds, peak))
    print(f"\n{'variant':<8} {'seconds':>8} {'tokens/s':>9} {'rss_growth_MB':>14} {'cuda_peak_MB':>13}")
    for name, seconds, peak in runs:
        cuda = "n/a" if math.isnan(peak.cuda_mb) else f"{peak.cuda_mb:.0f}"
        print(f"{name:<8} {seconds:>8.2f} {real_tokens / seconds:>9.0f} {peak.rss_mb - peak.rss_start_mb:>14.0f} "
              f"{cuda:>13}")
    print(f"\n{'variant':<8} {'trained_M':>9} {'weights_MB':>10} {'grads_MB':>9} {'adam_MB':>8} {'reference_MB':>12} "
          f"{'state_MB':>9}")
    state = {name: state_mb(actor) for name, actor in actors.items()}
    for name, st in state.items():
        total = st["weights"] + st["grads"] + st["adam"] + st["reference"]
        print(f"{name:<8} {st['trained_params_m']:>9.3f} {st['weights']:>10.1f} {st['grads']:>9.1f} {st['adam']:>8.1f} "
              f"{st['reference']:>12.1f} {total:>9.1f}")
    best = {v: min(s for n, s, _ in runs if n == v) for v in ("full", "lora")}
    totals = {n: st["weights"] + st["grads"] + st["adam"] + st["reference"] for n, st in state.items()}
    print(f"\nlora vs full: {best['full'] / best['lora']:.2f}x tokens/s (best of {args.repeats}); resident training "
          f"state {totals['lora']:.1f} MB vs {totals['full']:.1f} MB ({totals['lora'] / totals['full']:.2f}x)")


LOGPROB_SHAPE = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32)
# (name, train.logprob_chunk_tokens, train.packing); None = the former whole-[tokens x vocab] path
LOGPROB_VARIANTS: list[tuple[str, int | None, bool]] = [
    ("before", None, False), ("chunk1024", 1024, False), ("chunk512", 512, False), ("chunk256", 256, False),
    ("chunk512+packed", 512, True)]


def logprob_rows(seed: int, n_rows: int) -> list[TrainRow]:
    """One micro-batch of memory-turn rows: prompts of 300-500 tokens, responses of 128-256."""
    rng = random.Random(seed)
    rows = []
    for k in range(n_rows):
        p, r = rng.randint(300, 500), rng.randint(128, 256)
        rows.append(TrainRow(tokens=[rng.randrange(1, LOGPROB_SHAPE["vocab_size"]) for _ in range(p + r)],
                             response_length=r, loss_mask=[1] * r,
                             rollout_log_probs=[-rng.uniform(0.5, 6.0) for _ in range(r)],
                             advantage=rng.gauss(0.0, 1.0), group_id="q0", trajectory_id=f"q0:s{k}", turn_index=0,
                             rollout_id=0))
    return rows


def logprob_child(variant: str, repeats: int, profile: bool, seed: int, n_rows: int) -> None:
    """One variant in this (fresh) process; prints one JSON line."""
    _, chunk, packed = next(v for v in LOGPROB_VARIANTS if v[0] == variant)
    config = Qwen3Config(**LOGPROB_SHAPE, tie_word_embeddings=True, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    cfg = Config(algorithm=AlgorithmConfig(kl_coef=0.01),
                 train=TrainConfig(micro_batch_tokens=1 << 20, lr=1e-6, logprob_chunk_tokens=chunk, packing=packed))
    actor = Actor(model, cfg, pad_token_id=PAD_ID, device=torch.device("cpu"))
    rows = logprob_rows(seed, n_rows)
    gc.collect()
    rss_before = psutil.Process().memory_info().rss / 2**20
    times = []
    for k in range(repeats):
        start = time.perf_counter()
        if profile and k == 0:
            with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                metrics = actor.train_rollout(rows, rollout_id=0)
        else:
            metrics = actor.train_rollout(rows, rollout_id=0)
        times.append(time.perf_counter() - start)
        if k == 0:  # the first step's peak, before any profiler or timing noise could add to it
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = sum(len(r.tokens) for r in rows)
    print(json.dumps({"variant": variant, "rss_before_mb": rss_before, "peak_rss_mb": peak,
                      "growth_mb": peak - rss_before, "seconds": times, "tokens": tokens,
                      "response_tokens": sum(r.response_length for r in rows),
                      "micro_batches": metrics["micro_batches"], "loss": metrics["loss/total"]}))
    if profile:
        print(f"PROFILE {variant}")
        print(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=12, max_name_column_width=40))


def logprob_memory(args: argparse.Namespace) -> None:
    """Every variant in its own subprocess (a process's peak RSS never goes down), then the ratios."""
    results = []
    for name, *_ in LOGPROB_VARIANTS:
        profile = args.profile and name in ("before", "chunk512")
        out = subprocess.run([sys.executable, __file__, "--logprob-child", name, "--repeats", str(args.repeats),
                              "--seed", str(args.seed), "--threads", str(args.threads), "--logprob-rows",
                              str(args.logprob_rows), *(["--profile"] if profile else [])],
                             capture_output=True, text=True, timeout=1800, check=False)
        if out.returncode != 0:
            raise BenchError(f"variant {name} failed:\n{out.stderr[-3000:]}")
        lines = out.stdout.splitlines()
        results.append(json.loads(lines[0]))
        if profile:
            print("\n".join(lines[1:]))
    first = results[0]
    print(f"one micro-batch: {first['tokens']} tokens, {first['response_tokens']} response tokens, vocab "
          f"{LOGPROB_SHAPE['vocab_size']}, hidden {LOGPROB_SHAPE['hidden_size']}, float32 CPU, torch threads "
          f"{args.threads}; one fp32 [response x vocab] copy = "
          f"{first['response_tokens'] * LOGPROB_SHAPE['vocab_size'] * 4 / 2**20:.0f} MB")
    print(f"\n{'variant':<16} {'chunk':>6} {'packed':>6} {'peak_rss_MB':>11} {'growth_MB':>10} {'less_memory':>11} "
          f"{'tokens/s':>9} {'speed':>6} {'loss':>12}  per-repeat seconds")
    base_tps = first["tokens"] / statistics.median(first["seconds"])
    for r, (name, chunk, packed) in zip(results, LOGPROB_VARIANTS, strict=True):
        tps = r["tokens"] / statistics.median(r["seconds"])
        print(f"{name:<16} {chunk or '-':>6} {packed!s:>6} {r['peak_rss_mb']:>11.0f} {r['growth_mb']:>10.0f} "
              f"{first['growth_mb'] / r['growth_mb']:>10.2f}x {tps:>9.0f} {tps / base_tps:>5.2f}x {r['loss']:>12.8f}  "
              + " ".join(f"{t:.2f}" for t in r["seconds"]))
    default = TrainConfig().logprob_chunk_tokens
    after = next(r for r, v in zip(results, LOGPROB_VARIANTS, strict=True) if v[1] == default and not v[2])
    print(f"\ndefault (train.logprob_chunk_tokens={default}) vs before: "
          f"{first['growth_mb'] / after['growth_mb']:.2f}x less peak memory growth (goal >= 4x), "
          f"{statistics.median(first['seconds']) / statistics.median(after['seconds']):.2f}x tokens/s (goal >= 1)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="half the questions, 1 repeat")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="tiny")
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, help="default: 256 (tiny) / 1024 (qwen3-0.6b)")
    parser.add_argument("--memory-tokens", type=int, help="default: 64 (tiny) / 256 (qwen3-0.6b)")
    parser.add_argument("--final-tokens", type=int, help="default: 16 (tiny) / 64 (qwen3-0.6b)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per naive batch")
    parser.add_argument("--micro-batch-tokens", type=int, help="default: batch size x longest row")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved naive/measured pairs")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 by default (2 threads on a shared 2-core machine spin-wait)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-vs-full", type=int, metavar="RANK",
                        help="compare the actor with LoRA of this rank (KL on: its reference is the base with "
                             "adapters off) to full fine-tuning (KL on: a reference copy)")
    parser.add_argument("--logprob-memory", action="store_true",
                        help="peak memory of one micro-batch's log-prob + loss step, before vs after (see above)")
    parser.add_argument("--profile", action="store_true", help="with --logprob-memory: torch.profiler tables")
    parser.add_argument("--logprob-rows", type=int, default=4,
                        help="with --logprob-memory: rows in the micro-batch (4: ~800 response tokens, `before` ~4 GB)")
    parser.add_argument("--logprob-child", help=argparse.SUPPRESS)
    parser.add_argument("--share-prefixes", action="store_true",
                        help="train.share_prefixes on vs off, seed and official shapes (bench/train_shared.py)")
    parser.add_argument("--share-model", choices=["qwen3-55m", "tiny"], default="qwen3-55m",
                        help="with --share-prefixes: the random Qwen3 (tiny: a smoke run, no figure to report)")
    parser.add_argument("--share-model-path", help="with --share-prefixes: a Hugging Face folder instead (e.g. "
                        "SmolLM2-135M imported by `memrl import-gguf`, docs/real-model.md)")
    parser.add_argument("--share-shapes", default="seed,official", help="with --share-prefixes: shapes to run")
    parser.add_argument("--share-budget", type=int, default=TrainConfig().micro_batch_tokens,
                        help="with --share-prefixes: train.micro_batch_tokens")
    parser.add_argument("--share-repeats", type=int, default=1, help="with --share-prefixes: shared/unshared pairs")
    parser.add_argument("--packing", action="store_true", help="with --share-prefixes: train.packing on for both")
    args = parser.parse_args()
    chunk, memory, final = ROW_SHAPES[args.model_shape]
    args.chunk_tokens = args.chunk_tokens or chunk
    args.memory_tokens = args.memory_tokens or memory
    args.final_tokens = args.final_tokens or final
    if args.quick:
        args.questions, args.repeats = max(args.max_chunks, args.questions // 2), 1
    if min(args.questions, args.samples, args.max_chunks, args.batch_size, args.repeats) <= 0:
        raise BenchError("--questions, --samples, --max-chunks, --batch-size and --repeats must all be > 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA device; use --device cpu")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.logprob_child:
        return logprob_child(args.logprob_child, args.repeats, args.profile, args.seed, args.logprob_rows)
    if args.logprob_memory:
        return logprob_memory(args)
    if args.share_prefixes:
        from train_shared import share_prefixes_bench  # bench/ is on the path when run as `python bench/train.py`

        return share_prefixes_bench(args)
    device = torch.device(args.device)
    vocab = MODEL_SHAPES[args.model_shape]["vocab_size"]
    rows = memagent_rows(args.questions, args.samples, args.max_chunks, args.chunk_tokens, args.memory_tokens,
                         args.final_tokens, vocab, args.seed)
    longest = max(len(r.tokens) for r in rows)
    budget = args.micro_batch_tokens or args.batch_size * longest
    real_tokens = sum(len(r.tokens) for r in rows)
    prompt_share = sum(r.prompt_length for r in rows) / real_tokens
    cfg = Config(task=MemAgentSettings(max_chunks=args.max_chunks), sampling=SamplingConfig(temperature=1.0),
                 algorithm=AlgorithmConfig(kl_coef=0.0),
                 train=TrainConfig(micro_batch_tokens=budget, lr=1e-6, num_optimizer_steps=1))
    base = build_model(args.model_shape, device, args.seed)
    params = sum(p.numel() for p in base.parameters()) / 1e6
    print(f"model: {args.model_shape}, {params:.2f}M parameters, {device}"
          f"{', bf16 autocast' if device.type == 'cuda' else ', float32'}, torch threads {torch.get_num_threads()}")
    print(f"rows: {len(rows)} ({args.questions} questions x {args.samples} samples, 1..{args.max_chunks} chunks), "
          f"{real_tokens} tokens, lengths {min(len(r.tokens) for r in rows)}..{longest}, prompts "
          f"{prompt_share:.0%} of tokens; naive batch {args.batch_size} rows, token budget {budget}")
    if args.lora_vs_full:
        lora_vs_full(args, rows, cfg, base, device)
        return

    naive_model = copy.deepcopy(base).train()
    naive_opt = torch.optim.AdamW(naive_model.parameters(), lr=1e-6)
    actor = Actor(copy.deepcopy(base), cfg, pad_token_id=PAD_ID, device=device)
    del base

    def naive() -> tuple[float, int]:
        naive_train_step(naive_model, naive_opt, rows, args.batch_size, device)
        return padding_fraction(naive_batches(rows, args.batch_size)), len(naive_batches(rows, args.batch_size))

    def measured() -> tuple[float, int]:
        metrics = actor.train_rollout(rows, rollout_id=0)
        return metrics["padding_fraction"], int(metrics["micro_batches"])

    warm = rows[: 2 * args.batch_size]  # first-call allocations and kernel selection, outside the timing
    naive_train_step(naive_model, naive_opt, warm, args.batch_size, device)
    actor.train_rollout([r for r in rows if r.group_id == rows[0].group_id], rollout_id=0)

    runs: list[Run] = []
    for repeat in range(args.repeats):
        order = [("naive", naive), ("measured", measured)]
        for name, fn in order if repeat % 2 == 0 else order[::-1]:
            seconds, padding, n_batches, peak = timed(device, fn)
            runs.append(Run(name, seconds, padding, peak, n_batches))

    print(f"\n{'variant':<9} {'seconds':>8} {'tokens/s':>9} {'batches':>8} {'padding':>8} {'peak_rss_MB':>12} "
          f"{'rss_growth_MB':>14} {'cuda_peak_MB':>13}")
    for r in runs:
        cuda = "n/a" if math.isnan(r.peak.cuda_mb) else f"{r.peak.cuda_mb:.0f}"
        print(f"{r.variant:<9} {r.seconds:>8.2f} {real_tokens / r.seconds:>9.0f} {r.micro_batches:>8d} "
              f"{r.padding:>8.1%} {r.peak.rss_mb:>12.0f} {r.peak.rss_mb - r.peak.rss_start_mb:>14.0f} {cuda:>13}")
    best = {v: min(r.seconds for r in runs if r.variant == v) for v in ("naive", "measured")}
    median = {v: statistics.median(r.seconds for r in runs if r.variant == v) for v in ("naive", "measured")}
    padding = {r.variant: r.padding for r in runs}
    print(f"\nmeasured vs naive: {best['naive'] / best['measured']:.2f}x tokens/s (best), "
          f"{median['naive'] / median['measured']:.2f}x (median); padding {padding['measured']:.1%} vs "
          f"{padding['naive']:.1%} of processed tokens (goal <= 10%); process peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
