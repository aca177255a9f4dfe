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
    make_splits,
    prepare_synthetic,
    task_tokenizer,
)
from memrl.memagent.demonstrations import demonstration_turns
from memrl.memagent.prompts import PromptBuilder
from memrl.memagent.rollout import document_chunks
from memrl.scoring import reward_from_text

SPEC = TaskSpec(max_chunks=3, facts_per_chunk=3)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.fixture(scope="module")
def task_cfg():
    # The toy recipe's task section (chunk_tokens 21, max_chunks 3, short templates).
    return load_config(Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml").task


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


def test_chunks_hold_whole_facts(tokenizer, task_cfg):
    train, _ = make_splits(50, 0, SPEC, seed=0)
    for r in train:
        chunks = document_chunks(tokenizer, task_cfg, r.context)
        assert chunks.num_chunks == r.metadata["num_chunks"] and not chunks.truncated
        assert all(len(c) == FACT_TOKENS * SPEC.facts_per_chunk for c in chunks.chunks)
        assert tokenizer.unk_token_id not in [t for c in chunks.chunks for t in c]


def test_demonstrations_keep_the_fact_at_the_rate_asked(tokenizer, task_cfg):
    builder = PromptBuilder(tokenizer, task_cfg)
    train, _ = make_splits(400, 0, SPEC, seed=2)
    for keep_prob, low, high in ((1.0, 1.0, 1.0), (0.5, 0.4, 0.6), (0.0, 0.0, 0.3)):
        rng, correct = random.Random(0), 0
        for r in train:
            turns = demonstration_turns(r, tokenizer, builder, task_cfg, keep_prob, rng)
            assert len(turns) == r.metadata["num_chunks"] + 1
            for prompt, response in turns:
                assert response[-1] == tokenizer.eos_token_id and len(prompt) > 0
            answer = tokenizer.decode(turns[-1][1], skip_special_tokens=True)
            correct += reward_from_text(answer, r.answers)
        # keep 0: only a guess among 6 values is right (~1/6).
        assert low <= correct / len(train) <= high, (keep_prob, correct / len(train))


def test_an_abstaining_reader_answers_only_from_its_memory(tokenizer, task_cfg):
    builder = PromptBuilder(tokenizer, task_cfg)
    train, _ = make_splits(300, 0, SPEC, seed=6)
    rng, kept = random.Random(0), 0
    for r in train:
        turns = demonstration_turns(r, tokenizer, builder, task_cfg, 0.5, rng, unknown_answer="abstain")
        memory = tokenizer.decode(turns[-2][1], skip_special_tokens=True)
        answer = tokenizer.decode(turns[-1][1], skip_special_tokens=True)
        # Right exactly when the memory kept the fact; otherwise the boxed answer is "unknown".
        has_fact = memory.endswith(f"is {r.answers[0]}.")
        assert reward_from_text(answer, r.answers) == float(has_fact)
        assert has_fact or "unknown" in answer
        kept += has_fact
    assert 0.4 <= kept / len(train) <= 0.6
    with pytest.raises(SyntheticTaskError, match="unknown_answer"):
        demonstration_turns(train[0], tokenizer, builder, task_cfg, 0.5, rng, unknown_answer="maybe")


def test_demonstration_prompts_are_the_rollout_prompts(tokenizer, task_cfg):
    builder = PromptBuilder(tokenizer, task_cfg)
    (r,), _ = make_splits(1, 0, TaskSpec(max_chunks=1), seed=0)
    turns = demonstration_turns(r, tokenizer, builder, task_cfg, 1.0, random.Random(0))
    chunk = document_chunks(tokenizer, task_cfg, r.context).chunks[0]
    assert turns[0][0] == builder.memory_prompt_ids(r.question, None, chunk)
    memory = turns[0][1][:-1]
    assert tokenizer.decode(memory) == f"the {r.metadata['attribute']} of {r.metadata['entity']} is {r.answers[0]}."
    assert turns[1][0] == builder.final_prompt_ids(r.question, memory)


def test_wrong_chunk_size_is_refused(tokenizer, task_cfg):
    builder = PromptBuilder(tokenizer, task_cfg)
    (r,), _ = make_splits(1, 0, SPEC, seed=0)
    bad = task_cfg.model_copy(update={"chunk_tokens": 20})
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


# ---- long documents (the length-generalization demo) ----------------------------------------------------
def test_default_generation_is_unchanged_bit_for_bit():
    # The demo's data (and so its figures) depend on this stream: pinned to the SHA-256 of the records
    # the generator made before long documents existed.
    import hashlib
    import json

    train, heldout = make_splits(2000, 200, TaskSpec(), seed=0)
    digest = hashlib.sha256(json.dumps([r.to_dict() for r in train + heldout], sort_keys=True).encode()).hexdigest()
    assert digest == "7d5ef82e93a2c41e2f059864a65f2172e91c3d36501a767e597e2fec4a1c275e"


@pytest.mark.parametrize("num_chunks", [1, 2, 8, 64])
def test_long_documents_have_one_answer_few_related_distractors_and_unrelated_filler(num_chunks):
    from memrl.data.synthetic import make_length_set

    records = make_length_set(40, num_chunks, seed=1, related=8)
    for r in records:
        m = r.metadata
        facts = [tuple(f) for f in m["facts"]]
        assert len(facts) == num_chunks * 3 == m["num_chunks"] * 3
        answering = [f for f in facts if f[:2] == (m["attribute"], m["entity"])]
        assert answering == [facts[m["answer_index"]]] and answering[0][2] == r.answers[0]
        related = [f for f in facts if (f[0] == m["attribute"]) != (f[1] == m["entity"])]
        filler = [f for f in facts if f[0] != m["attribute"] and f[1] != m["entity"]]
        assert len(related) == m["related_distractors"] == min(8, len(facts) - 1)
        assert len(filler) == m["filler_facts"] == len(facts) - 1 - len(related)
        assert all(v != r.answers[0] for a, _, v in related if a == m["attribute"])
        assert m["answer_chunk"] == m["answer_index"] // 3
    # Positions spread evenly: question i sits at (i + 0.5) / n of its document.
    assert [r.metadata["answer_position"] for r in records] == [(i + 0.5) / 40 for i in range(40)]
    assert [r.metadata["answer_index"] for r in records] == [round((i + 0.5) / 40 * (num_chunks * 3 - 1))
                                                             for i in range(40)]


def test_padded_training_documents_start_with_nothing_about_the_question_far_more_often():
    # memrl demo-long's training task: max_chunks chunks, PADDED_RELATED related distractors, filler for the
    # rest, the answer anywhere; its point is filler chunks before the first fact of the question's attribute.
    from memrl.data.synthetic import PADDED_RELATED

    def filler_chunks_first(records):
        return sum(next(i for i, f in enumerate(r.metadata["facts"]) if f[0] == r.metadata["attribute"]) // 3
                   for r in records) / len(records)

    padded, heldout = make_splits(600, 50, TaskSpec(max_chunks=4, filler=True), seed=0)
    for r in padded + heldout:
        m = r.metadata
        facts = [tuple(f) for f in m["facts"]]
        assert m["num_chunks"] == 4 and len(facts) == 12
        assert [f for f in facts if f[:2] == (m["attribute"], m["entity"])] == [facts[m["answer_index"]]]
        assert PADDED_RELATED[0] <= m["related_distractors"] <= PADDED_RELATED[1]
        assert m["filler_facts"] == 11 - m["related_distractors"]
    assert {r.metadata["answer_index"] for r in padded} == set(range(12))
    assert {r.metadata["related_distractors"] for r in padded} == set(range(PADDED_RELATED[0], PADDED_RELATED[1] + 1))
    short = make_splits(600, 0, TaskSpec(), seed=0)[0]
    assert filler_chunks_first(padded) > 1.0 > 0.2 > filler_chunks_first(short)
    assert make_splits(600, 50, TaskSpec(max_chunks=4, filler=True), seed=0) == (padded, heldout)
    one = make_splits(5, 0, TaskSpec(max_chunks=1, facts_per_chunk=1, filler=True), seed=0)[0]
    assert all(r.metadata["num_chunks"] == 1 and r.metadata["related_distractors"] == 0 for r in one)


def test_long_filler_runs_through_every_unrelated_key_before_repeating():
    from memrl.data.synthetic import make_long_record

    r = make_long_record(random.Random(0), "x", num_chunks=64, position=0.5, related=0)
    filler = [tuple(f[:2]) for i, f in enumerate(r.metadata["facts"]) if i != r.metadata["answer_index"]]
    # 191 filler facts over the 4 x 11 = 44 unrelated keys: each key 4 or 5 times.
    counts = {k: filler.count(k) for k in set(filler)}
    assert len(counts) == 44 and set(counts.values()) <= {4, 5}


def test_length_sets_are_deterministic_per_length_and_exclude_training_documents():
    from memrl.data.synthetic import make_length_set

    a, b = make_length_set(30, 8, seed=2), make_length_set(30, 8, seed=2)
    assert [r.to_dict() for r in a] == [r.to_dict() for r in b]
    assert [r.context for r in make_length_set(30, 8, seed=3)] != [r.context for r in a]
    one = make_length_set(50, 1, seed=0)
    banned = {(one[0].question, one[0].context)}
    redrawn = make_length_set(50, 1, seed=0, exclude=banned)
    assert (redrawn[0].question, redrawn[0].context) not in banned and redrawn[0].metadata["answer_position"] == 0.01


def test_long_record_refuses_bad_parameters():
    from memrl.data.synthetic import make_long_record

    for kwargs, match in (({"num_chunks": 0, "position": 0.5}, "num_chunks"),
                          ({"num_chunks": 4, "position": 1.5}, "position"),
                          ({"num_chunks": 4, "position": 0.5, "related": 99}, "related")):
        with pytest.raises(SyntheticTaskError, match=match):
            make_long_record(random.Random(0), "x", **kwargs)


def test_long_documents_chunk_into_whole_facts_and_demonstrate(tokenizer, task_cfg):
    from memrl.data.synthetic import make_length_set

    cfg = task_cfg.model_copy(update={"max_chunks": 64})
    builder = PromptBuilder(tokenizer, cfg)
    for r in make_length_set(5, 64, seed=0):
        chunks = document_chunks(tokenizer, cfg, r.context)
        assert chunks.num_chunks == 64 and not chunks.truncated
        turns = demonstration_turns(r, tokenizer, builder, cfg, 1.0, random.Random(0))
        assert len(turns) == 65
        answer = tokenizer.decode(turns[-1][1], skip_special_tokens=True)
        assert reward_from_text(answer, r.answers) == 1.0
