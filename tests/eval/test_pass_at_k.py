import asyncio
import json
import re

import pytest

from memrl.config import Config, load_config
from memrl.data.hotpotqa import read_pass_counts, select_by_pass_counts
from memrl.data.records import QuestionRecord
from memrl.engines.base import GenerationResult
from memrl.eval.pass_at_k import count_passes
from memrl.memagent.task import MemAgentTask
from memrl.rollout import request_seed


class SeedOracle:
    """Answers \\boxed{Paris} when the request's seed is even, \\boxed{Rome} otherwise."""

    def __init__(self, tokenizer, fail_ids=()):
        self.tok, self.fail_ids = tokenizer, fail_ids

    async def generate(self, requests):
        out = []
        for r in requests:
            if any(f"Q{i}?" in self.tok.decode(r.prompt_ids) for i in self.fail_ids):
                out.append(GenerationResult.failed("boom"))
                continue
            text = r"\boxed{Paris}" if r.seed % 2 == 0 else r"\boxed{Rome}"
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerationResult(ids, [-0.1] * len(ids), "stop"))
        return out

    async def close(self):
        pass


def test_pass_counts_match_the_reward_of_each_sample(tiny_tokenizer, tmp_path):
    cfg = Config.model_validate({"task": {"chunk_tokens": 64, "memory_tokens": 16, "final_tokens": 16}})
    records = [QuestionRecord(id=f"q{i}", question=f"Q{i}?", answers=["Paris"], context="", metadata={})
               for i in range(5)]
    counts, failed = asyncio.run(count_passes(SeedOracle(tiny_tokenizer, fail_ids=[3]), tiny_tokenizer, cfg,
                                              records, k=8, progress=False))
    assert failed == ["q3"] and "q3" not in counts
    for slot, rec in enumerate(records):
        if rec.id == "q3":
            continue
        # empty context: the final turn is turn 0; seeds as the rollout derives them
        expected = sum(request_seed(cfg.sampling.seed, f"0:{slot}:{rec.id}", k, 0) % 2 == 0 for k in range(8))
        assert counts[rec.id] == expected
    # the file format prepare-data reads, and the selection it feeds
    path = tmp_path / "pc.json"
    path.write_text(json.dumps({"k": 8, "pass_counts": counts}))
    read, k = read_pass_counts(path, 8)
    assert read == counts and k == 8
    chosen = select_by_pass_counts(read, 8, num=len([c for c in counts.values() if 0 < c < 8]))
    assert all(0 < counts[i] < 8 for i in chosen)


class BonusTask(MemAgentTask):
    reward_weights = {"bonus": 0.5}

    def reward_terms(self, cfg):
        return {**super().reward_terms(cfg), "bonus": lambda traj, golds: 1.0}


def test_a_pass_is_the_answers_reward_whatever_other_reward_terms_add(tiny_tokenizer):
    # A right answer's reward is 1.5 here, a wrong one's 0.5: a pass is its `outcome` term scoring 1.
    cfg = load_config(None, [f"plugins.task={__name__}:BonusTask", "task.final_tokens=16"])
    records = [QuestionRecord(id=f"q{i}", question=f"Q{i}?", answers=["Paris"], context="") for i in range(3)]
    counts, _ = asyncio.run(count_passes(SeedOracle(tiny_tokenizer), tiny_tokenizer, cfg, records, k=8,
                                         progress=False))
    assert counts == {rec.id: sum(request_seed(cfg.sampling.seed, f"0:{slot}:{rec.id}", k, 0) % 2 == 0
                                  for k in range(8)) for slot, rec in enumerate(records)}
    assert 0 < sum(counts.values()) < 24


def _candidates(tmp_path, n):
    from memrl.data.records import write_jsonl

    path = tmp_path / "candidates.jsonl"
    write_jsonl(path, [QuestionRecord(id=f"q{i}", question=f"Q{i}?", answers=["Paris"], context="", metadata={})
                       for i in range(n)])
    return path


def _fake_engine(monkeypatch, tokenizer):
    from memrl.eval import runner

    monkeypatch.setattr(runner, "open_engine", lambda cfg, model, url, tok: (tokenizer, SeedOracle(tokenizer),
                                                                             {"kind": "fake"}))


SMALL = ["task.chunk_tokens=64", "task.memory_tokens=16", "task.final_tokens=16"]


@pytest.mark.parametrize(("sets", "limit", "expected"), [
    (["eval.limit=2"], None, 2),   # the key the issue reported as ignored: 5 questions ran instead of 2
    ([], 3, 3),                    # --limit
    (["eval.limit=2"], 4, 4),      # --limit after --set, as `memrl eval` orders them
    (["eval={limit: 1}"], None, 1),
    ([], None, 5),
])
def test_pass_at_k_reads_the_question_limit(tiny_tokenizer, tmp_path, monkeypatch, sets, limit, expected):
    from memrl.eval.pass_at_k import pass_at_k_command

    _fake_engine(monkeypatch, tiny_tokenizer)
    out = tmp_path / "counts.json"
    result = pass_at_k_command("fake-model", None, None, _candidates(tmp_path, 5), out, k=2, sets=SMALL + sets,
                               limit=limit, progress=False)
    assert list(result["pass_counts"]) == [f"q{i}" for i in range(expected)]
    assert (result["questions"] == expected
            and json.loads(out.read_text())["limit"] == (expected if expected < 5 else None))


@pytest.mark.parametrize(("key", "words"), [
    ("train.lr=1e-5", "does not read 'train.lr'"),
    ("data.dir=/data", "the candidates are --data FILE"),
    ("queue.timeout_s=5", "does not read 'queue.timeout_s'"),
    ("algorithm.kl_coef=0", "it reads model.*, sampling.*, engine.*, task.*, eval.limit"),
])
def test_pass_at_k_refuses_a_key_it_would_ignore(tiny_tokenizer, tmp_path, monkeypatch, key, words):
    from memrl.config import ConfigError
    from memrl.eval.pass_at_k import pass_at_k_command

    _fake_engine(monkeypatch, tiny_tokenizer)
    with pytest.raises(ConfigError, match=re.escape(words)):
        pass_at_k_command("fake-model", None, None, _candidates(tmp_path, 2), tmp_path / "c.json", k=2,
                          sets=SMALL + [key], progress=False)
    assert not (tmp_path / "c.json").exists()


def test_pass_at_k_cli_refuses_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from memrl.cli import app

    result = CliRunner().invoke(app, ["pass-at-k", "--model", "m", "--data", str(_candidates(tmp_path, 1)),
                                      "--out", str(tmp_path / "c.json"), "--set", "train.num_rollout=3"])
    assert result.exit_code == 2 and "does not read 'train.num_rollout'" in result.output
