"""The MemAgent final turn alone as a task (memrl/memagent/final_turn.py): its prompt is the rollout's own final
prompt with the record's context as the memory, it trains one row per trajectory, and the records it reads
(`answer_memory_record`) hold the answer the way a reader's memory would."""

from __future__ import annotations

import asyncio
import random

import pytest

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.memagent.final_turn import FinalTurnTask
from memrl.memagent.hotpot_demonstrations import answer_memory, answer_memory_record
from memrl.memagent.prompts import PromptBuilder, encode_text
from memrl.memagent.reward import gold_in_text
from memrl.memagent.settings import MemAgentSettings
from memrl.rollout import RolloutContext
from memrl.tiny import build_tiny_model
from memrl.train.controller import Trainer, TrainOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TASK = "memrl.memagent.final_turn:FinalTurnTask"
DOCUMENT = ("Doc one\nThe city has a river. It has a bridge. The author was born in Lisbon in 1901. "
            "He left early. Nothing else matters here.")


class EchoEngine:
    """Answers every request with one token and a stop, remembering the prompts."""

    def __init__(self, stop_id):
        self.stop_id, self.prompts = stop_id, []

    async def generate(self, requests):
        from memrl.engines.base import GenerationResult

        self.prompts += [list(r.prompt_ids) for r in requests]
        return [GenerationResult([5, self.stop_id], [-0.1, -0.2], "stop") for _ in requests]


def test_the_prompt_is_the_rollouts_final_prompt_with_the_record_as_memory(tiny_tokenizer):
    cfg = Config.model_validate({"task": {"final_tokens": 4, "memory_tokens": 24}, "sampling": {"n_samples": 2},
                                 "plugins": {"task": TASK}})
    record = QuestionRecord("q0", "Where was the author born?", ["Lisbon"], "He was born in Lisbon.")
    engine = EchoEngine(tiny_tokenizer.eos_token_id)
    ctx = RolloutContext(engine=engine, tokenizer=tiny_tokenizer, config=cfg, reward_function=None, progress=False)
    trajectories = asyncio.run(FinalTurnTask().generate(ctx, [record])).trajectories
    builder = PromptBuilder(tiny_tokenizer, cfg.task)
    expected = builder.final_prompt_ids(record.question, encode_text(tiny_tokenizer, record.context))
    assert engine.prompts == [expected, expected] and [len(t.turns) for t in trajectories] == [1, 1]
    assert "Your memory:\nHe was born in Lisbon.\n" in tiny_tokenizer.decode(expected)
    assert trajectories[0].turns[0].kind == "final"
    assert FinalTurnTask().stop_token_ids(tiny_tokenizer, cfg) == builder.stop_token_ids


def test_it_trains_one_row_per_trajectory_through_the_loop(tmp_path, tiny_tokenizer):
    cfg = Config.model_validate({
        "task": {"final_tokens": 4, "memory_tokens": 24}, "sampling": {"n_samples": 4},
        "engine": {"max_batch_size": 8}, "plugins": {"task": TASK},
        "train": {"num_rollout": 1, "rollout_batch_size": 2, "lr": 1e-3, "save_interval": 10}})
    records = [QuestionRecord(f"q{k}", "Which city?", ["Paris"], f"Text {k}: Paris.") for k in range(2)]
    model = build_tiny_model(len(tiny_tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64,
                             eos_token_id=tiny_tokenizer.eos_token_id)
    (step,) = Trainer(cfg, TrainOptions(run_root=tmp_path, progress=False), model=model, tokenizer=tiny_tokenizer,
                      records=records).run()
    assert step["rows/consumed"] == 8


def _cfg(**kw) -> MemAgentSettings:
    return MemAgentSettings(**{"chunk_tokens": 64, "memory_tokens": 24, "final_tokens": 16, "max_chunks": 2, **kw})


def test_an_answer_memory_runs_up_to_the_answers_sentence_within_the_memory_budget(tiny_tokenizer):
    record = QuestionRecord("q", "Where was the author born?", ["Lisbon"], DOCUMENT)
    starts = set()
    for seed in range(20):
        memory = answer_memory(record, tiny_tokenizer, _cfg(memory_tokens=400), random.Random(seed))
        assert memory.endswith("The author was born in Lisbon in 1901.") and "He left" not in memory
        starts.add(memory.split(".")[0])
    # from up to two sentences before the answer's (lines count as sentences: "Doc one" is one)
    assert starts == {"The city has a river", "It has a bridge", "The author was born in Lisbon in 1901"}
    for memory_tokens in (16, 24, 32):  # cut to what a memory turn passes on, the answer kept
        memory = answer_memory(record, tiny_tokenizer, _cfg(memory_tokens=memory_tokens), random.Random(0))
        assert gold_in_text(memory, ["Lisbon"]) and len(encode_text(tiny_tokenizer, memory)) <= memory_tokens - 1
    # 7 ids hold neither the head nor the tail of the answer's sentence with "Lisbon" (4 ids) whole
    assert answer_memory(record, tiny_tokenizer, _cfg(memory_tokens=8), random.Random(0)) is None


def test_an_answer_memory_record_is_seeded_and_none_without_an_answer_sentence(tiny_tokenizer):
    record = QuestionRecord("q", "Where was the author born?", ["Lisbon"], DOCUMENT, {"source": "x"})
    built = answer_memory_record(record, tiny_tokenizer, _cfg(), seed=3)
    assert built == answer_memory_record(record, tiny_tokenizer, _cfg(), seed=3)
    assert (built.id, built.question, built.answers) == (record.id, record.question, record.answers)
    assert gold_in_text(built.context, ["Lisbon"]) and built.metadata["source"] == "x"
    for answers in (["Oslo"], ["yes"]):  # absent, or a yes/no answer (the word is no answer's sentence)
        assert answer_memory_record(QuestionRecord("r", "?", answers, DOCUMENT + " Yes."), tiny_tokenizer, _cfg(),
                                    seed=3) is None
