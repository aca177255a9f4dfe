"""MemAgent rollout schedules side by side in one run: async per-trajectory loop vs lockstep turns.

    python bench/rollout.py              # tiny 0.85M-parameter Qwen3 on CPU, about 2 minutes on 2 cores
    python bench/rollout.py --quick      # one repeat, fewer questions (well under a minute)
    python bench/rollout.py --device cuda --questions 64 --samples 8

What it prints, all from this one process and the same engine:
1. wall time and generated tokens/s of `MemAgentTask.generate` (one coroutine per trajectory; memrl's
   schedule) vs `bench/lockstep.py` (every active trajectory advances one turn per engine call, final
   turns after the longest document: the official MemAgent sync path), repeated and interleaved;
2. the engine's batching: the same 16 (`--concurrency`) requests sent concurrently vs one at a time;
3. the share of wall time spent outside the engine, two ways: (a) no `generate` call in flight at all;
   (b) the engine's worker not computing a batch (includes prompt building, event-loop hand-offs and
   queue waits between batches: the stricter figure).

Workload: documents of 1..`--max-chunks` chunks (equal shares), `--samples` trajectories per question,
a random-init tiny model sampling at temperature 1.0. A random model samples a stop token about once
per vocabulary-size tokens, so every memory would run to its cap; a bias on the stop-token logits makes
response lengths geometric with mean `--mean-response` (varied memory lengths, as a trained model has).
Both schedules use the same prompts, caps and per-request seeds, so they sample (nearly) the same
tokens; the table shows both token counts so a divergence is visible. The machine may be shared: read
the per-repeat ratios for noise.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python bench/rollout.py` finds lockstep.py

from lockstep import generate_rollout_lockstep  # noqa: E402

from memrl.config import Config, EngineConfig, SamplingConfig  # noqa: E402
from memrl.engines.base import GenerationRequest, GenerationResult  # noqa: E402
from memrl.engines.hf import HFEngine, resolve_device_dtype  # noqa: E402
from memrl.memagent.chunking import tokenize_document  # noqa: E402
from memrl.memagent.rollout import builder_of, document_chunks  # noqa: E402
from memrl.memagent.settings import MemAgentSettings  # noqa: E402
from memrl.memagent.task import MemAgentTask  # noqa: E402
from memrl.rollout import RolloutContext  # noqa: E402
from memrl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from memrl.types import RolloutOutput  # noqa: E402

_WORDS = ("the city river film band album capital founded born released written directed played won "
          "team season museum bridge north south first second year century war island church school "
          "Paris London Liverpool France England 1960 1999 2004 January March of and in to was is by").split()


@dataclass
class Record:
    id: str
    question: str
    answers: list[str]
    context: str


class BenchError(ValueError):
    """Bench arguments that cannot work; the message says which to change."""


class TimedHFEngine(HFEngine):
    """HFEngine that also records wall time with at least one `generate` call in flight; what the engine
    computed (prefills, decode steps, rows per step, compute time) comes from its own `stats`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reset_meters()

    def reset_meters(self) -> None:
        self.in_flight = 0
        self.busy_since = 0.0
        self.busy_s = 0.0
        self.reset_stats()

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        # Calls overlap: count wall time only on 0 -> 1 and 1 -> 0 transitions of the in-flight count.
        if self.in_flight == 0:
            self.busy_since = time.perf_counter()
        self.in_flight += 1
        try:
            return await super().generate(requests)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_s += time.perf_counter() - self.busy_since


@dataclass
class Measurement:
    schedule: str
    wall_s: float
    compute_s: float
    tokens: int
    turns: int
    no_call_share: float
    engine_idle_share: float
    batches: int
    mean_batch: float
    decode_steps: int
    prefill_tokens: int
    turn_lengths: list[tuple[int, int, int]] = field(default_factory=list)  # (trajectory #, turn, length)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def make_records(tokenizer, cfg: MemAgentSettings, questions: int, seed: int) -> list[Record]:
    """Documents of exactly k = 1..max_chunks chunks (equal shares of each k), the last one half to all full."""
    rng = random.Random(seed)
    records = []
    for q in range(questions):
        want_chunks = 1 + q % cfg.max_chunks
        target = (want_chunks - 1) * cfg.chunk_tokens + rng.randint(cfg.chunk_tokens // 2, cfg.chunk_tokens)
        words: list[str] = []
        while len(tokenize_document(tokenizer, " ".join(words))) < target:
            words.extend(rng.choices(_WORDS, k=4))
        while len(tokenize_document(tokenizer, " ".join(words))) > want_chunks * cfg.chunk_tokens:
            words.pop()  # overshot into the next chunk by a few words
        question = f"Which {rng.choice(_WORDS)} was {rng.choice(_WORDS)} in {rng.choice(_WORDS)}?"
        records.append(Record(id=f"q{q}", question=question, answers=["Paris"], context=" ".join(words)))
    return records


def bias_stop_logits(model: torch.nn.Module, stop_ids: Sequence[int], mean_length: float) -> float:
    """Add a bias to the LM head's stop-token logits so a stop token comes once per ~`mean_length` tokens.

    A random init gives near-uniform logits (std ~0.2), so P(stop) = n e^b / (V - n + n e^b); solving for
    P = 1 / mean_length gives b. Returns b. The bias is part of the model, so log-probs stay exact.
    """
    head = model.get_output_embeddings()
    vocab, n = head.weight.shape[0], len(stop_ids)
    p = 1.0 / max(mean_length, 1.0 + 1e-6)
    b = math.log(p * (vocab - n) / (n * (1.0 - p)))
    bias = torch.zeros(vocab, dtype=head.weight.dtype, device=head.weight.device)
    bias[list(stop_ids)] = b
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return b


def measure(schedule: str, output: RolloutOutput, wall: float, engine: TimedHFEngine) -> Measurement:
    if output.dropped:
        raise BenchError(f"{schedule}: {len(output.dropped)} trajectories failed, e.g. {output.dropped[0].error}")
    turns = [t for tr in output.trajectories for t in tr.turns]
    stats = engine.stats
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return Measurement(schedule, wall, stats.compute_s, sum(t.response_length for t in turns), len(turns),
                       max(0.0, 1.0 - engine.busy_s / wall), max(0.0, 1.0 - stats.compute_s / wall), stats.prefills,
                       stats.mean_decode_batch, stats.decode_steps, stats.prefill_tokens,
                       [(k, t.index, t.response_length) for k, tr in enumerate(output.trajectories) for t in tr.turns])


async def run_schedule(name: str, fn: Callable[[RolloutContext, Sequence[Record]], Awaitable[RolloutOutput]],
                       ctx: RolloutContext, records: Sequence[Record], engine: TimedHFEngine) -> Measurement:
    engine.reset_meters()
    start = time.perf_counter()
    output = await fn(ctx, records)
    return measure(name, output, time.perf_counter() - start, engine)


async def batching(engine: TimedHFEngine, requests: list[GenerationRequest], repeats: int) -> tuple[float, float]:
    """Best tokens/s of the requests sent one at a time (sequential) and all at once, interleaved repeats."""
    async def concurrent() -> int:
        results = await asyncio.gather(*(engine.generate([r]) for r in requests))
        return sum(len(r[0].output_ids) for r in results)

    async def sequential() -> int:
        return sum([len((await engine.generate([r]))[0].output_ids) for r in requests])

    rates: dict[Callable, float] = {sequential: 0.0, concurrent: 0.0}
    for _ in range(repeats):
        for fn in rates:
            start = time.perf_counter()
            tokens = await fn()
            rates[fn] = max(rates[fn], tokens / (time.perf_counter() - start))
    return rates[sequential], rates[concurrent]


def agreement(a: Measurement, b: Measurement) -> float:
    """Share of turns whose response length is the same under both schedules (same seeds -> ~1.0).

    Trajectories are matched by position (both list them question by question, sample by sample)."""
    lengths = {(k, i): n for k, i, n in b.turn_lengths}
    same = sum(lengths.get((k, i)) == n for k, i, n in a.turn_lengths)
    return same / max(len(a.turn_lengths), 1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 repeat, half the questions")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--static-kv", default="auto", choices=["auto", "on", "off"],
                        help="HFEngine static-shape decode (engine.static_kv; auto: on with CUDA)")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                        help="CUDA graph per decode bucket (engine.cuda_graphs; auto: on with CUDA)")
    parser.add_argument("--questions", type=int, default=8, help="questions (documents) per rollout")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per question")
    parser.add_argument("--max-chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=128)
    parser.add_argument("--memory-tokens", type=int, default=64)
    parser.add_argument("--final-tokens", type=int, default=16)
    parser.add_argument("--mean-response", type=float, default=24.0, help="mean sampled response length")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in the batching comparison")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved async/lockstep pairs")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 by default: on a shared 2-core machine 2 threads ran a tiny "
                             "model's decode step up to 70x slower (spin-waiting threads)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.questions = 1, max(args.max_chunks, args.questions // 2)
    if min(args.questions, args.samples, args.repeats, args.concurrency) <= 0:
        raise BenchError("--questions, --samples, --repeats and --concurrency must all be > 0")
    return args


def report_line(m: Measurement) -> str:
    idle = "n/a" if math.isnan(m.engine_idle_share) else f"{m.engine_idle_share:.1%}"
    return (f"{m.schedule:<10} {m.wall_s:>7.2f} {m.compute_s:>7.2f} {m.tokens:>7d} {m.tokens_per_s:>9.0f} "
            f"{m.batches:>8d} {m.mean_batch:>6.1f} {m.decode_steps:>6d} {m.prefill_tokens:>8d} "
            f"{m.no_call_share:>10.1%} {idle:>12}")


async def main_async(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2,
                             intermediate=args.intermediate, seed=args.seed)
    cfg = Config(
        sampling=SamplingConfig(n_samples=args.samples, temperature=1.0, seed=args.seed),
        engine=EngineConfig(max_batch_size=args.max_batch_size),
        task=MemAgentSettings(chunk_tokens=args.chunk_tokens, memory_tokens=args.memory_tokens,
                        final_tokens=args.final_tokens, max_chunks=args.max_chunks))
    engine = TimedHFEngine(model, tokenizer, max_batch_size=args.max_batch_size, device=device, dtype=dtype,
                           static_kv=args.static_kv, cuda_graphs=args.cuda_graphs)
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, progress=False)
    bias = bias_stop_logits(engine.model, builder_of(ctx).stop_token_ids, args.mean_response)
    records = make_records(tokenizer, cfg.task, args.questions, args.seed)
    chunk_counts = [document_chunks(tokenizer, cfg.task, r.context).num_chunks for r in records]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: {params:.2f}M-parameter random Qwen3 ({args.layers} layers, hidden {args.hidden}), {device}, "
          f"{dtype}, torch threads {torch.get_num_threads()}; stop-logit bias {bias:+.2f} "
          f"(mean response ~{args.mean_response:g} tokens)")
    decoder = engine.static_decoder
    print(f"decode path: "
          f"{'dynamic cache' if decoder is None else 'static slots, ' + ('CUDA graphs' if decoder.graphs else 'eager')}"
          f" (--static-kv {args.static_kv}, --cuda-graphs {args.cuda_graphs})")
    print(f"workload: {len(records)} questions x {args.samples} samples = {len(records) * args.samples} "
          f"trajectories; chunks per document {sorted(chunk_counts)}; chunk {args.chunk_tokens} / memory "
          f"{args.memory_tokens} / final {args.final_tokens} tokens; engine max_batch_size {args.max_batch_size}")

    await MemAgentTask().generate(ctx, records[: args.max_chunks])  # warm-up (allocator, kernels, prompt caches)
    pairs: list[tuple[Measurement, Measurement]] = []
    for repeat in range(args.repeats):
        ctx.rollout_id = 1  # same seeds every repeat: identical work, so repeats differ only by noise
        first, second = ("async", "lockstep") if repeat % 2 == 0 else ("lockstep", "async")
        runs = {}
        for name in (first, second):
            fn = MemAgentTask().generate if name == "async" else generate_rollout_lockstep
            runs[name] = await run_schedule(name, fn, ctx, records, engine)
        pairs.append((runs["async"], runs["lockstep"]))

    print(f"\n{'schedule':<10} {'wall_s':>7} {'comp_s':>7} {'tokens':>7} {'tokens/s':>9} {'prefills':>8} "
          f"{'rows/st':>6} {'steps':>6} {'prefill':>8} {'no_call_%':>10} {'engine_idle%':>12}")
    for a, b in pairs:
        print(report_line(a))
        print(report_line(b))
    ratios = [b.wall_s / a.wall_s for a, b in pairs]
    median_async = statistics.median(a.wall_s for a, _ in pairs)
    median_lock = statistics.median(b.wall_s for _, b in pairs)
    best_async, best_lock = min(a.wall_s for a, _ in pairs), min(b.wall_s for _, b in pairs)
    print(f"\nasync vs lockstep: {median_lock / median_async:.2f}x faster (median wall), {best_lock / best_async:.2f}x "
          f"(best wall); per repeat {', '.join(f'{r:.2f}x' for r in ratios)}; same response lengths in "
          f"{agreement(*pairs[0]):.0%} of turns")

    # Batching: the workload's first memory turns, fixed length (no stop) and with the sampled stops.
    prompts = [builder_of(ctx).memory_prompt_ids(r.question, None, document_chunks(tokenizer, cfg.task, r.context)
                                             .chunks[0]) for r in records]
    stop_ids = builder_of(ctx).stop_token_ids
    print(f"\nbatching, {args.concurrency} requests with memory-turn prompts, concurrent vs one at a time "
          f"(best of {min(args.repeats, 2)}):")
    for label, stops in (("fixed length (no stop tokens)", []), ("sampled lengths (stop tokens)", stop_ids)):
        requests = [GenerationRequest(prompts[i % len(prompts)], args.memory_tokens, 1.0, 1.0, stops, seed=i)
                    for i in range(args.concurrency)]
        seq, conc = await batching(engine, requests, min(args.repeats, 2))
        print(f"  {label:<32} batch 1 {seq:>7.0f} tok/s, {args.concurrency} concurrent {conc:>7.0f} tok/s: "
              f"{conc / seq:.1f}x")
    if decoder is not None:
        print(f"\nstatic decode: {decoder.captures} CUDA graphs captured, "
              f"graphs {'on' if decoder.graphs else 'off'} at the end")
    await engine.close()


def main() -> None:
    asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    main()
