import asyncio
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine

from memrl.config import Config
from memrl.memagent.rollout import RolloutContext, generate_group, generate_rollout, request_seed
from memrl.rl.validate import validate_groups, validate_trajectory


def make_ctx(tokenizer, engine, **rollout):
    cfg = Config.model_validate({"rollout": {"chunk_tokens": 16, "memory_tokens": 8, "final_tokens": 6,
                                             "max_chunks": 3, "n_samples": 4, **rollout}})
    return RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, rollout_id=3,
                          reward_function=lambda traj, golds: float(traj.answer.strip() in golds), progress=False)


def word_ids(tokenizer):
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special][:200]


def record(qid="q1", n_words=20):
    text = " ".join(f"fact{k} is alpha{k}." for k in range(n_words))
    return SimpleNamespace(id=qid, question="What is fact3?", answers=["alpha3"], context=text)


def run(coro):
    return asyncio.run(coro)


def test_turn_structure_and_caps(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ctx = make_ctx(tiny_tokenizer, engine)
    rec = record()
    group = run(generate_group(ctx, rec))
    assert len(group) == 4
    n_chunks = group[0].metadata["chunks"]["num_chunks"]
    assert n_chunks == 3 and group[0].metadata["chunks"]["truncated"]
    for traj in group:
        validate_trajectory(traj)
        assert [t.kind for t in traj.turns] == ["memory"] * n_chunks + ["final"]
        assert [t.index for t in traj.turns] == list(range(n_chunks + 1))
        for t in traj.turns:
            limit = 8 if t.kind == "memory" else 6
            assert t.max_tokens == limit and 0 < t.response_length <= limit
            assert len(t.rollout_log_probs) == len(t.loss_mask) == t.response_length
        assert all(m <= 8 for m in traj.metadata["memory_lengths"])
        assert traj.group_id == "r3:q1" and traj.metadata["question_id"] == "q1"
        assert traj.reward in (0.0, 1.0)
    validate_groups(group)


def test_memory_turn_prompt_carries_previous_memory_and_final_prompt_no_chunk(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ctx = make_ctx(tiny_tokenizer, engine, n_samples=1)
    traj = run(generate_group(ctx, record()))[0]
    stop = set(ctx.builder.stop_token_ids)
    for prev, nxt in zip(traj.turns, traj.turns[1:], strict=False):
        memory = [t for t in prev.response_ids if t not in stop][:8]
        if len(memory) >= 2:
            assert any(nxt.prompt_ids[k:k + len(memory)] == memory for k in range(len(nxt.prompt_ids)))
    final = traj.turns[-1].prompt_ids
    chunk_ids = ctx.builder.tokenizer(record().context, add_special_tokens=False)["input_ids"]
    for k in range(0, len(chunk_ids) - 6, 3):
        window = chunk_ids[k:k + 6]
        assert not any(final[j:j + 6] == window for j in range(len(final)))


def test_empty_document_goes_straight_to_final_turn(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ctx = make_ctx(tiny_tokenizer, engine, n_samples=2)
    rec = SimpleNamespace(id="e", question="Q?", answers=["x"], context="")
    group = run(generate_group(ctx, rec))
    assert all([t.kind for t in traj.turns] == ["final"] for traj in group)


def test_one_failed_request_fails_only_its_trajectory_and_group(tiny_tokenizer):
    bad_seed = request_seed(4242, "3:1:q2", 1, 1)  # step 3, slot 1 = question q2, sample 1, turn 1
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id,
                        fail_when=lambda req: req.seed == bad_seed)
    ctx = make_ctx(tiny_tokenizer, engine)
    out = run(generate_rollout(ctx, [record("q1"), record("q2")]))
    assert {t.group_id for t in out.trajectories} == {"r3:0:q1"}
    failed = [t for t in out.dropped if t.status == "failed"]
    assert len(failed) == 1 and "injected failure" in failed[0].error and "memory turn 1" in failed[0].error
    assert len(out.dropped) == 4 and out.metrics["groups/dropped"] == 1.0
    assert out.train_row_count == sum(len(t.turns) for t in out.trajectories)


def test_seeded_rollout_is_deterministic(tiny_tokenizer):
    def once():
        engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
        return run(generate_rollout(make_ctx(tiny_tokenizer, engine), [record("q1"), record("q2")]))

    a, b = once(), once()
    assert [t.to_dict() for t in a.trajectories] == [t.to_dict() for t in b.trajectories]
    # different samples of a group are sampled differently
    assert len({tuple(t.turns[0].response_ids) for t in a.trajectories}) > 1


def test_trajectories_do_not_run_in_lockstep(tiny_tokenizer):
    """All trajectories of a step are in flight together: the engine sees many concurrent requests."""
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id, delay_s=0.01)
    ctx = make_ctx(tiny_tokenizer, engine)
    run(generate_rollout(ctx, [record("q1"), record("q2", n_words=3)]))
    assert engine.max_in_flight == 8


def test_engine_exception_is_recorded_not_raised(tiny_tokenizer):
    class Broken(FakeEngine):
        async def generate(self, requests):
            raise RuntimeError("boom")

    ctx = make_ctx(tiny_tokenizer, Broken([5], 2), n_samples=2)
    group = run(generate_group(ctx, record()))
    assert all(t.status == "failed" and "boom" in t.error and t.reward == 0.0 for t in group)


@pytest.mark.parametrize("n_words", [1, 40])
def test_row_count_equals_total_turns(tiny_tokenizer, n_words):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    out = run(generate_rollout(make_ctx(tiny_tokenizer, engine), [record("a", n_words), record("b", 5)]))
    assert out.train_row_count == sum(t.num_turns for t in out.trajectories)


def test_same_question_twice_in_a_batch_gets_two_groups(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    out = run(generate_rollout(make_ctx(tiny_tokenizer, engine), [record("q1"), record("q1")]))
    assert sorted({t.group_id for t in out.trajectories}) == ["r3:0:q1", "r3:1:q1"]
    validate_groups(out.trajectories)
