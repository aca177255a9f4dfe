import asyncio
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine

from memrl.config import Config
from memrl.engines.base import GenerationResult
from memrl.memagent.rollout import (
    builder_of,
    chunk_gold_hits,
    document_chunks,
    generate_group,
    rollout_metrics,
)
from memrl.memagent.task import MemAgentTask
from memrl.rl.validate import validate_groups, validate_trajectory
from memrl.rollout import GroupSlot, RolloutContext, request_seed


def make_ctx(tokenizer, engine, n_samples: int = 4):
    cfg = Config.model_validate({"task": {"chunk_tokens": 16, "memory_tokens": 8, "final_tokens": 6, "max_chunks": 3},
                                 "sampling": {"n_samples": n_samples}})
    return RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, rollout_id=3,
                          reward_function=lambda traj, golds: float(traj.answer.strip() in golds), progress=False)


def one_group(ctx, rec, n=None):
    """One group of `rec` keyed "<rollout_id>:<id>" (no slot), `n` samples (default sampling.n_samples)."""
    return generate_group(ctx, GroupSlot(0, rec, f"{ctx.rollout_id}:{rec.id}"), n or ctx.config.sampling.n_samples)


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
    group = run(one_group(ctx, rec))
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
    traj = run(one_group(ctx, record()))[0]
    stop = set(builder_of(ctx).stop_token_ids)
    for prev, nxt in zip(traj.turns, traj.turns[1:], strict=False):
        memory = [t for t in prev.response_ids if t not in stop][:8]
        if len(memory) >= 2:
            assert any(nxt.prompt_ids[k:k + len(memory)] == memory for k in range(len(nxt.prompt_ids)))
    final = traj.turns[-1].prompt_ids
    chunk_ids = builder_of(ctx).tokenizer(record().context, add_special_tokens=False)["input_ids"]
    for k in range(0, len(chunk_ids) - 6, 3):
        window = chunk_ids[k:k + 6]
        assert not any(final[j:j + 6] == window for j in range(len(final)))


def test_empty_document_goes_straight_to_final_turn(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ctx = make_ctx(tiny_tokenizer, engine, n_samples=2)
    rec = SimpleNamespace(id="e", question="Q?", answers=["x"], context="")
    group = run(one_group(ctx, rec))
    assert all([t.kind for t in traj.turns] == ["final"] for traj in group)


def test_one_failed_request_fails_only_its_trajectory_and_group(tiny_tokenizer):
    bad_seed = request_seed(4242, "3:1:q2", 1, 1)  # step 3, slot 1 = question q2, sample 1, turn 1
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id,
                        fail_when=lambda req: req.seed == bad_seed)
    ctx = make_ctx(tiny_tokenizer, engine)
    out = run(MemAgentTask().generate(ctx, [record("q1"), record("q2")]))
    assert {t.group_id for t in out.trajectories} == {"r3:0:q1"}
    failed = [t for t in out.dropped if t.status == "failed"]
    assert len(failed) == 1 and "injected failure" in failed[0].error and "memory turn 1" in failed[0].error
    assert len(out.dropped) == 4 and out.metrics["groups/dropped"] == 1.0
    assert out.train_row_count == sum(len(t.turns) for t in out.trajectories)


def test_seeded_rollout_is_deterministic(tiny_tokenizer):
    def once():
        engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
        return run(MemAgentTask().generate(make_ctx(tiny_tokenizer, engine), [record("q1"), record("q2")]))

    a, b = once(), once()
    assert [t.to_dict() for t in a.trajectories] == [t.to_dict() for t in b.trajectories]
    # different samples of a group are sampled differently
    assert len({tuple(t.turns[0].response_ids) for t in a.trajectories}) > 1


def test_trajectories_do_not_run_in_lockstep(tiny_tokenizer):
    """All trajectories of a step are in flight together: the engine sees many concurrent requests."""
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id, delay_s=0.01)
    ctx = make_ctx(tiny_tokenizer, engine)
    run(MemAgentTask().generate(ctx, [record("q1"), record("q2", n_words=3)]))
    assert engine.max_in_flight == 8


def test_engine_exception_is_recorded_not_raised(tiny_tokenizer):
    class Broken(FakeEngine):
        async def generate(self, requests):
            raise RuntimeError("boom")

    ctx = make_ctx(tiny_tokenizer, Broken([5], 2), n_samples=2)
    group = run(one_group(ctx, record()))
    assert all(t.status == "failed" and "boom" in t.error and t.reward == 0.0 for t in group)


@pytest.mark.parametrize("n_words", [1, 40])
def test_row_count_equals_total_turns(tiny_tokenizer, n_words):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    out = run(MemAgentTask().generate(make_ctx(tiny_tokenizer, engine), [record("a", n_words), record("b", 5)]))
    assert out.train_row_count == sum(t.num_turns for t in out.trajectories)


def test_same_question_twice_in_a_batch_gets_two_groups(tiny_tokenizer):
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    out = run(MemAgentTask().generate(make_ctx(tiny_tokenizer, engine), [record("q1"), record("q1")]))
    assert sorted({t.group_id for t in out.trajectories}) == ["r3:0:q1", "r3:1:q1"]
    validate_groups(out.trajectories)


# --- Scripted engine: each request answered by (question key, sample, turn) ---------------------------
class ScriptedEngine:
    """Answers every request from `respond(key, sample, turn)` and logs when each one starts and ends.

    The (key, sample, turn) of a request is read back from its seed (`request_seed` is public and stable);
    `key` is the rollout's seed key: "<rollout_id>:<record id>" for `one_group`,
    "<rollout_id>:<slot>:<record id>" for `MemAgentTask.generate`. `respond` may be a coroutine function.
    Requests of one `generate` call are served concurrently, so a batch waits for its slowest request.
    """

    def __init__(self, ctx, keys, respond, n_samples=1, max_turns=8):
        seed = ctx.config.sampling.seed
        self.turn_of = {request_seed(seed, key, s, t): (key, s, t)
                        for key in keys for s in range(n_samples) for t in range(max_turns)}
        self.respond = respond
        self.log = []  # ("start" | "end", key, turn), in the order they happened
        self.requests = {}  # (key, sample, turn) -> GenerationRequest

    async def generate(self, requests):
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, req):
        key, sample, turn = self.turn_of[req.seed]
        self.requests[key, sample, turn] = req
        self.log.append(("start", key, turn))
        out = self.respond(key, sample, turn)
        ids, reason = await out if asyncio.iscoroutine(out) else out
        self.log.append(("end", key, turn))
        return GenerationResult(list(ids), [-0.5] * len(ids), reason)

    async def close(self):
        pass


def contains_run(seq, run):
    return any(seq[k:k + len(run)] == run for k in range(len(seq) - len(run) + 1))


def test_empty_memory_update_replaces_the_old_memory(tiny_tokenizer):
    """Pitfall "Inconsistent memory updates" (docs/design.md): "an empty update that silently keeps the old memory
    (VIME)": the new memory always wins."""
    ctx = make_ctx(tiny_tokenizer, None, n_samples=1)
    rec = record()
    chunks = document_chunks(tiny_tokenizer, ctx.config.task, rec.context).chunks
    assert len(chunks) == 3
    eos = tiny_tokenizer.eos_token_id
    # The prompts the test expects once the memory is empty; turn 0's memory uses ids that occur in
    # neither, so finding any of them there can only mean the old memory leaked through.
    want_turn2 = builder_of(ctx).memory_prompt_ids(rec.question, [], chunks[2])
    unused = [i for i in word_ids(tiny_tokenizer)
              if i not in set(want_turn2) | set(builder_of(ctx).final_prompt_ids(rec.question, []))]
    memory0, memory2 = unused[:4], unused[4:5]
    want_final = builder_of(ctx).final_prompt_ids(rec.question, memory2)

    def respond(key, sample, turn):
        if turn == 0:
            return memory0 + [eos], "stop"
        if turn == 1:
            return [eos], "stop"  # only the end-of-turn token: the memory update is empty
        return memory2 + [eos], "stop"  # turn 2 writes a memory again; the final turn answers

    engine = ScriptedEngine(ctx, ["3:q1"], respond)
    ctx.engine = engine
    traj = run(one_group(ctx, rec))[0]
    assert traj.status == "complete" and [t.kind for t in traj.turns] == ["memory"] * 3 + ["final"]
    assert contains_run(engine.requests["3:q1", 0, 1].prompt_ids, memory0)  # turn 1 did see turn 0's memory
    no_memory = builder_of(ctx).tokenizer(ctx.config.task.no_memory_text, add_special_tokens=False)["input_ids"]
    got = engine.requests["3:q1", 0, 2].prompt_ids
    assert not set(memory0) & set(got), "turn 2 still carries turn 0's memory"
    assert not contains_run(got, no_memory), "turn 2 shows the no-memory text for an empty memory"
    assert got == want_turn2  # the empty memory renders as nothing (prompts.py: empty ids in the slot)
    # ... and the turn after it writes a memory again, which the final turn carries, and nothing older.
    assert engine.requests["3:q1", 0, 3].prompt_ids == want_final
    assert traj.metadata["memory_lengths"] == [4, 0, 1] and traj.metadata["final_memory_length"] == 1


def test_memory_truncations_are_counted(tiny_tokenizer):
    """Pitfall "Inconsistent memory updates" (docs/design.md): "truncations counted": a memory turn that ends by
    `length` is one truncation."""
    ctx = make_ctx(tiny_tokenizer, None, n_samples=2)  # memory_tokens = 8
    words, eos = word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id

    def respond(key, sample, turn):
        if turn == 0:
            return words[:7] + [eos], "stop"  # exactly 8 tokens but stopped: not a truncation
        if turn == 1:
            return words[:8], "length"  # hit memory_tokens: truncated
        if turn == 2:
            return words[:3] + [eos], "stop"
        return [words[0], eos], "stop"  # final turn

    ctx.engine = ScriptedEngine(ctx, ["3:0:q1"], respond, n_samples=2)
    out = run(MemAgentTask().generate(ctx, [record("q1")]))
    assert len(out.trajectories) == 2
    for traj in out.trajectories:
        assert traj.status == "complete"
        assert [t.finish_reason for t in traj.turns] == ["stop", "length", "stop", "stop"]
        assert traj.metadata["memory_truncations"] == 1
        assert traj.metadata["memory_lengths"] == [7, 8, 3]
    # 1 of 3 memory turns truncated in each of 2 trajectories: 2 of 6.
    assert out.metrics["truncation/memory_rate"] == pytest.approx(1 / 3)
    assert rollout_metrics(out.trajectories)["truncation/memory_rate"] == pytest.approx(1 / 3)
    assert out.metrics["truncation/final_rate"] == 0.0


@pytest.mark.timeout(60)
def test_a_short_trajectory_does_not_wait_for_a_slow_turn_of_another(tiny_tokenizer):
    """docs/design.md, pitfall "Lockstep turns": question B (one chunk) reaches its final turn while question A's first
    memory turn is still being generated. Under lockstep (every trajectory advances one turn per round,
    or every final turn waits for the longest document) B's final request would come only after A's slow
    turn ends. A's slow turn waits for B's final request, with a timeout so the test can never hang."""
    ctx = make_ctx(tiny_tokenizer, None, n_samples=1)
    rec_a, rec_b = record("qa"), record("qb", n_words=1)
    assert len(document_chunks(tiny_tokenizer, ctx.config.task, rec_b.context).chunks) == 1
    words, eos = word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id
    b_final_arrived = asyncio.Event()

    async def respond(key, sample, turn):
        if key == "3:1:qb" and turn == 1:
            b_final_arrived.set()
        if key == "3:0:qa" and turn == 0:
            try:  # a generous no-hang bound, not a timing assertion: lockstep ends here and then fails below
                await asyncio.wait_for(b_final_arrived.wait(), timeout=5.0)
            except TimeoutError:
                pass
        return [words[turn], eos], "stop"

    engine = ScriptedEngine(ctx, ["3:0:qa", "3:1:qb"], respond)
    ctx.engine = engine
    out = run(MemAgentTask().generate(ctx, [rec_a, rec_b]))
    assert [len(t.turns) for t in out.trajectories] == [4, 2] and not out.dropped
    log = engine.log
    assert log.index(("start", "3:1:qb", 1)) < log.index(("end", "3:0:qa", 0)), log


def test_rollout_records_the_gold_positions_the_search_finds(tiny_tokenizer):
    """What the logs and `memrl view` read (`chunk_golds`) is the search of the group's own chunks."""
    engine = FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id)
    ctx = make_ctx(tiny_tokenizer, engine)
    rec = SimpleNamespace(**{**vars(record(n_words=6)), "answers": ["alpha0", "alpha5"]})
    out = run(MemAgentTask().generate(ctx, [rec]))
    expected = chunk_gold_hits(tiny_tokenizer, document_chunks(tiny_tokenizer, ctx.config.task, rec.context),
                               rec.answers)
    assert any(expected) and [t.metadata["chunk_golds"] for t in out.trajectories] == [expected] * 4


@pytest.mark.timeout(120)
def test_the_gold_search_runs_once_per_group_off_the_event_loop(tiny_tokenizer, monkeypatch):
    """Once per group (its samples share the document), in another thread, and the group's requests go out
    while it runs: the spy holds the search until the engine has a request (a no-hang bound of 30 s, not a
    timing assertion; on the event loop the wait would block the very loop that sends requests)."""
    import threading

    from memrl.memagent import rollout

    loop_threads, calls, first_request = set(), [], threading.Event()
    search = rollout.chunk_gold_hits

    def spy(tokenizer, chunks, golds):
        calls.append((threading.get_ident(), first_request.wait(timeout=30.0)))
        return search(tokenizer, chunks, golds)

    class Engine(FakeEngine):
        async def generate(self, requests):
            loop_threads.add(threading.get_ident())
            first_request.set()
            return await super().generate(requests)

    monkeypatch.setattr(rollout, "chunk_gold_hits", spy)
    ctx = make_ctx(tiny_tokenizer, Engine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id))
    out = run(MemAgentTask().generate(ctx, [record("q1"), record("q2"), record("q3")]))
    assert len(out.trajectories) == 12 and len(calls) == 3  # 3 groups of 4 samples
    assert all(ok for _, ok in calls) and not {ident for ident, _ in calls} & loop_threads


class StopsSampleZero(MemAgentTask):
    """Sample 0 stops after its first memory turn; the others read on. Records what it was asked."""

    def __init__(self):
        self.asked = []

    async def keep_reading(self, ctx, group, traj):
        self.asked.append((traj.sample_index, [t.kind for t in traj.turns]))
        return traj.sample_index != 0


def test_the_task_decides_before_each_further_chunk_whether_to_keep_reading(tiny_tokenizer):
    from memrl.memagent.task import convert_trajectories

    ctx = make_ctx(tiny_tokenizer, FakeEngine(word_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id), n_samples=2)
    task = StopsSampleZero()
    stopped, read = run(task.sample_group(ctx, GroupSlot(0, record(), "3:q1"), 2))
    assert [t.kind for t in stopped.turns] == ["memory", "final"] and stopped.metadata["stopped_reading"]
    assert [t.kind for t in read.turns] == ["memory"] * 3 + ["final"] and "stopped_reading" not in read.metadata
    assert sorted(task.asked) == [(0, ["memory"]), (1, ["memory"]), (1, ["memory", "memory"])]  # not before chunk 0
    assert stopped.status != "failed" and len(stopped.metadata["memory_lengths"]) == 1
    validate_groups([stopped, read])
    assert len(convert_trajectories([stopped, read], ctx.config.algorithm, 0)) == 6  # its turn counts may differ
