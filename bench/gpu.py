"""GPU throughput of memrl's own engine and actor on a random-initialised Qwen3-0.6B-shaped model (bf16).

Prints (and writes as JSON with --out) from one run:
- generation: HFEngine tokens/s and decode ms/step at 1, 16, 64 and 256 concurrent requests
  (MemAgent-shaped: prompts of 600-800 tokens, 128 new tokens), for each decode path side by side:
  `dynamic` (the growing DynamicCache-style cache, static_kv=off), `static` (slotted static-shape KV,
  eager, cuda_graphs=off) and `graphs` (the same, each bucket's step a CUDA graph); plain batched
  `model.generate` at 64 and, when it runs, transformers' own continuous batching (`generate_batch`,
  paged attention, its CUDA graphs) at 64 for reference;
- training: Actor.train_rollout tokens/s on MemAgent-shaped rows (prompt 500-900, response 16-128 tokens),
  with model FLOPs utilization (6·N·T over all tokens, N = non-embedding parameters, + LM head on
  response tokens, + the reference model's forward; H200 dense bf16 peak taken as 989 TFLOP/s), before vs
  after chunked log-probs and packing (TRAIN_VARIANTS), each at growing `train.micro_batch_tokens` until one
  runs out of memory, with the ratios against `before`.
Also, as steps of the same run: the GPU-only tests (pytest, first) and bench/rollout.py's async vs lockstep
ratio (last), each in a subprocess with a timeout. Made for a lent device with little time (bench/gpu.sh):
every row is caught and recorded with its error, the JSON is rewritten after every row, and `--budget-s`
skips a row that would no longer fit (estimated from the last row of its section), recording it as skipped.
Run: `bash bench/gpu.sh` on a CUDA machine. `--smoke` runs every step on a tiny model (on CPU when there is
no GPU; the `graphs` rows need CUDA and are skipped there) to check the script itself, in a minute or two.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import subprocess
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from memrl.config import Config
from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.tiny import build_tiny_model
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


GENERATION_PATHS = {  # HFEngine settings of each decode path compared
    "dynamic": {"static_kv": "off", "cuda_graphs": "off"},
    "static": {"static_kv": "on", "cuda_graphs": "off"},
    "graphs": {"static_kv": "on", "cuda_graphs": "on"},
}
GOALS = {"speedup_at_64": 4.0, "tokens_per_s_at_64": 7_500.0, "tokens_per_s_at_256": 10_000.0, "decode_ms_at_64": 5.0}


def memagent_prompts(n: int, rng: random.Random, lengths: tuple[int, int], vocab: int) -> list[list[int]]:
    low = min(1000, vocab // 2)  # ordinary-token ids (a real tokenizer's specials sit at the top)
    return [[rng.randrange(low, min(150000, vocab)) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def _timed_generate(engine: HFEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """Wall seconds and generated tokens of one request per prompt, all sent concurrently."""
    requests = [GenerationRequest(p, max_tokens, temperature=1.0, top_p=1.0, stop_token_ids=[], seed=k)
                for k, p in enumerate(prompts)]

    async def run() -> list:
        return await asyncio.gather(*(engine.generate([r]) for r in requests))

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    results = asyncio.run(run())
    sync()
    failed = [r[0].error for r in results if r[0].finish_reason == "error"]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    return time.perf_counter() - start, sum(len(r[0].output_ids) for r in results)


def bench_generation(model: torch.nn.Module, path: str, concurrency: int, rng: random.Random, max_tokens: int = 128,
                     prompt_lengths: tuple[int, int] = (600, 800), max_batch_size: int = 256) -> dict:
    """One decode path at one concurrency. An untimed run first (allocator, kernels, and for `graphs` the
    captures of the buckets this run uses), then the timed run, then the same prompts with one new token
    each: decode ms/step = (full - one token) / (max_tokens - 1), since every row is admitted in one
    prefill and decodes max_tokens - 1 steps with all rows (no stop tokens)."""
    engine = HFEngine(model, None, max_batch_size=max_batch_size, max_batch_tokens=max_batch_size * 1024,
                      **GENERATION_PATHS[path])
    prompts = memagent_prompts(concurrency, rng, prompt_lengths, model.config.vocab_size)
    _timed_generate(engine, prompts, max_tokens)  # warm-up
    engine.reset_stats()
    seconds, tokens = _timed_generate(engine, prompts, max_tokens)
    stats = engine.stats
    prefill_s, _ = _timed_generate(engine, prompts, 1)
    decoder = engine.static_decoder
    asyncio.run(engine.close())  # frees the static path's KV storage and graphs before the next engine
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"path": path, "concurrency": concurrency, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "decode_ms_per_step": 1000 * (seconds - prefill_s) / max(max_tokens - 1, 1),
            "prefill_s": prefill_s, "decode_steps": stats.decode_steps, "rows_per_step": stats.mean_decode_batch,
            "graph_captures": decoder.captures if decoder is not None else 0,
            "graphs_used": bool(decoder is not None and decoder.graphs)}


def bench_transformers_continuous(model: torch.nn.Module, concurrency: int, rng: random.Random, max_tokens: int,
                                  prompt_lengths: tuple[int, int]) -> dict:
    """transformers' own continuous batching (`generate_batch`: paged attention, its CUDA graphs), timed
    after one warm-up call; sampling at temperature 1 as the engine rows do."""
    import copy

    from transformers import ContinuousBatchingConfig, GenerationConfig

    cb_model = copy.deepcopy(model)  # generate_batch switches the model's attention implementation
    prompts = memagent_prompts(concurrency, rng, prompt_lengths, model.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=max_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(use_cuda_graph=torch.cuda.is_available(), max_memory_percent=0.5)
    cb_model.generate_batch(prompts[:4], generation_config=gen, continuous_batching_config=cb)  # warm-up
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = cb_model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    del cb_model
    return {"concurrency": concurrency, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


class Run:
    """The results of one run: rewritten to `out` (atomically) after every row, so a run killed at any point
    keeps every row before it; `budget_s` is the wall time the run may take, counted from its start."""

    def __init__(self, out: str | None, budget_s: float, results: dict) -> None:
        self.out, self.budget_s, self.results, self.start = out, budget_s, results, time.perf_counter()

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def fits(self, estimate_s: float) -> bool:
        return estimate_s <= self.left_s()

    def add(self, section: str, row: dict) -> None:
        self.results.setdefault(section, []).append(row)
        self.write()

    def write(self) -> None:
        if self.out:
            tmp = f"{self.out}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.results, f, indent=2)
            os.replace(tmp, self.out)  # atomic: a killed run leaves the last complete JSON


def timed_row(run: Run, section: str, label: str, estimate_s: float, keys: dict, fn, *args) -> dict | None:
    """One row: skipped (recorded) if `estimate_s` no longer fits the budget, else `fn(*args)` timed, its
    result or its error recorded under `keys`. Returns the row, None when it was skipped or failed."""
    if not run.fits(estimate_s):
        run.add(section, {**keys, "skipped": f"budget: ~{estimate_s:.0f} s needed, {run.left_s():.0f} s left"})
        print(f"{label}: skipped (budget: ~{estimate_s:.0f} s needed, {run.left_s():.0f} s left)", flush=True)
        return None
    start = time.perf_counter()
    try:
        result = fn(*args)
    except Exception as error:  # noqa: BLE001 - one failed row must not cost the run's other rows
        run.add(section, {**keys, "error": f"{type(error).__name__}: {error}",
                          "wall_s": time.perf_counter() - start})
        print(f"{label}: FAILED ({type(error).__name__}: {error})", flush=True)
        return None
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row = {**keys, **result, "wall_s": time.perf_counter() - start}
    run.add(section, row)
    return row


def generation_model(smoke: bool) -> tuple[torch.nn.Module, list[int], int, tuple[int, int]]:
    """(model, concurrencies, new tokens, prompt lengths). The concurrencies the goals name come first, so a
    tight budget drops the others."""
    on_cuda = torch.cuda.is_available()
    if smoke:
        if not on_cuda:
            torch.set_num_threads(1)  # a tiny model on a shared CPU: extra OpenMP threads only spin-wait
        model = build_tiny_model(151936 if on_cuda else 4096, layers=2, hidden=64, seed=0)
        return (model.to("cuda", torch.bfloat16) if on_cuda else model), [4, 16, 1], 8, (20, 40)
    return build_model(torch.bfloat16), [64, 256, 16, 1], 128, (600, 800)


def generation_section(run: Run, smoke: bool, rng: random.Random) -> None:
    """Every decode path at every concurrency, the speed-ups against the dynamic path and the goals; then
    plain `model.generate` and transformers' `generate_batch` for reference."""
    on_cuda = torch.cuda.is_available()
    model, concurrencies, max_tokens, lengths = generation_model(smoke)
    run.results["parameters"] = sum(p.numel() for p in model.parameters())
    paths = [p for p in GENERATION_PATHS if on_cuda or p != "graphs"]
    if not on_cuda:
        print("no CUDA device: the `graphs` rows are skipped (CUDA graphs need one)", flush=True)
    estimate = 0.0
    for conc in concurrencies:
        for path in paths:
            label = f"generate {path:<8} concurrency {conc:4d}"
            r = timed_row(run, "generation", label, estimate, {"path": path, "concurrency": conc},
                          bench_generation, model, path, conc, rng, max_tokens, lengths, max(concurrencies))
            if r is None:
                continue
            estimate = r["wall_s"]
            print(f"{label}: {r['tokens_per_s']:9.0f} tokens/s, decode {r['decode_ms_per_step']:6.2f} ms/step "
                  f"({r['tokens']} tokens, {r['seconds']:.2f} s, {r['rows_per_step']:.1f} rows/step, graphs "
                  f"captured {r['graph_captures']})", flush=True)
    by = {(g["path"], g["concurrency"]): g for g in run.results["generation"] if "tokens_per_s" in g}
    for path in paths[1:]:
        print(f"{path} vs dynamic: " + ", ".join(
            f"{c}: {by[path, c]['tokens_per_s'] / by['dynamic', c]['tokens_per_s']:.2f}x" if (path, c) in by and
            ("dynamic", c) in by else f"{c}: n/a" for c in concurrencies))
    if not smoke and on_cuda:
        print_generation_goals(by)
    conc = 64 if 64 in concurrencies else max(concurrencies)
    r = timed_row(run, "reference_generation", f"plain model.generate batch {conc}", estimate,
                  {"kind": "plain_generate"}, bench_plain_generate, model, conc, rng, max_tokens, lengths[1])
    if r:
        print(f"plain model.generate batch {r['batch']}: {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    r = timed_row(run, "reference_generation", f"transformers generate_batch concurrency {conc}", estimate,
                  {"kind": "transformers_generate_batch"}, bench_transformers_continuous, model, conc, rng,
                  max_tokens, lengths)
    if r:
        print(f"transformers generate_batch concurrency {conc}: {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    del model
    if on_cuda:
        torch.cuda.empty_cache()


def print_generation_goals(by: dict) -> None:
    g64, g256, d64 = by.get(("graphs", 64)), by.get(("graphs", 256)), by.get(("dynamic", 64))
    checks = [("tokens/s at 64 >= 7,500", g64 and g64["tokens_per_s"], GOALS["tokens_per_s_at_64"]),
              ("tokens/s at 256 >= 10,000", g256 and g256["tokens_per_s"], GOALS["tokens_per_s_at_256"]),
              ("graphs vs dynamic at 64 >= 4x", g64 and d64 and g64["tokens_per_s"] / d64["tokens_per_s"],
               GOALS["speedup_at_64"])]
    for name, value, goal in checks:
        verdict = "not measured" if not value else f"{value:.2f} -> {'met' if value >= goal else 'NOT met'}"
        print(f"goal {name}: {verdict}")
    if g64:
        ms = g64["decode_ms_per_step"]
        verdict = "met" if ms <= GOALS["decode_ms_at_64"] else "NOT met"
        print(f"goal decode step at 64 rows <= 5 ms: {ms:.2f} ms -> {verdict}")


def bench_plain_generate(model: Qwen3ForCausalLM, batch: int, rng: random.Random, max_tokens: int = 128,
                         prompt_len: int = 700) -> dict:
    device = next(model.parameters()).device
    ids = torch.tensor(memagent_prompts(batch, rng, (prompt_len, prompt_len), model.config.vocab_size), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0)
    sync()
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * batch
    return {"batch": batch, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def memagent_rows(n: int, rng: random.Random, vocab: int, prompt: tuple[int, int] = (500, 900),
                  response: tuple[int, int] = (16, 128)) -> list[TrainRow]:
    """Rows in GRPO groups of 8 samples whose prompts share their first `prompt[0] // 2` tokens (a turn's
    instructions, question and chunk), so `train.share_prefixes` has something to share."""
    low = min(1000, vocab // 2)
    rows, head = [], []
    for k in range(n):
        p, r = rng.randint(*prompt), rng.randint(*response)
        if k % 8 == 0:
            head = [rng.randrange(low, min(150000, vocab)) for _ in range(prompt[0] // 2)]
        rows.append(TrainRow(tokens=head + [rng.randrange(low, min(150000, vocab)) for _ in range(p + r - len(head))],
                             response_length=r, loss_mask=[1] * r,
                             rollout_log_probs=[-rng.random() * 5 for _ in range(r)],
                             advantage=rng.uniform(-1, 1), group_id=f"g{k // 8}", trajectory_id=f"t{k}",
                             turn_index=0, rollout_id=0))
    return rows


# Training rows, before vs after: (name, train overrides, micro-batch token budgets to try). `before`
# is the former path (whole [tokens x vocab] fp32 logits kept for the backward, padded micro-batches) at the
# budget it was measured at; the others go up in budget until the GPU runs out of memory. 65,536 and above
# cannot fit an H200 with this model (fp32 logits of the response tokens): not tried. `chunked+shared` against
# `chunked` decides train.share_prefixes' default on the GPU (the rows share half of each prompt in groups of 8).
TRAIN_VARIANTS: list[tuple[str, dict, list[int]]] = [
    ("before", {"logprob_chunk_tokens": None, "packing": False, "share_prefixes": False}, [16384]),
    ("chunked", {"packing": False, "share_prefixes": False}, [16384, 32768]),
    ("chunked+packed", {"packing": True, "share_prefixes": False}, [16384, 32768]),
    ("chunked+shared", {"packing": False, "share_prefixes": True}, [16384, 32768]),
]


def bench_training(smoke: bool, n_rows: int, steps: int, micro_batch_tokens: int, rng: random.Random,
                   train: dict | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if smoke:
        model = build_tiny_model(4096, layers=2, hidden=64, seed=0).to(device)
        rows = memagent_rows(n_rows, rng, 4096, (30, 60), (4, 16))
    else:
        model = build_model(torch.float32)
        rows = memagent_rows(n_rows, rng, model.config.vocab_size)
    cfg = Config.model_validate({"train": {"lr": 1e-6, "micro_batch_tokens": micro_batch_tokens, **(train or {})},
                                 "algorithm": {"kl_coef": 0.001}})
    actor = Actor(model, cfg, pad_token_id=0, device=device)
    cuda = device.type == "cuda"
    actor.train_rollout(rows[: max(8, n_rows // 8)], 0)  # warm-up (allocator, kernels)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = {}
    for step in range(steps):
        metrics = actor.train_rollout(rows, step + 1)
    if cuda:
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
            "mfu": flops / elapsed / PEAK_BF16_FLOPS if cuda else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "padding_fraction": metrics.get("padding_fraction"), "micro_batches": metrics.get("micro_batches")}


def training_section(run: Run, smoke: bool, quick: bool) -> None:
    """Every TRAIN_VARIANTS row on the same rows (same seed), each budget until one runs out of memory or
    fails; then each variant's best against `before`."""
    n_rows = 16 if smoke else (128 if quick else 256)
    estimate = 0.0
    for name, train, budgets in TRAIN_VARIANTS:
        for budget in budgets:
            label = f"train {name:<15} micro_batch_tokens {budget:6d}"
            r = timed_row(run, "training", label, estimate, {"variant": name, "micro_batch_tokens": budget, **train},
                          bench_training, smoke, n_rows, 2, budget, random.Random(1), train)
            if r is None:
                break  # out of memory, another error or the budget: a larger budget would not do better
            estimate = r["wall_s"]
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            peak = "n/a" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f} GiB"
            print(f"{label}: {r['tokens_per_s']:9.0f} tokens/s, MFU {mfu}, peak {peak}, padding "
                  f"{r['padding_fraction']:.3f}", flush=True)
    ran = [r for r in run.results.get("training", []) if "tokens_per_s" in r]
    before = next((r for r in ran if r["variant"] == "before"), None)
    for name, _, _ in TRAIN_VARIANTS[1:]:
        mine = [r for r in ran if r["variant"] == name]
        if mine and before:
            best = max(mine, key=lambda r: r["tokens_per_s"])
            mfu = ("" if best["mfu"] is None else
                   f", MFU {100 * best['mfu']:.1f}% vs {100 * before['mfu']:.1f}% (goal >= 30%)")
            print(f"train {name} (best, micro_batch_tokens {best['micro_batch_tokens']}) vs before: "
                  f"{best['tokens_per_s'] / before['tokens_per_s']:.2f}x tokens/s{mfu}", flush=True)


def subprocess_step(run: Run, name: str, command: list[str], timeout_s: float) -> str:
    """Run one step of the benchmark in its own process (a crash or hang there costs only this step); its
    exit code and the tail of its output go into the results. Returns its output."""
    timeout_s = min(timeout_s, run.left_s())
    if timeout_s < 10:
        run.results[name] = {"command": " ".join(command), "skipped": f"budget: {run.left_s():.0f} s left"}
        run.write()
        print(f"== {name}: skipped (budget)", flush=True)
        return ""
    print(f"== {name}: {' '.join(command)} (timeout {timeout_s:.0f} s)", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as error:  # what it printed before the timeout (bytes, whatever `text`)
        output, code = (error.stdout or b"").decode(errors="replace"), "timeout"
    print(output[-4000:], flush=True)
    run.results[name] = {"command": " ".join(command), "exit_code": code, "wall_s": time.perf_counter() - start,
                         "output_tail": output[-2000:]}
    run.write()
    return output


def gpu_tests(run: Run) -> None:
    """The GPU-only tests (each named with `cuda`; on CPU they skip): CUDA graphs after a weight sync, CUDA
    log-probs and the bf16 default, the varlen packed attention against padded sdpa, shared-prefix micro-batches
    against unshared ones."""
    files = ["tests/engines/test_static_decode.py", "tests/engines/test_hf.py", "tests/train/test_packing.py",
             "tests/train/test_shared_prefix.py"]
    output = subprocess_step(run, "gpu_tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                *files, "-k", "cuda"], 240)
    summary = [line for line in output.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
    if "gpu_tests" in run.results:
        run.results["gpu_tests"]["summary"] = summary[-1] if summary else None
        run.write()


def rollout_schedules(run: Run, smoke: bool) -> None:
    """bench/rollout.py's async vs lockstep ratio with the engine's default GPU decode path (graphs)."""
    args = (["--quick", "--questions", "4", "--samples", "2", "--static-kv", "on"] if smoke else
            ["--device", "cuda", "--questions", "64", "--samples", "8", "--repeats", "3"])
    output = subprocess_step(run, "rollout", [sys.executable, "bench/rollout.py", *args], 300)
    match = re.search(r"async vs lockstep: ([0-9.]+)x faster \(median wall\)", output)
    if "rollout" in run.results:
        run.results["rollout"]["async_vs_lockstep"] = float(match.group(1)) if match else None
        run.write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here (rewritten after every row)")
    parser.add_argument("--quick", action="store_true", help="128 training rows instead of 256")
    parser.add_argument("--smoke", action="store_true",
                        help="every step on a tiny model, CPU when there is no GPU: checks the script itself")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="wall seconds the run may take: a row that would no longer fit is skipped (recorded)")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench/gpu.py needs a CUDA device (or --smoke, which checks the script on a tiny model)")
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    run = Run(args.out, args.budget_s, {"device": device, "torch": torch.__version__,
                                        "transformers": transformers.__version__, "smoke": args.smoke})
    gpu_tests(run)
    generation_section(run, args.smoke, random.Random(0))
    training_section(run, args.smoke, args.quick)
    rollout_schedules(run, args.smoke)
    run.results["wall_s"] = time.perf_counter() - run.start
    run.write()
    print(f"done in {run.results['wall_s']:.0f} s; results: {args.out or '(not written: no --out)'}")


if __name__ == "__main__":
    main()
