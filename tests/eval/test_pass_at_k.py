import asyncio

from memrl.config import Config
from memrl.data.hotpotqa import read_pass_counts, select_by_pass_counts
from memrl.data.records import QuestionRecord
from memrl.engines.base import GenerationResult
from memrl.eval.pass_at_k import count_passes
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
    cfg = Config.model_validate({"rollout": {"chunk_tokens": 64, "memory_tokens": 16, "final_tokens": 16}})
    records = [QuestionRecord(id=f"q{i}", question=f"Q{i}?", answers=["Paris"], context="", metadata={})
               for i in range(5)]
    counts, failed = asyncio.run(count_passes(SeedOracle(tiny_tokenizer, fail_ids=[3]), tiny_tokenizer, cfg,
                                              records, k=8, progress=False))
    assert failed == ["q3"] and "q3" not in counts
    for slot, rec in enumerate(records):
        if rec.id == "q3":
            continue
        # empty context: the final turn is turn 0; seeds as the rollout derives them
        expected = sum(request_seed(cfg.rollout.seed, f"0:{slot}:{rec.id}", k, 0) % 2 == 0 for k in range(8))
        assert counts[rec.id] == expected
    # the file format prepare-data reads, and the selection it feeds
    path = tmp_path / "pc.json"
    import json

    path.write_text(json.dumps({"k": 8, "pass_counts": counts}))
    read, k = read_pass_counts(path, 8)
    assert read == counts and k == 8
    chosen = select_by_pass_counts(read, 8, num=len([c for c in counts.values() if 0 < c < 8]))
    assert all(0 < counts[i] < 8 for i in chosen)
