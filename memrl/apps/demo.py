"""`memrl demo`: the CPU main job. With no GPU and no download, GRPO through the MemAgent loop teaches a
tiny model to keep the right fact in its memory (stages, targets and measurements: docs/demo.md).

Both evaluations sample at temperature 1.0 (the recipe's sampling) with per-question seeds independent of
the model, so base and trained see identical randomness. The other demos reuse the stages through this
module's public names.
"""

from __future__ import annotations

import asyncio
import copy
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from memrl.config import Config, load_config
from memrl.errors import MemrlError
from memrl.io import atomic_write_json

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml"
EM_TARGET_PP = 15.0
REWARD_TARGET = 0.15


class DemoError(RuntimeError, MemrlError):
    """The demo cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run; `FULL` is `memrl demo`, `QUICK` is `memrl demo --quick` (the slow test)."""

    num_train: int = 10000
    num_heldout: int = 1000
    max_chunks: int = 3
    facts_per_chunk: int = 3
    filler: bool = False          # documents padded with unrelated facts (memrl.data.synthetic.make_padded_record)
    # model (tiny Qwen3; word-level vocabulary of the task)
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    # supervised warm start on imperfect demonstrations
    sft_clean_demos: int = 8000   # phase 1: perfect demonstrations (learn to find and copy the fact)
    keep_prob: float = 0.3        # phase 2: the memory keeps the fact only this often (an imperfect reader)
    unknown_answer: str = "abstain"  # phase 2, memory without the fact: box "unknown" (or "guess" a value)
    sft_demos: int = 800
    sft_epochs: int = 3
    sft_batch_size: int = 16
    sft_lr: float = 2e-3
    # GRPO (the rest comes from recipes/toy.yaml)
    num_rollout: int = 80
    rollout_batch_size: int = 16
    n_samples: int = 8
    grpo_lr: float = 3e-4         # 1e-3 drifted (KL to the base 2-5 by rollout 40) and the reward collapsed
    eval_interval: int = 10       # validate on the held-out set every N GRPO steps (0 = off); never changes training
    seed: int = 0
    overrides: tuple[str, ...] = field(default_factory=tuple)


FULL = DemoSettings()
QUICK = replace(FULL, num_heldout=400, sft_clean_demos=4000, sft_demos=400, num_rollout=20)


def demo_config(settings: DemoSettings, data_dir: Path | None = None) -> Config:
    """recipes/toy.yaml with the settings' GRPO sizes (and any `section.key=value` overrides) applied;
    `data_dir` (the run's prepared data) is where validation during training finds the held-out set."""
    if not RECIPE.is_file():
        raise DemoError(f"the toy recipe {RECIPE} is missing; run the demo from a memrl checkout")
    from memrl.data.synthetic import FACT_TOKENS

    overrides = [f"task.chunk_tokens={FACT_TOKENS * settings.facts_per_chunk}",
                 f"task.max_chunks={settings.max_chunks}",
                 f"sampling.n_samples={settings.n_samples}", f"train.num_rollout={settings.num_rollout}",
                 f"train.rollout_batch_size={settings.rollout_batch_size}", f"train.lr={settings.grpo_lr}",
                 f"train.seed={settings.seed + 1234}", f"train.eval_interval={settings.eval_interval}"]
    if data_dir is not None:
        overrides += [f"data.dir={data_dir}", "data.heldout_file=synthetic_heldout.jsonl"]
    overrides += settings.overrides
    return load_config(RECIPE, overrides)


def evaluate_policy(model: torch.nn.Module, tokenizer: Any, cfg: Config, records: list, out_dir: Path,
                    name: str, data_sha256: str, data_path: Path,
                    tokenizer_name: str = "memrl.data.synthetic:task_tokenizer") -> dict[str, Any]:
    """Held-out evaluation of one policy (memrl.eval.runner) on an in-process engine, closed afterwards."""
    from memrl.engines.factory import build_engine
    from memrl.eval.runner import evaluate

    engine = build_engine(cfg, model=model, tokenizer=tokenizer)  # the demos' recipes: CPU, float32
    try:
        return evaluate(engine, tokenizer, cfg, records, out_dir, model_name=name, data_sha256=data_sha256,
                        data_path=str(data_path), tokenizer_name=tokenizer_name)
    finally:
        asyncio.run(engine.close())


def reward_curve(history: Sequence[dict[str, float]], window: int = 10, key: str = "reward/mean") -> dict[str, Any]:
    """The training reward (or another per-rollout metric `key`) per rollout and the means of its first and
    last `window` rollouts (shorter windows, never overlapping, on short runs)."""
    rewards = [float(m.get(key, 0.0)) for m in history]
    w = max(1, min(window, len(rewards) // 2))
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    return {"window": w, "first": first, "last": last, "gain": last - first, "per_rollout": rewards}


def new_run_root(run_root: Path) -> Path:
    """`run_root` created, refused (DemoError) when it holds anything: a demo never mixes two runs' files."""
    run_root = Path(run_root)
    if run_root.exists() and any(run_root.iterdir()):
        raise DemoError(f"{run_root} is not empty; pass a new --run-root (or delete the old run)")
    run_root.mkdir(parents=True, exist_ok=True)
    return run_root


def quiet_demo(threads: int = 1) -> None:
    """How every demo command runs: memrl's logs at WARNING (the summary is the output) and, unless
    OMP_NUM_THREADS says otherwise, `threads` torch threads: one is as fast for the tiny model, and on a busy
    machine extra OpenMP threads spin-wait for cores and slow every step (bench/README.md)."""
    import logging
    import os

    logging.getLogger("memrl").setLevel(logging.WARNING)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)


@dataclass
class WarmStart:
    """The demo's stages 1-2: its data and the warm-started base (shared by `memrl demo-consistency`)."""

    paths: dict[str, Path]
    train: list
    heldout: list
    heldout_sha: str
    tokenizer: Any
    model: torch.nn.Module
    seconds: float

    def evaluate(self, model: torch.nn.Module, cfg: Config, out_dir: Path, name: str) -> dict[str, Any]:
        """`evaluate_policy` on the held-out questions, with their data identity."""
        return evaluate_policy(model, self.tokenizer, cfg, self.heldout, out_dir, name, self.heldout_sha,
                               self.paths["heldout"])


def warm_start(run_root: Path, settings: DemoSettings, cfg: Config, progress: bool = True) -> WarmStart:
    """Seed, write the synthetic data into run_root/data and warm-start the base (run_root/sft/*), exactly as
    `run_demo` does: the same calls in the same order, so the same RNG draws and the same base."""
    from memrl.data.manifest import sha256_file
    from memrl.data.records import load_questions
    from memrl.data.synthetic import prepare_synthetic, task_tokenizer
    from memrl.memagent.demonstrations import demonstration_turns
    from memrl.memagent.prompts import PromptBuilder
    from memrl.tiny import build_tiny_model
    from memrl.train.setup import seed_everything
    from memrl.train.sft import SFTOptions, run_sft

    seed_everything(settings.seed)
    # 1. Data: training and held-out questions from disjoint streams, with a SHA-256 manifest.
    t = time.perf_counter()
    paths = prepare_synthetic(run_root / "data", num_train=settings.num_train, num_heldout=settings.num_heldout,
                              max_chunks=settings.max_chunks, facts_per_chunk=settings.facts_per_chunk,
                              seed=settings.seed, filler=settings.filler)
    train, heldout = load_questions(paths["train"]), load_questions(paths["heldout"])
    heldout_sha = sha256_file(paths["heldout"])
    tokenizer = task_tokenizer()

    # 2. Base: a tiny Qwen3 warm-started on imperfect demonstrations (prompts built by the rollout's builder).
    model = build_tiny_model(len(tokenizer), layers=settings.layers, hidden=settings.hidden, heads=settings.heads,
                             kv_heads=settings.kv_heads, intermediate=settings.intermediate, seed=settings.seed,
                             eos_token_id=tokenizer.eos_token_id)
    builder = PromptBuilder(tokenizer, cfg.task)
    rng = random.Random(f"demo-sft:{settings.seed}")
    # Two phases on disjoint training questions: perfect demonstrations teach finding and copying the
    # fact (a clean signal learns fastest); imperfect ones then make the reader overlook it often, so
    # the base keeps the fact only ~keep_prob of the time and GRPO has that to fix.
    clean = train[: settings.sft_clean_demos]
    noisy = train[settings.sft_clean_demos: settings.sft_clean_demos + settings.sft_demos]
    for phase, records, keep in (("sft/clean", clean, 1.0), ("sft/imperfect", noisy, settings.keep_prob)):
        if not records:
            continue
        demos = [demonstration_turns(r, tokenizer, builder, cfg.task, keep, rng,
                                     unknown_answer=settings.unknown_answer) for r in records]
        run_sft(model, tokenizer, cfg, demos,
                SFTOptions(epochs=settings.sft_epochs, batch_size=settings.sft_batch_size, lr=settings.sft_lr,
                           seed=settings.seed, progress=progress), out_dir=run_root / phase)
    return WarmStart(paths, train, heldout, heldout_sha, tokenizer, model, time.perf_counter() - t)


def grpo_records(settings: DemoSettings, train: Sequence[Any]) -> Sequence[Any]:
    """The GRPO questions: training questions the warm start never saw, so the reward curve is not
    inflated by demonstrations the base may have memorized."""
    start = settings.sft_clean_demos + settings.sft_demos
    if len(train) - start < settings.rollout_batch_size:
        raise DemoError(f"num_train ({settings.num_train}) leaves {max(0, len(train) - start)} questions for GRPO "
                        f"after {start} warm-start demonstrations; raise num_train")
    return train[start:]


def run_demo(run_root: Path, settings: DemoSettings = FULL, progress: bool = True) -> dict[str, Any]:
    """Run every stage into `run_root` (new or empty); returns the summary (also run_root/demo_summary.json)."""
    run_root = new_run_root(run_root)
    started = time.perf_counter()
    cfg = demo_config(settings, data_dir=run_root / "data")
    atomic_write_json(run_root / "demo_settings.json", asdict(settings))
    base = warm_start(run_root, settings, cfg, progress)
    times = {"data+sft_s": base.seconds}

    t = time.perf_counter()
    base_eval = base.evaluate(base.model, cfg, run_root / "eval_base", "sft-base")
    times["eval_base_s"] = time.perf_counter() - t

    t = time.perf_counter()
    history, trained_model = train_grpo(run_root, cfg, base.model, base.tokenizer, grpo_records(settings, base.train),
                                        progress)
    times["train_s"] = time.perf_counter() - t

    # The same held-out questions, sampling settings and seeds as the base's evaluation.
    t = time.perf_counter()
    trained_eval = base.evaluate(trained_model, cfg, run_root / "eval_trained", "grpo-trained")
    times["eval_trained_s"] = time.perf_counter() - t

    summary = _compare_and_summarize(run_root, settings, len(base.heldout), base_eval, trained_eval, history)
    summary["times_s"] = {**times, "total_s": time.perf_counter() - started}
    atomic_write_json(run_root / "demo_summary.json", summary)
    return summary


def train_grpo(run_root: Path, cfg: Config, model: torch.nn.Module, tokenizer: Any, records: Sequence[Any],
               progress: bool) -> tuple[list[dict[str, float]], torch.nn.Module]:
    """GRPO from a copy of `model` through the real controller (queue, converter, checkpoints, logs) into
    run_root/train; returns the history and the trained model, also saved to run_root/trained_model."""
    from memrl.train.controller import Trainer, TrainOptions

    trainer = Trainer(cfg, TrainOptions(run_root=run_root / "train", progress=progress),
                      model=copy.deepcopy(model), tokenizer=tokenizer, records=records)
    history = trainer.run()
    trained_model = trainer.parts.policy.merged_model().eval()  # with model.lora: base + adapters, merged
    trained_model.save_pretrained(run_root / "trained_model")
    tokenizer.save_pretrained(run_root / "trained_model")
    return history, trained_model


def _scores(result: dict[str, Any]) -> dict[str, Any]:
    m = result["metrics"]
    return {"em": m["em"]["value"], "em_ci95": [m["em"]["low"], m["em"]["high"]], "sub_em": m["sub_em"]["value"],
            "f1": m["f1"]["value"]}


def compare_and_view(run_root: Path, evals: dict[str, str]) -> tuple[Any, list[Path]]:
    """The comparison of the eval folders `evals` (name -> folder under run_root; memrl compare, into
    run_root/compare), the plots of run_root/train (memrl report) and the viewer pages (memrl view): the last
    two evaluations side by side (run_root/viewer.html) and the training run (train/viewer.html). Returns the
    `CompareReport` and the plots."""
    from memrl.eval.compare import compare_results
    from memrl.train.report import write_report
    from memrl.viewer.build import write_viewer

    report = compare_results([run_root / folder for folder in evals.values()], names=list(evals))
    report.write(run_root / "compare")
    plots = write_report(run_root / "train")
    *_, before, after = evals.values()
    write_viewer(run_root / before, run_root / after, run_root / "viewer.html")
    write_viewer(run_root / "train")
    return report, plots


def _compare_and_summarize(run_root: Path, settings: DemoSettings, heldout_questions: int,
                           base_eval: dict[str, Any], trained_eval: dict[str, Any],
                           history: list[dict[str, float]]) -> dict[str, Any]:
    """The comparison, plots and viewer pages (`compare_and_view`), and the summary of the figures;
    `times_s` is the caller's to add."""
    from memrl.train.run_log import EVAL_METRICS_FILE, read_metrics

    report, plots = compare_and_view(run_root, {"base": "eval_base", "trained": "eval_trained"})
    reward = reward_curve(history)
    base, trained = _scores(base_eval), _scores(trained_eval)
    pair = report.pairs[0]
    validation = [[r["rollout_id"], r["eval/heldout/em"]] for r in read_metrics(run_root / "train", EVAL_METRICS_FILE)]
    return {
        "settings": asdict(settings),
        "heldout_questions": heldout_questions,
        "base": base,
        "trained": trained,
        "em_gain_pp": trained["em"] - base["em"],
        "flips": {"wrong_to_right": len(pair.wrong_to_right), "right_to_wrong": len(pair.right_to_wrong),
                  "mcnemar_p": pair.mcnemar_p},
        "validation": {"interval": settings.eval_interval, "heldout_em": validation},
        "reward": reward,
        "targets": {"em_gain_pp": {"target": EM_TARGET_PP, "met": trained["em"] - base["em"] >= EM_TARGET_PP},
                    "reward_gain": {"target": REWARD_TARGET, "met": reward["gain"] >= REWARD_TARGET}},
        "paths": {"eval_base": "eval_base", "eval_trained": "eval_trained", "compare": "compare/report.md",
                  "train": "train", "report": "train/report/report.md", "plots": [str(p) for p in plots],
                  "viewer": "viewer.html", "train_viewer": "train/viewer.html"},
    }


def format_summary(summary: dict[str, Any], run_root: Path) -> str:
    b, t, r, tg = summary["base"], summary["trained"], summary["reward"], summary["targets"]
    n = summary["heldout_questions"]
    yes = {True: "yes", False: "NO"}
    lines = [
        "",
        f"memrl demo: {n} held-out questions, temperature 1.0, same per-question seeds for both models",
        "",
        "| policy  | boxed EM % [95% CI]     | sub_EM % | F1 %  |",
        "|---------|-------------------------|----------|-------|",
        *(f"| {name:<7} | {s['em']:5.1f} [{s['em_ci95'][0]:4.1f}, {s['em_ci95'][1]:4.1f}]      | {s['sub_em']:8.1f} | "
          f"{s['f1']:5.1f} |" for name, s in (("base", b), ("trained", t))),
        "",
        f"EM flips: {summary['flips']['wrong_to_right']} wrong->right, {summary['flips']['right_to_wrong']} "
        f"right->wrong (exact McNemar p = {summary['flips']['mcnemar_p']:.3g})",
        *(["held-out EM during training (rollout: EM): "
           + ", ".join(f"{x}: {em:.1f}" for x, em in summary["validation"]["heldout_em"])]
          if summary.get("validation", {}).get("heldout_em") else []),
        f"training reward: first {r['window']} rollouts {r['first']:.3f} -> last {r['window']} rollouts {r['last']:.3f}"
        f" ({r['gain']:+.3f})",
        "",
        f"target met: {yes[tg['em_gain_pp']['met']]}  held-out EM {b['em']:.1f} -> {t['em']:.1f} "
        f"({summary['em_gain_pp']:+.1f} pp; target >= +{tg['em_gain_pp']['target']:g} pp)",
        f"target met: {yes[tg['reward_gain']['met']]}  training reward {r['first']:.3f} -> {r['last']:.3f} "
        f"({r['gain']:+.3f}; target >= +{tg['reward_gain']['target']:g})",
        "",
        f"time: {summary['times_s']['total_s'] / 60:.1f} min. Results in {run_root}: eval_base/, eval_trained/, "
        "compare/report.md, train/report/*.png, viewer.html (memrl view), demo_summary.json",
    ]
    return "\n".join(lines)


def demo_command(run_root: Path, quick: bool = False, overrides: Sequence[str] = (),
                 eval_interval: int | None = None) -> int:
    """`memrl demo`: 0 when both targets are met, else 1; `overrides` apply to the GRPO training recipe
    (recipes/toy.yaml) after the demo's own sizes."""
    quiet_demo()
    settings = replace(QUICK if quick else FULL, overrides=tuple(overrides))
    if eval_interval is not None:
        settings = replace(settings, eval_interval=eval_interval)
    demo_config(settings)  # a bad override fails here, before minutes of warm start
    summary = run_demo(Path(run_root), settings)
    print(format_summary(summary, Path(run_root)))
    return 0 if all(t["met"] for t in summary["targets"].values()) else 1
