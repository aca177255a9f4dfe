"""The overlapped pipeline vs the synchronous loop, one process, the same workload (CPU by default).

    python bench/pipeline.py            # 2 x 12 training steps of a tiny Qwen3, about 2-3 minutes on 2 cores
    python bench/pipeline.py --quick    # 2 x 5 steps

Both runs train the same tiny random model on the same questions with the same seeds, through the real
`Trainer` (MemAgent rollout, converter, queue, actor, checkpoints off the critical path): one with
`train.max_staleness=0` (generate, then train, then sync), one with `train.max_staleness=1` (rollout n+1
generates while step n trains). Rollout n of the two runs samples with different weights (that is the
point), so their rewards differ; the work per step (questions, samples, chunks, token caps) is the same.
The workload is sized so that generating and training each take about half of a synchronous step on a
2-core CPU (memory turns of up to 30 tokens, the engine decoding 4 rows at a time, one torch thread per
stage: the synchronous run uses one core, the overlapped run one per stage).

Printed: wall time and steps/hour of each, the line `pipeline: overlapped vs synchronous: X.XXx
steps/hour`, and the engine-idle and trainer-idle shares of wall time of both runs (engine idle = 1 -
rollout seconds / wall, trainer idle = 1 - train seconds / wall; the overlapped run's stages run in two
threads, so the two shares need not add up to 1). On CPU the overlap can use a second core only where the
two stages' torch work does not share one (torch's intra-op pool is split in two for the pipeline); Python
work of both stages shares one interpreter lock.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `pipeline:parity_reward` as a plugin path

from memrl.config import Config  # noqa: E402
from memrl.data.records import QuestionRecord  # noqa: E402
from memrl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from memrl.train.controller import Trainer, TrainOptions  # noqa: E402


def parity_reward(traj, golds) -> float:
    """A reward that varies within a group for a random model (exact match would be 0 everywhere)."""
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


def records(n: int) -> list[QuestionRecord]:
    return [QuestionRecord(id=f"q{k}", question=f"What is fact{k}?", answers=["Paris"], metadata={},
                           context=" ".join(f"Document {j}: fact{k}{j} is the capital of France." for j in range(4)))
            for k in range(n)]


def config(args: argparse.Namespace, max_staleness: int) -> Config:
    return Config.model_validate({
        "model": {"device": "cpu", "dtype": "float32"},
        "plugins": {"reward_function": "pipeline:parity_reward"},
        "task": {"chunk_tokens": 24, "memory_tokens": args.memory_tokens, "final_tokens": 6, "max_chunks": 3},
        "sampling": {"n_samples": args.samples, "temperature": 1.0},
        "engine": {"max_batch_size": args.engine_batch},
        "algorithm": {"kl_coef": 0.01},
        "train": {"lr": 1e-4, "num_rollout": args.steps, "rollout_batch_size": args.questions,
                  "save_interval": 10_000, "max_staleness": max_staleness, "micro_batch_tokens": 4096},
    })


def run(args: argparse.Namespace, max_staleness: int, root: Path) -> dict[str, float]:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(len(tok), layers=args.layers, hidden=args.hidden, heads=4, kv_heads=2,
                             intermediate=2 * args.hidden, seed=0, eos_token_id=tok.eos_token_id)
    torch.set_num_threads(args.threads)  # the pipeline halves it for each of its two stages
    trainer = Trainer(config(args, max_staleness), TrainOptions(run_root=root, progress=False), model=model,
                      tokenizer=tok, records=records(args.questions * 4))
    start = time.perf_counter()
    history = trainer.run()
    wall = time.perf_counter() - start
    rollout = sum(m["time/rollout_s"] for m in history)
    train = sum(m["time/train_s"] for m in history)
    return {"wall_s": wall, "steps_per_hour": 3600 * len(history) / wall, "rollout_s": rollout, "train_s": train,
            "engine_idle": 1 - rollout / wall, "trainer_idle": 1 - train / wall,
            "rows": sum(m["rows/consumed"] for m in history),
            "staleness": sum(m.get("pipeline/staleness", 0.0) for m in history) / len(history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--memory-tokens", type=int, default=30)
    parser.add_argument("--engine-batch", type=int, default=4, help="engine.max_batch_size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: one core per stage)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="Also write the figures to this file.")
    args = parser.parse_args()
    if args.quick:
        args.steps = 5
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (0, 1):
            results[k] = run(args, k, Path(tmp) / f"k{k}")
            r = results[k]
            print(f"max_staleness={k}: {r['wall_s']:.1f} s wall, {r['steps_per_hour']:.0f} steps/hour, "
                  f"rollout {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, rows {r['rows']:.0f}, "
                  f"mean staleness {r['staleness']:.2f}", flush=True)
    sync, overlapped = results[0], results[1]
    print(f"pipeline: overlapped vs synchronous: {overlapped['steps_per_hour'] / sync['steps_per_hour']:.2f}x "
          f"steps/hour")
    for k, name in ((0, "synchronous"), (1, "overlapped")):
        print(f"  {name}: engine idle {results[k]['engine_idle']:.0%} of wall time, "
              f"trainer idle {results[k]['trainer_idle']:.0%}")
    print(f"  synchronous step: generation {sync['rollout_s'] / (sync['rollout_s'] + sync['train_s']):.0%}, "
          f"training {sync['train_s'] / (sync['rollout_s'] + sync['train_s']):.0%} of the two stages' time")
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
