"""End-to-end training loop on a tiny model (CPU, fp32): row counts, resume, replay, weight sync."""

import asyncio
import dataclasses
import json
import threading

import pytest
import torch

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.engines.base import GenerationRequest
from memrl.memagent.task import MemAgentTask, convert_trajectories
from memrl.rollout import RewardError
from memrl.tiny import build_tiny_model, build_tiny_tokenizer
from memrl.train.checkpoint import list_checkpoints
from memrl.train.controller import Trainer, TrainingError, TrainOptions, check_trainable
from memrl.train.sources import ReplayRollout, load_raw_rollout
from memrl.types import RolloutOutput, Trajectory

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def records(n=6):
    # ~3 chunks of 24 tokens each with the byte-level tiny tokenizer: 3 memory turns + 1 final turn.
    out = []
    for k in range(n):
        text = " ".join(f"Document {j}: fact{k}{j} is the capital of France." for j in range(4))
        out.append(QuestionRecord(id=f"q{k}", question=f"What is fact{k}?", answers=["Paris"], context=text,
                                  metadata={}))
    return out


def parity_reward(traj, golds):
    """A reward that varies within a group even for a random model (the real one is 0 for all)."""
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


def config(**train):
    return Config.model_validate({
        "plugins": {"reward_function": f"{__name__}:parity_reward"},
        "task": {"chunk_tokens": 24, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 3},
        "sampling": {"n_samples": 8, "temperature": 1.0},
        "engine": {"max_batch_size": 1},
        "algorithm": {"kl_coef": 0.01},
        "train": {"lr": 1e-3, "num_rollout": 2, "rollout_batch_size": 1, "save_interval": 1, **train},
        "queue": {"train_sample_expansion_factor": 4},
    })


def make_trainer(tokenizer, run_root, cfg, **opts):
    model = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0,
                             eos_token_id=tokenizer.eos_token_id)
    return Trainer(cfg, TrainOptions(run_root=run_root, progress=False, **opts), model=model, tokenizer=tokenizer,
                   records=records())


def read_metrics(run_root):
    return [json.loads(line) for line in (run_root / "logs" / "metrics.jsonl").read_text().splitlines()]


# StageTimer ("time/" + stage + "_s") around each stage of Trainer.step.
STAGE_TIMES = ("time/rollout_s", "time/convert_s", "time/train_s", "time/sync_s")


def assert_stage_times(metrics):
    """Pitfall "Prompt-heavy actor update" (docs/design.md: "measure where step time goes"): every step says how
    long each of its stages took."""
    for key in STAGE_TIMES:
        assert isinstance(metrics.get(key), float) and metrics[key] >= 0, (key, metrics.get(key))
    assert metrics["time/rollout_s"] > 0  # generating 32 turns with a model takes measurable time


def test_two_step_smoke_run_counts_rows_and_resumes(tokenizer, tmp_path):
    run_root = tmp_path / "run"
    history = make_trainer(tokenizer, run_root, config()).run()
    assert len(history) == 2
    for m in history:
        # 1 question x 8 samples x (3 memory turns + 1 final) = 32 rows saved = transferred = consumed
        assert m["rows/saved"] == m["rows/transferred"] == m["rows/consumed"] == 32
        assert m["turns/mean"] == 4
        assert_stage_times(m)
    logged = read_metrics(run_root)
    assert len(logged) == 2
    for m, line in zip(history, logged, strict=True):  # the same numbers reach metrics.jsonl
        assert_stage_times(line)
        assert {k: line[k] for k in STAGE_TIMES} == {k: m[k] for k in STAGE_TIMES}
    assert history[1]["grad_norm"] > 0 and history[1]["loss/total"] != 0
    assert [p.name for p in list_checkpoints(run_root)] == ["iter_0000000", "iter_0000001"]
    assert list((run_root / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_root / "logs" / "rollouts" / "rollout_0000001.jsonl").is_file()
    assert json.loads((run_root / "reward_summary.json").read_text())
    resumed = make_trainer(tokenizer, run_root, config(num_rollout=3),
                           load=run_root / "checkpoints" / "iter_0000001").run()
    assert len(resumed) == 1 and resumed[0]["rows/consumed"] == 32
    assert_stage_times(resumed[0])
    assert [m["rollout_id"] for m in read_metrics(run_root)] == [0, 1, 2]


def test_the_time_budget_ends_the_run_when_another_step_would_not_fit(tokenizer, tmp_path):
    # A fake clock on which every step takes 10 s: with 25 s, step 1 ends at 20 s and a third step (10 s, the
    # longest so far) would end at 30 s, so the run ends after step 1 and checkpoints it as its last.
    run_root = tmp_path / "run"
    trainer = make_trainer(tokenizer, run_root, config(num_rollout=5, save_interval=10, time_budget_s=25))
    now, step = [0.0], trainer.step

    def ten_second_step(rollout_id, logger):
        now[0] += 10.0
        return step(rollout_id, logger)

    trainer.clock, trainer.step = (lambda: now[0]), ten_second_step
    assert len(trainer.run()) == 2
    assert [p.name for p in list_checkpoints(run_root)] == ["iter_0000001"]
    assert [m["rollout_id"] for m in read_metrics(run_root)] == [0, 1]
    # with overlap the next rollout would already be generating where the budget stops the run: refused at load
    with pytest.raises(ValueError, match="time_budget_s ends the run at a step boundary, but with train.max_stale"):
        config(num_rollout=5, time_budget_s=25, max_staleness=1)


def test_resume_is_exact(tokenizer, tmp_path):
    straight = make_trainer(tokenizer, tmp_path / "a", config(num_rollout=4, save_interval=2))
    straight.run()
    first = make_trainer(tokenizer, tmp_path / "b", config(num_rollout=2, save_interval=2))
    first.run()
    second = make_trainer(tokenizer, tmp_path / "b", config(num_rollout=4, save_interval=2),
                          load=tmp_path / "b" / "checkpoints" / "iter_0000001")
    assert second.parts.start_rollout_id == 2
    second.run()
    assert ([straight.parts.data.batch(k)[0].id for k in range(4)]
            == [second.parts.data.batch(k)[0].id for k in range(4)])
    a = read_metrics(tmp_path / "a")
    b = read_metrics(tmp_path / "b")
    assert [m["reward/mean"] for m in a] == [m["reward/mean"] for m in b]
    for (name, pa), pb in zip(straight.parts.policy.model.named_parameters(), second.parts.policy.model.parameters(),
                              strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)


def test_replay_trains_on_identical_rows(tokenizer, tmp_path):
    run_root = tmp_path / "run"
    make_trainer(tokenizer, run_root, config(), save_rollouts=True).run()
    cfg = config()
    saved = load_raw_rollout(run_root / "rollouts_raw", 1)
    replay = make_trainer(tokenizer, tmp_path / "replay", cfg, replay_rollouts=run_root / "rollouts_raw")
    assert isinstance(replay.parts.rollout, ReplayRollout)  # no engine, no generation at all
    captured = []
    original = replay.parts.policy.train_rollout
    replay.parts.policy.train_rollout = lambda rows, rid: (captured.append(rows), original(rows, rid))[1]
    history = replay.run()
    assert [m["rows/consumed"] for m in history] == [32, 32]
    assert [r.to_dict() for r in captured[1]] == [r.to_dict() for r in
                                                 convert_trajectories(saved.trajectories, cfg.algorithm, 1)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_uses_actor_weights_after_sync(tokenizer, tmp_path, temperature):
    from memrl.train.run_log import RunLogger
    from memrl.types import TrainRow

    cfg = config(num_rollout=1)
    cfg.sampling.temperature = temperature  # the trainer's log-probs must be under the same temperature
    trainer = make_trainer(tokenizer, tmp_path / "run", cfg)
    with RunLogger(tmp_path / "run", use_tensorboard=False) as logger:
        metrics = trainer.step(0, logger)  # the actor's weights change, then are synced into the engine
    assert metrics["grad_norm"] > 0
    prompt = tokenizer("Document 1: hello", add_special_tokens=False)["input_ids"]
    request = GenerationRequest(prompt, 6, temperature=temperature, seed=7)
    rollout = trainer.parts.rollout
    (result,) = rollout.loop.run_until_complete(rollout.engine.generate([request]))
    rollout.close()
    assert result.output_ids
    row = TrainRow(tokens=prompt + result.output_ids, response_length=len(result.output_ids),
                   loss_mask=[1] * len(result.output_ids), rollout_log_probs=result.log_probs, advantage=0.0,
                   group_id="g", trajectory_id="t", turn_index=0, rollout_id=0)
    (trainer_lp,) = trainer.parts.policy.log_probs([row])
    assert max(abs(a - b) for a, b in zip(trainer_lp, result.log_probs, strict=True)) <= 1e-4
    # and the synced weights are not the initial ones: the step changed the policy the engine samples from
    initial = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0)
    assert any(not torch.equal(a, b)
               for a, b in zip(initial.parameters(), rollout.engine.model.parameters(), strict=True))


def test_expanded_rollout_without_row_count_is_an_error(tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(tokenizer, tmp_path / "run", config())
    task = trainer.parts.rollout.task
    real = task.generate

    async def no_count(ctx, recs):
        out = await real(ctx, recs)
        out.train_row_count = None
        return out

    monkeypatch.setattr(task, "generate", no_count)
    with pytest.raises(TrainingError, match="no train_row_count"):
        trainer.run()


def test_top_p_below_one_is_warned_about(tokenizer, tmp_path, caplog):
    # The engine samples from the nucleus, the trainer scores under the full softmax: say so at start.
    cfg = config(num_rollout=1)
    cfg.sampling.top_p = 0.9
    with caplog.at_level("WARNING", logger="memrl.train"):
        make_trainer(tokenizer, tmp_path / "run", cfg)
    assert any("sampling.top_p = 0.9 < 1" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="memrl.train"):
        make_trainer(tokenizer, tmp_path / "run1", config(num_rollout=1))
    assert not any("top_p" in r.getMessage() for r in caplog.records)


def test_the_local_engine_times_requests_out_as_the_config_says(tokenizer):
    # Every wait has a timeout: the local engine's requests too (a stuck batch fails them, not the run's wait).
    from memrl.engines.factory import training_engine

    cfg = config()
    cfg.engine.request_timeout_s = 7.5
    engine = training_engine(cfg, build_tiny_model(len(tokenizer)), tokenizer)
    try:
        assert engine.request_timeout_s == 7.5
    finally:
        asyncio.run(engine.close())


def test_one_loop_the_ray_runtime_gives_it_parts():
    # The Ray runtime builds parts (ray_parts) for the one Trainer; it neither subclasses nor copies the loop.
    import inspect

    import memrl.distributed.runtime as runtime

    classes = [obj for _, obj in inspect.getmembers(runtime, inspect.isclass) if obj.__module__ == runtime.__name__]
    assert classes and not any(issubclass(c, Trainer) for c in classes)
    assert not any(hasattr(c, "step") or hasattr(c, "run") for c in classes)


def even_question_reward(traj, golds):
    """Parity on even-numbered questions, 0 on odd ones: odd questions' groups are all equal."""
    return parity_reward(traj, golds) if int(traj.metadata["question_id"][1:]) % 2 == 0 else 0.0


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_dynamic_sampling_trains_on_informative_groups_only(tokenizer, tmp_path, max_staleness, monkeypatch):
    """algorithm.filter_groups, on the synchronous loop and the overlapped pipeline: the trained groups all
    carry a signal, the step has rollout_batch_size of them, and the row ledger counts exactly their rows.
    Every generation batch is scored whole before the filter (the memory curve is the batch's, as on Ray)."""
    import memrl.train.sources as sources

    scored, real_convert = [], sources.convert_rollout
    monkeypatch.setattr(sources, "convert_rollout",
                        lambda out, *a: (scored.append({t.group_id for t in out.trajectories}),
                                         real_convert(out, *a))[1])
    cfg = config(rollout_batch_size=2, max_staleness=max_staleness)
    cfg.plugins.reward_function = f"{__name__}:even_question_reward"
    cfg.algorithm.filter_groups, cfg.algorithm.over_sampling_batch_size, cfg.algorithm.max_num_gen_batches = True, 2, 8
    trainer = make_trainer(tokenizer, tmp_path / "run", cfg)
    captured = []
    original = trainer.parts.policy.train_rollout
    trainer.parts.policy.train_rollout = lambda rows, rid: (captured.append(rows), original(rows, rid))[1]
    history = trainer.run()
    for rows, m in zip(captured, history, strict=True):
        groups = {}
        for r in rows:
            groups.setdefault(r.group_id, []).append(r.advantage)
        assert len(groups) == 2 and all(any(a != 0 for a in adv) for adv in groups.values())
        assert m["rows/consumed"] == m["rows/saved"] == 2 * 8 * 4
        assert m["dynamic_sampling/groups_kept"] == 2 and m["dynamic_sampling/reached_cap"] == 0
        # the step's batch holds one odd question (filtered) at least; its replacements come from extra chunks
        assert m["dynamic_sampling/groups_filtered_equal_reward"] >= 1
        assert m["dynamic_sampling/generation_batches"] >= 2
        assert 0 <= m["memory/gold_recall/turn_0"] <= 1  # logged every step, used as a reward or not
    assert any(":2:" in g or ":3:" in g for rows in captured for g in {r.group_id for r in rows})  # chunk slots
    trained = {r.group_id for rows in captured for r in rows}
    assert trained <= set().union(*scored) and set().union(*scored) - trained  # filtered groups were scored too


def parity_turn_reward(turn, trajectory, golds):
    return float(turn.response_ids[0] % 2 == 0)


def test_turn_rewards_give_every_turn_its_own_advantage(tokenizer, tmp_path):
    cfg = config(num_rollout=1)
    cfg.algorithm.turn_reward_function = f"{__name__}:parity_turn_reward"
    trainer = make_trainer(tokenizer, tmp_path / "run", cfg, save_rollouts=True)
    captured = []
    original = trainer.parts.policy.train_rollout
    trainer.parts.policy.train_rollout = lambda rows, rid: (captured.append(rows), original(rows, rid))[1]
    (m,) = trainer.run()
    assert m["rows/consumed"] == 32
    per_traj = {}
    for r in captured[0]:
        per_traj.setdefault(r.trajectory_id, []).append(r.advantage)
    # split credit alone gives a trajectory's turns one value; the turn rewards make them differ
    assert any(len(set(adv)) > 1 for adv in per_traj.values())
    saved = load_raw_rollout(tmp_path / "run" / "rollouts_raw", 0)
    assert ([r.to_dict() for r in captured[0]]
            == [r.to_dict() for r in convert_trajectories(saved.trajectories, cfg.algorithm, 0)])


class RewardAsAdvantageTask(MemAgentTask):
    """A converter with advantages of its own (the reward itself, no GRPO)."""

    def convert(self, trajectories, algorithm, rollout_id):
        reward = {t.trajectory_id: float(t.reward) for t in trajectories}
        return [dataclasses.replace(r, advantage=reward[r.trajectory_id], trajectory_advantage=reward[r.trajectory_id])
                for r in super().convert(trajectories, algorithm, rollout_id)]


def test_the_logs_show_the_advantages_the_converter_computed(tokenizer, tmp_path):
    """Nothing recomputes advantages for the logs: each trajectory's and each turn's are its rows'."""
    cfg = config(num_rollout=1)
    cfg.plugins.task = f"{__name__}:RewardAsAdvantageTask"
    make_trainer(tokenizer, tmp_path / "run", cfg).run()
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "logs" / "rollouts" / "rollout_0000000.jsonl").read_text().splitlines()]
    assert len(logged) == 8 and {r["reward"] for r in logged} == {0.0, 1.0}  # GRPO would give other values
    for record in logged:
        assert record["advantage"] == record["reward"]
        assert [t["advantage"] for t in record["turns"]] == [record["reward"]] * len(record["turns"])


class RowDroppingTask(MemAgentTask):
    def convert(self, trajectories, algorithm, rollout_id):
        return super().convert(trajectories, algorithm, rollout_id)[1:]


def test_a_converter_that_breaks_the_announced_row_count_stops_the_step_where_it_converts(tokenizer, tmp_path):
    cfg = config(num_rollout=1)
    cfg.plugins.task = f"{__name__}:RowDroppingTask"
    with pytest.raises(TrainingError, match="rollout 0: the converter produced 31 rows, the rollout announced 32"):
        make_trainer(tokenizer, tmp_path / "run", cfg).run()


def test_dynamic_sampling_resumes_exactly(tokenizer, tmp_path):
    """The further chunks are a pure function of the rollout id: a run resumed from a checkpoint draws the
    same questions, filters the same groups and ends with the same weights as one straight run."""
    def cfg(num_rollout):
        c = config(num_rollout=num_rollout, save_interval=2)
        c.plugins.reward_function = f"{__name__}:even_question_reward"
        c.algorithm.filter_groups, c.algorithm.max_num_gen_batches = True, 4
        return c

    straight = make_trainer(tokenizer, tmp_path / "a", cfg(4))
    straight.run()
    make_trainer(tokenizer, tmp_path / "b", cfg(2)).run()
    make_trainer(tokenizer, tmp_path / "b", cfg(4), load=tmp_path / "b" / "checkpoints" / "iter_0000001").run()
    keys = ("reward/mean", "dynamic_sampling/generation_batches", "dynamic_sampling/groups_kept", "rows/consumed")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [[m[k] for k in keys] for m in a] == [[m[k] for k in keys] for m in b]
    assert sum(m["dynamic_sampling/generation_batches"] for m in a) > 4  # some step drew further chunks
    # Built, not run: its weights are the checkpoint's (a run needs a step left after it, hence 5).
    resumed = make_trainer(tokenizer, tmp_path / "c", cfg(5), load=tmp_path / "b" / "checkpoints" / "iter_0000003")
    for (name, pa), pb in zip(straight.parts.policy.model.named_parameters(), resumed.parts.policy.model.parameters(),
                              strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)


def boolean_reward(traj, golds):
    return traj.turns[-1].response_ids[0] % 2 == 0  # a bool: float() made it 1.0 / 0.0 and trained on it


RELEASE_HUNG_REWARDS = threading.Event()


def hanging_reward(traj, golds):
    RELEASE_HUNG_REWARDS.wait(60)  # "hangs" far past the test's task.reward_timeout_s
    return 0.0


@pytest.fixture
def release_hung_rewards():
    RELEASE_HUNG_REWARDS.clear()
    yield
    RELEASE_HUNG_REWARDS.set()  # the abandoned reward calls end


@pytest.mark.parametrize("max_staleness", [0, 1])
@pytest.mark.parametrize(("reward", "words"), [
    ("boolean_reward", r"boolean_reward returned (True|False) \(bool\) for trajectory r0:0:q0:s"),
    ("hanging_reward", r"hanging_reward did not return within 0.5 s \(task.reward_timeout_s\)"),
])
def test_a_bad_reward_function_fails_the_step_in_both_loops(tokenizer, tmp_path, release_hung_rewards,
                                                             max_staleness, reward, words):
    # The synchronous loop raises the RewardError itself, the overlapped one names it (the producer's error).
    cfg = config(num_rollout=1, max_staleness=max_staleness)
    cfg.plugins.reward_function = f"{__name__}:{reward}"
    cfg.task.reward_timeout_s = 0.5
    with pytest.raises(RewardError if max_staleness == 0 else TrainingError, match=words):
        make_trainer(tokenizer, tmp_path / "run", cfg).run()
    assert not list_checkpoints(tmp_path / "run")  # nothing was trained


def test_a_step_with_nothing_to_train_names_its_failures_before_the_queue_sees_0_rows():
    def failed(k, error):
        return Trajectory(f"g:s{k}", "g", k, turns=[], status="failed", error=error)

    dropped = [failed(0, "memory turn 0: connection refused"), failed(1, "memory turn 0: connection refused"),
               failed(2, "final turn: timed out")]
    with pytest.raises(TrainingError, match="rollout 3: no trajectory to train on: 3 of 3 trajectories failed .*; "
                                            "first errors: memory turn 0: connection refused; final turn: timed out$"):
        check_trainable(3, RolloutOutput([], {}, 0, dropped=dropped))
    with pytest.raises(TrainingError, match="rollout 3: the generate function returned no trajectory"):
        check_trainable(3, RolloutOutput([], {}, 0))
