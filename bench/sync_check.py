"""The weight-sync canary's cost (train.sync_check, memrl/train/sync_check.py), CPU by default.

    python bench/sync_check.py              # tiny steps + the demo's model + a Qwen3-0.6B-shaped one (~3 min, ~6 GB)
    python bench/sync_check.py --no-0.6b    # without the 0.6B shape

1. Steps: the real `Trainer` (bench/pipeline.py's tiny workload, synchronous loop, canary on by default);
   printed: the median step time (sum of its stage times), the median `time/sync_check_s`, their ratio.
2. Per sync, for random-init models of two shapes (the demo's tiny Qwen3; Qwen3-0.6B's: 28 layers,
   hidden 1024, intermediate 3072, vocabulary 151,936), float32: the sync itself (the local engine copying
   the actor's weights, `HFEngine.load_weights`) vs the canary (`Actor.sync_probe` + `HFEngine.score` +
   `check_sync`), alternating, `--repeats` times each; printed: every repeat, the medians and their ratio.
   A served engine adds one HTTP round trip to the canary and a folder save + reload to the sync.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `pipeline:parity_reward` as a plugin path

import pipeline  # noqa: E402

from memrl.config import Config  # noqa: E402
from memrl.engines.factory import build_engine  # noqa: E402
from memrl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from memrl.train.actor import Actor  # noqa: E402
from memrl.train.controller import Trainer, TrainOptions  # noqa: E402
from memrl.train.sync_check import check_sync, probe_ids  # noqa: E402

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}


class Vocabulary:
    """A tokenizer's two properties the probe reads, for a model shape without a tokenizer."""

    def __init__(self, size: int) -> None:
        self.size, self.all_special_ids = size, []

    def __len__(self) -> int:
        return self.size


def steps(args: argparse.Namespace) -> None:
    bench = argparse.Namespace(memory_tokens=30, samples=4, engine_batch=4, steps=args.steps, questions=2,
                               layers=2, hidden=64, threads=args.threads)
    with tempfile.TemporaryDirectory() as root:
        tok = build_tiny_tokenizer()
        model = build_tiny_model(len(tok), layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128,
                                 eos_token_id=tok.eos_token_id)
        trainer = Trainer(pipeline.config(bench, 0), TrainOptions(run_root=Path(root), progress=False), model=model,
                          tokenizer=tok, records=pipeline.records(8))
        history = trainer.run()
    step = statistics.median(sum(v for k, v in m.items() if k.startswith("time/") and k != "time/generate_s")
                             for m in history)
    check = statistics.median(m["time/sync_check_s"] for m in history)
    print(f"steps: {len(history)} synchronous steps of a tiny Qwen3, median step {step:.3f} s, median "
          f"time/sync_check_s {check * 1000:.1f} ms: {100 * check / step:.2f}% of a step")


def per_sync(name: str, model: torch.nn.Module, vocabulary, repeats: int) -> None:
    cfg = Config.model_validate({"model": {"device": "cpu", "dtype": "float32"}, "algorithm": {"kl_coef": 0.0}})
    actor = Actor(model, cfg, pad_token_id=0)
    engine = build_engine(cfg, model=actor.model)
    prompt, continuation = probe_ids(vocabulary)
    syncs, trainer_side, engine_side = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.load_weights(actor.policy_weights())
        syncs.append(time.perf_counter() - start)
        start = time.perf_counter()
        probe = actor.sync_probe(prompt, continuation, version=1)
        trainer_side.append(time.perf_counter() - start)
        start = time.perf_counter()
        diff = check_sync(probe, {"engine": asyncio.run(engine.score(prompt, continuation, 1.0))}, None)
        engine_side.append(time.perf_counter() - start)
    checks = [t + e for t, e in zip(trainer_side, engine_side, strict=True)]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{name} ({params:.1f}M parameters), seconds per repeat:")
    for label, values in (("sync (load_weights)", syncs), ("canary, trainer side", trainer_side),
                          ("canary, engine side", engine_side)):
        print(f"  {label:22s} {' '.join(f'{v:.3f}' for v in values)}  median {statistics.median(values):.3f}")
    print(f"  median canary / sync = {statistics.median(checks) / statistics.median(syncs):.2f}x; "
          f"max |engine - trainer| {diff:.2g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-0.6b", dest="large", action="store_false", help="skip the Qwen3-0.6B shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps(args)
    tok = build_tiny_tokenizer()
    per_sync("demo-shaped tiny Qwen3", build_tiny_model(len(tok), layers=3, hidden=128, heads=4, kv_heads=2,
                                                        intermediate=256), tok, args.repeats)
    if args.large:
        torch.manual_seed(0)
        per_sync("Qwen3-0.6B-shaped", Qwen3ForCausalLM(Qwen3Config(**QWEN3_06B)), Vocabulary(QWEN3_06B["vocab_size"]),
                 args.repeats)


if __name__ == "__main__":
    main()
