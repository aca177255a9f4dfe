"""The weight-sync canary (memrl/train/sync_check.py): the trainer's and the engine's scores of a fixed probe
agree after every sync, on the synchronous loop and the overlapped pipeline; an engine left on older
weights is caught at the next sync, with the weight version named."""

import asyncio
import math
import sys
from pathlib import Path

import pytest

from memrl.engines.base import ScoreResult, SyncProbe
from memrl.engines.factory import build_engine
from memrl.tiny import build_tiny_model
from memrl.train.actor import Actor
from memrl.train.controller import TrainingError
from memrl.train.sync_check import CONTINUATION_TOKENS, PROMPT_TOKENS, check_sync, default_atol, probe_ids

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_controller import config, make_trainer, read_metrics, tokenizer  # noqa: E402, F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def probe(log_probs, dtype="float32", version=3):
    return SyncProbe(prompt_ids=[1, 2], continuation_ids=list(range(len(log_probs))), temperature=1.0,
                     log_probs=log_probs, version=version, dtype=dtype, layers=2, width=128)


def test_a_difference_beyond_the_tolerance_names_both_values_and_the_version():
    reference = probe([-1.0, -2.0])
    assert check_sync(reference, {"e": ScoreResult([-1.0, -2.0005], "float32")}, atol=1e-3) == pytest.approx(5e-4)
    with pytest.raises(TrainingError, match=r"weight version 3, e scores the probe at \[-1.0, -2.1\] where the "
                                            r"trainer has \[-1.0, -2.0\]: max \|difference\| 0.1 > tolerance 0.001"):
        check_sync(reference, {"e": ScoreResult([-1.0, -2.1], "float32")}, atol=1e-3)
    with pytest.raises(TrainingError, match="max \\|difference\\| nan"):  # a NaN never passes
        check_sync(reference, {"e": ScoreResult([math.nan, -2.0], "float32")}, atol=1e-3)
    with pytest.raises(TrainingError, match="scored 1 log-probs for the probe's 2"):
        check_sync(reference, {"e": ScoreResult([-1.0], "float32")}, atol=1e-3)


def test_the_default_tolerance_follows_the_coarser_dtype_and_the_model_size():
    fp32 = default_atol(probe([0.0]), "float32")
    assert default_atol(probe([0.0], dtype="bfloat16"), "float32") == default_atol(probe([0.0]), "bfloat16") > fp32
    assert default_atol(probe([0.0]), "float16") < default_atol(probe([0.0]), "bfloat16")
    deeper = SyncProbe([1], [2], 1.0, [0.0], 0, "float32", layers=20, width=128)
    assert default_atol(deeper, "float32") > fp32
    with pytest.raises(TrainingError, match="set train.sync_check_atol"):
        default_atol(probe([0.0]), "int8")


def test_the_probe_is_fixed_ordinary_tokens(tokenizer):  # noqa: F811
    prompt, continuation = probe_ids(tokenizer)
    assert (len(prompt), len(continuation)) == (PROMPT_TOKENS, CONTINUATION_TOKENS)
    assert (prompt, continuation) == probe_ids(tokenizer)
    assert not set(prompt + continuation) & set(tokenizer.all_special_ids)
    assert all(0 <= t < len(tokenizer) for t in prompt + continuation)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_engine_scores_the_probe_as_the_trainer_does(tokenizer, temperature):  # noqa: F811
    # The two sides of the canary on the same weights: HFEngine.score (one forward of the engine's copy) and
    # Actor.sync_probe (the old-log-prob path) agree within the default float32 tolerance, at the run's
    # temperature; scored at another temperature they would not.
    cfg = config()
    cfg.sampling.temperature = temperature
    model = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    actor = Actor(model, cfg, pad_token_id=tokenizer.pad_token_id)
    engine = build_engine(cfg, model=actor.model, tokenizer=tokenizer)
    prompt, continuation = probe_ids(tokenizer)
    reference = actor.sync_probe(prompt, continuation, version=0)
    scored = asyncio.run(engine.score(prompt, continuation, temperature))
    assert reference.dtype == scored.dtype == "float32" and (reference.layers, reference.width) == (1, 64)
    assert check_sync(reference, {"engine": scored}, atol=None) <= default_atol(reference, "float32")
    other = asyncio.run(engine.score(prompt, continuation, temperature + 0.5))
    with pytest.raises(TrainingError, match="weight version 0"):
        check_sync(reference, {"engine": other}, atol=None)


def checked_versions(trainer):
    """Spy: the weight versions whose probe the engine was asked to score."""
    versions, real = [], trainer.parts.rollout.score_probe

    def spy(probe):
        versions.append(probe.version)
        return real(probe)

    trainer.parts.rollout.score_probe = spy
    return versions


def test_the_synchronous_loop_checks_the_start_and_every_sync(tokenizer, tmp_path):  # noqa: F811
    trainer = make_trainer(tokenizer, tmp_path / "run", config(num_rollout=2))
    versions = checked_versions(trainer)
    trainer.run()
    assert versions == [0, 1, 2]  # the starting weights, then after steps 0 and 1
    for m in read_metrics(tmp_path / "run"):  # logged: what the engine differed by, and what the check cost
        assert m["sync_check/max_abs_diff"] >= 0 and m["time/sync_check_s"] > 0


def frozen_engine(trainer):
    """The rollout engine keeps its weights whatever it is synced to (a sync that silently does nothing)."""
    trainer.parts.rollout.engine.load_weights = lambda weights: None


def test_an_engine_that_did_not_take_the_weights_is_caught_at_the_next_sync(tokenizer, tmp_path):  # noqa: F811
    trainer = make_trainer(tokenizer, tmp_path / "run", config(num_rollout=2))
    frozen_engine(trainer)
    with pytest.raises(TrainingError, match="at weight version 1, the rollout engine"):
        trainer.run()
    assert not (tmp_path / "run" / "logs" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")  # no step
    # With the canary off the same run goes on, sampling with the starting weights all along.
    off = config(num_rollout=2)
    off.train.sync_check = False
    unchecked = make_trainer(tokenizer, tmp_path / "off", off)
    frozen_engine(unchecked)
    assert len(unchecked.run()) == 2


def overlapped(tokenizer, run_root):  # noqa: F811
    cfg = config(num_rollout=3, max_staleness=1, save_interval=10)
    cfg.queue.timeout_s = 60.0  # a failure must wake the trainer long before
    return make_trainer(tokenizer, run_root, cfg)


def test_the_overlapped_pipeline_checks_every_version_the_engine_syncs_to(tokenizer, tmp_path):  # noqa: F811
    trainer = overlapped(tokenizer, tmp_path / "run")
    versions = checked_versions(trainer)
    history = trainer.run()
    assert [m["pipeline/staleness"] for m in history] == [0, 1, 1]
    assert versions == [0, 1]  # the starting weights; version 1, which rollout 2 samples with
    assert ["time/sync_check_s" in m for m in history] == [True, False, False]  # version 1 published at step 0


def test_the_overlapped_pipeline_catches_an_engine_left_on_a_stale_version(tokenizer, tmp_path):  # noqa: F811
    trainer = overlapped(tokenizer, tmp_path / "run")
    frozen_engine(trainer)
    with pytest.raises(TrainingError, match="pipeline: rollout 2 failed: .*at weight version 1"):
        trainer.run()
