"""Real run outputs for the viewer tests, made by memrl's own writers (never hand-written JSON):

- `eval_pair(tokenizer, root)`: two `memrl eval` folders of the same 16 questions by a scripted engine,
  "base" right on BASE_RIGHT and "trained" on TRAINED_RIGHT; question q3's final answer and q2's memory
  contain HTML that would change the page if it ever ran (INJECTED);
- `train_run(tokenizer, root)`: one GRPO step of the real Trainer on a tiny random model;
- `single_turn_eval(tokenizer, root)`: a `memrl eval` folder of the second task (memrl.tasks.single_turn),
  the answer boxed right on even questions.
"""

from __future__ import annotations

import re
from pathlib import Path

from scripted_engine import ScriptedEngine

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.eval.runner import evaluate
from memrl.tiny import build_tiny_model
from memrl.train.controller import Trainer, TrainOptions

N_QUESTIONS = 16
BASE_RIGHT = {0, 1, 2, 3}
TRAINED_RIGHT = {2, 3, 4, 5, 6, 7}  # q4..q7 wrong->right, q0, q1 right->wrong
# Would set the title / a body attribute if the page ever parsed model text as HTML.
INJECTED = ("<script>document.title='PWNED'</script>"
            "<img src=x onerror=\"document.body.setAttribute('data-pwned','1')\">"
            "</script><script>document.title='PWNED2'</script>")
_QUESTION = re.compile(r"What is item (\d+)\?")


def make_records(n: int = N_QUESTIONS) -> list[QuestionRecord]:
    return [QuestionRecord(f"q{i}", f"What is item {i}?", [f"alpha{i}"],
                           " ".join(f"item{k} is alpha{k}." for k in range(6 + i))) for i in range(n)]


def eval_config() -> Config:
    return Config.model_validate({"task": {"chunk_tokens": 32, "memory_tokens": 96, "final_tokens": 96,
                                           "max_chunks": 3},
                                  "sampling": {"temperature": 0.0}, "eval": {"concurrency": 4}})


def scripted_reply(right: set[int]):
    """Memory turns note "item i is alpha{i}" for even i (else "nothing yet"); the final turn boxes alpha{i}
    when i is in `right`, else "wrong"."""
    def reply(prompt: str) -> str:
        i = int(_QUESTION.search(prompt).group(1))
        if "final answer" not in prompt:
            note = f"item {i} is alpha{i}" if i % 2 == 0 else "nothing yet"
            return note + (" " + INJECTED if i == 2 else "")
        boxed = f"alpha{i}" if i in right else "wrong"
        return (INJECTED + " " if i == 3 else "") + f"\\boxed{{{boxed}}}"
    return reply


def eval_pair(tokenizer, root: Path) -> tuple[Path, Path]:
    folders = []
    for name, right in (("base", BASE_RIGHT), ("trained", TRAINED_RIGHT)):
        folder = root / f"eval_{name}"
        evaluate(ScriptedEngine(tokenizer, scripted_reply(right)), tokenizer, eval_config(), make_records(), folder,
                 model_name=name, data_sha256="sha-viewer", progress=False)
        folders.append(folder)
    return folders[0], folders[1]


def single_turn_eval(tokenizer, root: Path) -> Path:
    folder = root / "eval_single_turn"

    def reply(prompt: str) -> str:
        i = int(_QUESTION.search(prompt).group(1))
        return f"\\boxed{{alpha{i if i % 2 == 0 else 'x'}}}"

    cfg = Config.model_validate({"task": {"final_tokens": 32}, "sampling": {"temperature": 0.0},
                                 "plugins": {"task": "memrl.tasks.single_turn:SingleTurnTask"}})
    evaluate(ScriptedEngine(tokenizer, reply), tokenizer, cfg, make_records(), folder, model_name="single",
             data_sha256="sha-viewer", progress=False)
    return folder


def parity_reward(traj, golds):
    """A reward that varies within a group even for a random model, so advantages are not all 0."""
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


def train_run(tokenizer, root: Path, question: str = "What is fact0?") -> Path:
    cfg = Config.model_validate({
        "plugins": {"reward_function": f"{__name__}:parity_reward"},
        "task": {"chunk_tokens": 24, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 3},
        "sampling": {"n_samples": 8, "temperature": 1.0},
        "engine": {"max_batch_size": 1},
        "train": {"lr": 1e-3, "num_rollout": 1, "rollout_batch_size": 1, "save_interval": 1},
        "queue": {"train_sample_expansion_factor": 4},
    })
    model = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0,
                             eos_token_id=tokenizer.eos_token_id)
    records = [QuestionRecord("t0", question, ["Paris"],
                              " ".join(f"Document {j}: fact0{j} is the capital of France, Paris." for j in range(4)))]
    run_root = root / "run"
    Trainer(cfg, TrainOptions(run_root=run_root, progress=False), model=model, tokenizer=tokenizer,
            records=records).run()
    return run_root
