"""Prefix sharing in one run: prompt tokens computed vs requested, and tokens/s, shared vs unshared.

    python bench/prefill.py             # ~15 min on 2 shared CPU cores (the official shape is most of it)
    python bench/prefill.py --quick     # the seed's shape only, one repeat (~2 min)
    python bench/prefill.py --shapes official --official-repeats 2
    python bench/prefill.py --tokenizer path/to/qwen3-tokenizer --device cuda
    python bench/prefill.py --quick --layers 4 --hidden 512 --questions 4   # prefill compute that is real
    python bench/prefill.py --quick --model models/smollm2-135m --questions 1  # a trained HF model, its tokenizer

One MemAgent rollout step (`MemAgentTask.generate`, continuous batching, the engine's default dynamic cache)
per (shape, prompt layout, sharing) on the same engine and model, sharing toggled between runs
(`HFEngine.share_prefixes`), same seeds, so shared and unshared runs sample the same tokens up to float
rounding (the table's `same_len` column: turns with the same response length). Shapes:
- seed: the seed's recipe (recipes/qwen3-0.6b-hotpotqa.yaml): 8 questions x n = 8, 4 chunks of 512, memory
  128, final 64, engine max_batch_size 32;
- official: MemAgent's (recipes/memagent-official-eval.yaml) with training groups: 2 questions x n = 16,
  8 chunks of 5,000, memory 1,024, final 1,024.
Every document fills all its chunks. Model: a random-init tiny Qwen3 over the real Qwen3 vocabulary
(151,669 tokens; --tokenizer, default ../shared/assets/qwen3-tokenizer); a bias on the stop-token logits
makes response lengths geometric with mean `--mean-response` x the memory limit (a random model would run
every memory to its cap). `--layers/--hidden` widen it (heads of 64 from hidden 256 on, intermediate 2x hidden);
`--model` runs a Hugging Face folder instead (its own tokenizer unless --tokenizer is given, no stop bias:
a trained model's responses end where it stops them). `--questions` reduces every shape's question count.

Columns: `requested` prompt tokens asked for, `computed` token positions the prefills ran (padding
included; `EngineStats`), `ratio` computed / requested, `turn0` that ratio over the prefills made only of
turn-0 prompts (`cover`: the share of turn-0 requests they hold), `wall_s` the step's wall time,
`cpu_s` the CPU time this process spent meanwhile (all threads: on a machine shared with other jobs the
steadier measure of the work), `prefill_s` the wall time of the engine's prefills, `pf_cpu` the engine
thread's CPU time in them (with 1 torch thread all their compute; unlike wall time, not inflated when other
jobs take the cores), `steps` decode steps,
`prompt/s` requested prompt tokens per prefill second, `gen/s` generated tokens per second of wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `python bench/prefill.py` finds rollout.py

from rollout import _WORDS, BenchError, Record, bias_stop_logits  # noqa: E402

from memrl.config import Config, EngineConfig, SamplingConfig  # noqa: E402
from memrl.engines.base import GenerationRequest  # noqa: E402
from memrl.engines.hf import HFEngine, resolve_device_dtype  # noqa: E402
from memrl.memagent.prompts import PromptBuilder  # noqa: E402
from memrl.memagent.rollout import builder_of, document_chunks  # noqa: E402
from memrl.memagent.settings import MemAgentSettings  # noqa: E402
from memrl.memagent.task import MemAgentTask  # noqa: E402
from memrl.rollout import RolloutContext  # noqa: E402
from memrl.tiny import build_tiny_model  # noqa: E402

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[1] / ".." / "shared" / "assets" / "qwen3-tokenizer"


@dataclass(frozen=True)
class Shape:
    name: str
    questions: int
    n: int
    chunks: int
    chunk_tokens: int
    memory_tokens: int
    final_tokens: int


SHAPES = {"seed": Shape("seed", 8, 8, 4, 512, 128, 64), "official": Shape("official", 2, 16, 8, 5000, 1024, 1024)}


class MeteredEngine(HFEngine):
    """HFEngine that also sums requested and computed prompt tokens over prefills of turn-0 prompts only."""

    turn0: frozenset[tuple[int, ...]] = frozenset()

    def reset_stats(self) -> None:
        super().reset_stats()
        self.turn0_requested = self.turn0_computed = self.turn0_requests = 0
        self.prefill_s = self.prefill_cpu_s = 0.0

    def _prefill(self, requests: list[GenerationRequest], held=None):
        before, start, cpu = self.stats.prefill_tokens, time.perf_counter(), time.thread_time()
        out = super()._prefill(requests, held)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.prefill_s += time.perf_counter() - start
        self.prefill_cpu_s += time.thread_time() - cpu  # the engine's thread: its prefill compute alone
        if all(tuple(r.prompt_ids) in self.turn0 for r in requests):
            self.turn0_requested += sum(len(r.prompt_ids) for r in requests)
            self.turn0_computed += self.stats.prefill_tokens - before
            self.turn0_requests += len(requests)
        return out


@dataclass
class Run:
    shape: str
    layout: str
    shared: bool
    wall_s: float
    cpu_s: float
    prefill_s: float
    prefill_cpu_s: float
    decode_steps: int
    requested: int
    computed: int
    turn0_ratio: float
    turn0_cover: float
    generated: int
    lengths: list[int]

    @property
    def ratio(self) -> float:
        return self.computed / self.requested


def make_records(tokenizer, shape: Shape, seed: int) -> list[Record]:
    """Documents longer than the token budget (center truncation keeps exactly `shape.chunks` full chunks)."""
    rng = random.Random(seed)
    per_word = len(tokenizer(" ".join(_WORDS))["input_ids"]) / len(_WORDS)
    words = int(1.2 * shape.chunks * shape.chunk_tokens / per_word)
    return [Record(id=f"q{q}", question=f"Which {rng.choice(_WORDS)} was {rng.choice(_WORDS)} in {rng.choice(_WORDS)}?",
                   answers=["Paris"], context=" ".join(rng.choices(_WORDS, k=words))) for q in range(shape.questions)]


def rollout_config(shape: Shape, layout: str, args: argparse.Namespace) -> Config:
    return Config(
        sampling=SamplingConfig(n_samples=shape.n, temperature=1.0, seed=args.seed),
        engine=EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens),
        task=MemAgentSettings(chunk_tokens=shape.chunk_tokens, memory_tokens=shape.memory_tokens,
                        final_tokens=shape.final_tokens, max_chunks=shape.chunks, prompt_layout=layout))


async def run_step(engine: MeteredEngine, tokenizer, shape: Shape, layout: str, shared: bool,
                   records: list[Record], args: argparse.Namespace) -> Run:
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, config=rollout_config(shape, layout, args), progress=False)
    builder = PromptBuilder(tokenizer, ctx.config.task)
    engine.turn0 = frozenset(tuple(builder.memory_prompt_ids(
        r.question, None, document_chunks(tokenizer, ctx.config.task, r.context).chunks[0])) for r in records)
    for record in records:  # every document fills every chunk
        if document_chunks(tokenizer, ctx.config.task, record.context).num_chunks != shape.chunks:
            raise BenchError(f"a {shape.name} document has fewer than {shape.chunks} chunks; raise the word count")
    engine.share_prefixes = shared
    engine.reset_stats()
    start, cpu = time.perf_counter(), time.process_time()
    output = await MemAgentTask().generate(ctx, records)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if output.dropped:
        raise BenchError(f"{len(output.dropped)} trajectories failed, e.g. {output.dropped[0].error}")
    turns = [t for trajectory in output.trajectories for t in trajectory.turns]
    stats = engine.stats
    return Run(shape.name, layout, shared, wall, cpu, engine.prefill_s, engine.prefill_cpu_s, stats.decode_steps,
               stats.prompt_tokens, stats.prefill_tokens,
               engine.turn0_computed / max(engine.turn0_requested, 1),
               engine.turn0_requests / (len(records) * shape.n), sum(t.response_length for t in turns),
               [t.response_length for t in turns])


def line(run: Run, same: float) -> str:
    return (f"{run.shape:<9} {run.layout:<12} {'on' if run.shared else 'off':<7} {run.wall_s:>7.1f} {run.cpu_s:>7.1f} "
            f"{run.prefill_s:>9.1f} {run.prefill_cpu_s:>6.1f} {run.decode_steps:>6d} "
            f"{run.requested:>10d} {run.computed:>10d} {run.ratio:>6.3f} {run.turn0_ratio:>6.3f} "
            f"{run.turn0_cover:>6.0%} "
            f"{run.requested / run.prefill_s:>10.0f} {run.generated / run.wall_s:>7.0f} {same:>8.0%}")


def ratios(pairs: list[tuple[Run, Run]], field: str) -> str:
    """'1.23x faster (1.20x, 1.31x, ...)': unshared over shared time, median first, then per pair."""
    each = [getattr(off, field) / getattr(on, field) for off, on in pairs]
    return f"{statistics.median(each):.2f}x faster ({', '.join(f'{r:.2f}x' for r in each)})"


def same_lengths(a: Run, b: Run) -> float:
    return sum(x == y for x, y in zip(a.lengths, b.lengths, strict=False)) / max(len(a.lengths), 1)


def load_model(args: argparse.Namespace, tokenizer) -> tuple[torch.nn.Module, str]:
    """The benchmarked model and how to describe it: --model's folder, else the random Qwen3."""
    if args.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32)
        return model, (f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter {args.model.name} "
                       f"({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, vocabulary "
                       f"{len(tokenizer)})")
    heads = max(4, args.hidden // 64)  # head_dim 64 as in small real models; 4 heads of 16 at hidden 64
    model = build_tiny_model(len(tokenizer), layers=args.layers, hidden=args.hidden, heads=heads, kv_heads=2,
                             intermediate=2 * args.hidden, seed=args.seed)
    return model, (f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter random Qwen3 ({args.layers} "
                   f"layers, hidden {args.hidden}, {heads} heads, vocabulary {len(tokenizer)})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the seed's shape only, one repeat")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a real tokenizer folder (default: --model's, else ../shared/assets/qwen3-tokenizer)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a Hugging Face model folder instead of the random one")
    parser.add_argument("--questions", type=int, default=None, help="questions per shape (default: the shape's)")
    parser.add_argument("--layouts", nargs="+", choices=["memagent", "chunk_first"],
                        default=["memagent", "chunk_first"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="shared/unshared pairs at the seed's shape")
    parser.add_argument("--official-repeats", type=int, default=1, help="shared/unshared pairs at the official shape")
    parser.add_argument("--mean-response", type=float, default=0.25,
                        help="mean sampled response length, as a share of the memory-turn limit")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=262144,
                        help="HFEngine's KV budget (rows x (prompt + new)); 262144 admits a whole official group")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: see bench/README.md)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.shapes = 1, ["seed"]
    args.tokenizer = args.tokenizer or args.model or DEFAULT_TOKENIZER
    if not (args.tokenizer / "tokenizer.json").is_file():
        raise BenchError(f"no tokenizer.json in {args.tokenizer}; pass --tokenizer <a Qwen3 tokenizer folder>")
    if min(args.repeats, args.official_repeats, args.questions or 1) <= 0 or not 0 < args.mean_response <= 1:
        raise BenchError("--repeats, --official-repeats and --questions must be > 0 and --mean-response in (0, 1]")
    return args


async def main_async(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    device, dtype = resolve_device_dtype(args.device, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    model, described = load_model(args, tokenizer)
    engine = MeteredEngine(model, tokenizer, max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens,
                           device=device, dtype=dtype)
    shapes = [dataclasses.replace(SHAPES[name], questions=args.questions or SHAPES[name].questions)
              for name in args.shapes]
    print(f"model: {described}, {device}, {dtype}, torch threads {torch.get_num_threads()}; engine max_batch_size "
          f"{args.max_batch_size}, max_batch_tokens {args.max_batch_tokens}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    stops = builder_of(RolloutContext(engine=engine, tokenizer=tokenizer, config=Config())).stop_token_ids
    print(f"\n{'shape':<9} {'layout':<12} {'sharing':<7} {'wall_s':>7} {'cpu_s':>7} "
          f"{'prefill_s':>9} {'pf_cpu':>6} {'steps':>6} "
          f"{'requested':>10} "
          f"{'computed':>10} {'ratio':>6} {'turn0':>6} {'cover':>6} {'prompt/s':>10} {'gen/s':>7} {'same_len':>8}")
    summary = []
    for shape in shapes:
        if args.model is None:  # a random model would write every memory to its cap
            bias_stop_logits(engine.model, stops, args.mean_response * shape.memory_tokens)
        records = make_records(tokenizer, shape, args.seed)
        if shape is shapes[0]:  # warm-up (allocator, kernels, prompt caches): one chunk of one question, n = 2
            warm_up = dataclasses.replace(SHAPES["seed"], questions=1, n=2, chunks=1)
            await run_step(engine, tokenizer, warm_up, "memagent", True, records[:1], args)
        for layout in args.layouts:
            pairs = []
            for repeat in range(args.repeats if shape.name == "seed" else args.official_repeats):
                order = (False, True) if repeat % 2 == 0 else (True, False)
                runs = {shared: await run_step(engine, tokenizer, shape, layout, shared, records, args)
                        for shared in order}
                same = same_lengths(runs[False], runs[True])
                for shared in order:
                    print(line(runs[shared], same), flush=True)
                pairs.append((runs[False], runs[True]))
            on = pairs[0][1]
            summary.append(f"{shape.name:<9} {layout:<12} computed/requested {on.ratio:.3f} (unshared "
                           f"{pairs[0][0].ratio:.3f}), turn 0 {on.turn0_ratio:.3f} (1/n + 5% = "
                           f"{1 / shape.n + 0.05:.3f}); shared vs unshared, median of {len(pairs)}: step wall "
                           f"{ratios(pairs, 'wall_s')}, step CPU {ratios(pairs, 'cpu_s')}, prefill "
                           f"{ratios(pairs, 'prefill_s')}, prefill CPU {ratios(pairs, 'prefill_cpu_s')}")
    print("\n" + "\n".join(summary))
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    await engine.close()


def main() -> None:
    asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    main()
