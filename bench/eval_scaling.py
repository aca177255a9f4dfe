"""Evaluation cost against document length: wall time and peak RSS per question, 1 to 64 chunks.

    python bench/eval_scaling.py                 # lengths 1 2 4 8 16 32 64, 2 questions each (~3 min here)
    python bench/eval_scaling.py --lengths 4 64 --questions 4 --concurrency 4

Each length runs in a fresh subprocess, so its peak RSS (`ru_maxrss`) belongs to that length alone. The
child builds everything in code (the synthetic task's word-level tokenizer, a random-init tiny Qwen3),
makes `--questions` documents of exactly L chunks (memrl.data.synthetic.make_length_set, `--facts` facts
per chunk), and runs `memrl.eval.runner.evaluate` on them: the whole evaluation loop (chunking, the
MemAgent memory loop on HFEngine, scoring, results.jsonl). The stop token's logit is biased to -1e4, so
every memory runs to its `--memory-tokens` cap: the longest memory, the worst case for memory use.

What it checks: memory must not grow with the number of turns, only with the document's token ids (a
trajectory that kept every turn's tensors, logits or duplicated prompts would grow with L). Printed:
seconds per question and per chunk, peak RSS, and RSS above the child's baseline after setup (model
built, data made); then the least-squares slope of time per question against chunks and the ratio
peak RSS(64 chunks) / peak RSS(4 chunks) (goal <= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    """Current RSS of this process in MB (Linux /proc), for the post-setup baseline."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from memrl.config import load_config
    from memrl.data.synthetic import FACT_TOKENS, make_length_set, task_tokenizer
    from memrl.engines.factory import build_engine
    from memrl.eval.results import read_results
    from memrl.eval.runner import evaluate
    from memrl.tiny import build_tiny_model

    tokenizer = task_tokenizer()
    model = build_tiny_model(len(tokenizer), layers=args.layers, hidden=args.hidden, intermediate=2 * args.hidden,
                             seed=0, eos_token_id=tokenizer.eos_token_id)
    # No stop token ever: every memory runs to its cap (the worst case), every answer to final_tokens.
    # A bias on the LM head's stop logits (as bench/rollout.py biases them), so log-probs stay exact.
    head = model.get_output_embeddings()
    bias = torch.zeros(head.weight.shape[0])
    bias[tokenizer.eos_token_id] = -1e4
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    cfg = load_config(ROOT / "recipes" / "toy.yaml", [
        f"task.chunk_tokens={FACT_TOKENS * args.facts}", f"task.max_chunks={max(args.length, 1)}",
        f"task.memory_tokens={args.memory_tokens}", f"task.final_tokens={args.final_tokens}",
        f"eval.concurrency={args.concurrency}"])
    records = make_length_set(args.questions, args.length, seed=0, facts_per_chunk=args.facts)
    engine = build_engine(cfg, model=model, tokenizer=tokenizer)
    baseline = _rss_mb()
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        summary = evaluate(engine, tokenizer, cfg, records, Path(out), model_name="tiny-random", data_sha256="bench",
                           progress=False)
        wall = time.perf_counter() - t
        lines = read_results(Path(out) / "results.jsonl")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux
    return {"length": args.length, "questions": len(records), "failed": summary["failed"],
            "document_tokens": lines[0]["document_tokens"], "turns": lines[0]["turns"],
            "memory_max": max(max(line["memory_lengths"]) for line in lines),
            "s_per_question": wall / len(records), "peak_rss_mb": peak, "baseline_rss_mb": baseline}


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="chunks per document")
    parser.add_argument("--questions", type=int, default=2, help="questions per length")
    parser.add_argument("--concurrency", type=int, default=1, help="questions in flight (eval.concurrency)")
    parser.add_argument("--facts", type=int, default=32,
                        help="facts per chunk (7 tokens each): chunk_tokens = 7 x facts")
    parser.add_argument("--memory-tokens", type=int, default=64)
    parser.add_argument("--final-tokens", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a shared machine)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.length = args.child
        print(json.dumps(child(args)))
        return
    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
              ("questions", "concurrency", "facts", "memory_tokens", "final_tokens", "layers", "hidden", "threads")]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rows = []
    print(f"chunk {7 * args.facts} tokens, memory {args.memory_tokens}, final {args.final_tokens}, "
          f"{args.questions} questions per length, concurrency {args.concurrency}, {args.threads} torch thread(s)")
    print(f"{'chunks':>6} {'doc_tok':>8} {'turns':>5} {'mem_max':>7} {'s/question':>10} {'s/chunk':>8} "
          f"{'peak_rss_MB':>11} {'above_setup_MB':>14}")
    for length in args.lengths:
        out = subprocess.run([sys.executable, __file__, f"--child={length}", *passed], capture_output=True, text=True,
                             env=env, timeout=3600, check=False)
        if out.returncode:
            sys.exit(f"length {length} failed:\n{out.stderr[-4000:]}")
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"{row['length']:>6} {row['document_tokens']:>8} {row['turns']:>5} {row['memory_max']:>7} "
              f"{row['s_per_question']:>10.2f} {row['s_per_question'] / row['length']:>8.3f} "
              f"{row['peak_rss_mb']:>11.0f} {row['peak_rss_mb'] - row['baseline_rss_mb']:>14.1f}", flush=True)
    if len(rows) > 1:
        s = slope([r["length"] for r in rows], [r["s_per_question"] for r in rows])
        print(f"time per question: {s:.3f} s per extra chunk (least squares over {len(rows)} lengths)")
    by_length = {r["length"]: r for r in rows}
    if 4 in by_length and 64 in by_length:
        ratio = by_length[64]["peak_rss_mb"] / by_length[4]["peak_rss_mb"]
        print(f"peak RSS 64 chunks / 4 chunks: {ratio:.3f} (goal <= 1.2: {'met' if ratio <= 1.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
