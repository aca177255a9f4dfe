"""The synthetic memory task: one answering fact among distractors that share entity or attribute,
whole facts per chunk, disjoint splits, demonstrations built with the rollout's own prompts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from memrl.config import load_config
from memrl.data.records import load_questions
from memrl.data.synthetic import (
    ATTRIBUTES,
    FACT_TOKENS,
    SyntheticTaskError,
    TaskSpec,
    demonstration_turns,
    make_splits,
    prepare_synthetic,
    task_tokenizer,
)
from memrl.memagent.prompts import PromptBuilder
from memrl.memagent.rollout import document_chunks
from memrl.scoring import reward_from_text

SPEC = TaskSpec(max_chunks=3, facts_per_chunk=3)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.fixture(scope="module")
def rollout_cfg():
    # The toy recipe's rollout section (chunk_tokens 21, max_chunks 3, short templates).
    return load_config(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml").rollout


def test_exactly_one_fact_answers_and_every_distractor_shares_one_key():
    train, _ = make_splits(300, 0, SPEC, seed=1)
    for r in train:
        m = r.metadata
        facts = [tuple(f) for f in m["facts"]]
        assert len(facts) == m["num_chunks"] * SPEC.facts_per_chunk
        assert 1 <= m["num_chunks"] <= SPEC.max_chunks
        answering = [f for f in facts if f[0] == m["attribute"] and f[1] == m["entity"]]
        assert answering == [facts[m["answer_index"]]] and answering[0][2] == r.answers[0]
        for a, e, v in facts:
            assert (a == m["attribute"]) != (e == m["entity"]) or (a, e) == (m["attribute"], m["entity"])
            if a == m["attribute"] and e != m["entity"]:
                assert v != r.answers[0]  # a same-attribute distractor never carries the answer
        assert len({(a, e) for a, e, _ in facts}) == len(facts)
    # Both kinds of distractor occur, and the answer chunk is spread over positions.
    assert len({r.metadata["answer_chunk"] for r in train}) == SPEC.max_chunks


def test_splits_are_deterministic_and_disjoint():
    a_train, a_held = make_splits(200, 100, SPEC, seed=3)
    b_train, b_held = make_splits(200, 100, SPEC, seed=3)
    assert [r.to_dict() for r in a_train + a_held] == [r.to_dict() for r in b_train + b_held]
    assert not {(r.question, r.context) for r in a_train} & {(r.question, r.context) for r in a_held}
    c_train, _ = make_splits(200, 0, SPEC, seed=4)
    assert [r.context for r in c_train] != [r.context for r in a_train]


def test_chunks_hold_whole_facts(tokenizer, rollout_cfg):
    train, _ = make_splits(50, 0, SPEC, seed=0)
    for r in train:
        chunks = document_chunks(tokenizer, rollout_cfg, r.context)
        assert chunks.num_chunks == r.metadata["num_chunks"] and not chunks.truncated
        assert all(len(c) == FACT_TOKENS * SPEC.facts_per_chunk for c in chunks.chunks)
        assert tokenizer.unk_token_id not in [t for c in chunks.chunks for t in c]


def test_demonstrations_keep_the_fact_at_the_rate_asked(tokenizer, rollout_cfg):
    builder = PromptBuilder(tokenizer, rollout_cfg)
    train, _ = make_splits(400, 0, SPEC, seed=2)
    for keep_prob, low, high in ((1.0, 1.0, 1.0), (0.5, 0.4, 0.6), (0.0, 0.0, 0.3)):
        rng, correct = random.Random(0), 0
        for r in train:
            turns = demonstration_turns(r, tokenizer, builder, rollout_cfg, keep_prob, rng)
            assert len(turns) == r.metadata["num_chunks"] + 1
            for prompt, response in turns:
                assert response[-1] == tokenizer.eos_token_id and len(prompt) > 0
            answer = tokenizer.decode(turns[-1][1], skip_special_tokens=True)
            correct += reward_from_text(answer, r.answers)
        # keep 0: only a guess among 6 values is right (~1/6).
        assert low <= correct / len(train) <= high, (keep_prob, correct / len(train))


def test_an_abstaining_reader_answers_only_from_its_memory(tokenizer, rollout_cfg):
    builder = PromptBuilder(tokenizer, rollout_cfg)
    train, _ = make_splits(300, 0, SPEC, seed=6)
    rng, kept = random.Random(0), 0
    for r in train:
        turns = demonstration_turns(r, tokenizer, builder, rollout_cfg, 0.5, rng, unknown_answer="abstain")
        memory = tokenizer.decode(turns[-2][1], skip_special_tokens=True)
        answer = tokenizer.decode(turns[-1][1], skip_special_tokens=True)
        # Right exactly when the memory kept the fact; otherwise the boxed answer is "unknown".
        has_fact = memory.endswith(f"is {r.answers[0]}.")
        assert reward_from_text(answer, r.answers) == float(has_fact)
        assert has_fact or "unknown" in answer
        kept += has_fact
    assert 0.4 <= kept / len(train) <= 0.6
    with pytest.raises(SyntheticTaskError, match="unknown_answer"):
        demonstration_turns(train[0], tokenizer, builder, rollout_cfg, 0.5, rng, unknown_answer="maybe")


def test_demonstration_prompts_are_the_rollout_prompts(tokenizer, rollout_cfg):
    builder = PromptBuilder(tokenizer, rollout_cfg)
    (r,), _ = make_splits(1, 0, TaskSpec(max_chunks=1), seed=0)
    turns = demonstration_turns(r, tokenizer, builder, rollout_cfg, 1.0, random.Random(0))
    chunk = document_chunks(tokenizer, rollout_cfg, r.context).chunks[0]
    assert turns[0][0] == builder.memory_prompt_ids(r.question, None, chunk)
    memory = turns[0][1][:-1]
    assert tokenizer.decode(memory) == f"the {r.metadata['attribute']} of {r.metadata['entity']} is {r.answers[0]}."
    assert turns[1][0] == builder.final_prompt_ids(r.question, memory)


def test_wrong_chunk_size_is_refused(tokenizer, rollout_cfg):
    builder = PromptBuilder(tokenizer, rollout_cfg)
    (r,), _ = make_splits(1, 0, SPEC, seed=0)
    bad = rollout_cfg.model_copy(update={"chunk_tokens": 20})
    with pytest.raises(SyntheticTaskError, match="chunk_tokens must be 21"):
        demonstration_turns(r, tokenizer, builder, bad, 1.0, random.Random(0))


def test_task_spec_refuses_impossible_documents():
    with pytest.raises(SyntheticTaskError, match="distractors"):
        TaskSpec(max_chunks=20, facts_per_chunk=3).check()


def test_prepare_writes_verified_files(tmp_path):
    paths = prepare_synthetic(tmp_path, num_train=20, num_heldout=10, seed=5)
    assert len(load_questions(paths["train"])) == 20 and len(load_questions(paths["heldout"])) == 10
    assert (tmp_path / "manifest.json").is_file()
    assert set(ATTRIBUTES)  # vocabulary sanity


def test_prepare_data_synthetic_command(tmp_path):
    from typer.testing import CliRunner

    from memrl.cli import app

    out = tmp_path / "syn"
    result = CliRunner().invoke(app, ["prepare-data", "synthetic", "--out", str(out), "--num-train", "6",
                                      "--num-heldout", "3", "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert result.output.split() == [str(out / "synthetic_train.jsonl"), str(out / "synthetic_heldout.jsonl")]
    assert len(load_questions(out / "synthetic_train.jsonl")) == 6
    # A task it cannot build is the user's to fix: one line, exit 2 (memrl.cli's handler), no traceback.
    result = CliRunner().invoke(app, ["prepare-data", "synthetic", "--out", str(tmp_path / "bad"),
                                      "--max-chunks", "20"])
    assert result.exit_code == 2 and result.output.startswith("error: ") and "distractors" in result.output
