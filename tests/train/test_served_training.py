"""Training against a served engine: after each step the trainer saves its weights and the server reloads them."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.engines.base import EngineError
from memrl.engines.hf import HFEngine
from memrl.engines.server import create_app
from memrl.tiny import save_tiny_model
from memrl.train.controller import Trainer, TrainingError, TrainOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))
from test_server import serve_in_thread  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def parity_reward(traj, golds):
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


def test_served_engine_is_reloaded_with_the_trained_weights(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    served = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    records = [QuestionRecord(id="q0", question="Which city?", answers=["Paris"],
                              context="Document 1: Paris is the capital of France. " * 3, metadata={})]
    # As documented for training against memrl serve: the run root is the reload root (it does not
    # exist yet), and the served engine's config and tokenizer check every synced folder.
    run_root = tmp_path / "run"
    with serve_in_thread(create_app(served, "tiny", tokenizer=tok, reload_roots=[run_root])) as url:
        cfg = Config.model_validate({
            "engine": {"kind": "openai", "server_url": url},
            "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
            "sampling": {"n_samples": 4},
            "train": {"num_rollout": 1, "rollout_batch_size": 1, "lr": 1e-2, "save_interval": 10},
            "plugins": {"reward_function": f"{__name__}:parity_reward"},
        })
        trainer = Trainer(cfg, TrainOptions(run_root=run_root, progress=False),
                          model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records)
        history = trainer.run()
        assert history[0]["rows/consumed"] == history[0]["rows/saved"] > 0
        assert history[0]["grad_norm"] > 0
        trained = dict(trainer.parts.policy.model.named_parameters())
        reloaded = dict(served.model.named_parameters())
        initial = AutoModelForCausalLM.from_pretrained(model_dir)
        assert any(not torch.equal(p, trained[n]) for n, p in initial.named_parameters())
        for name, param in reloaded.items():
            torch.testing.assert_close(param, trained[name].detach(), atol=0, rtol=0, msg=name)


def test_a_resumed_run_first_syncs_the_served_engine_to_its_checkpoint(tmp_path):
    # The server still serves the base model; --load must make rollout 1 sample with the checkpoint's weights.
    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    records = [QuestionRecord(id="q0", question="Which city?", answers=["Paris"],
                              context="Document 1: Paris is the capital of France. " * 3, metadata={})]
    first = Trainer(Config.model_validate({
        "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
        "sampling": {"n_samples": 4},
        "train": {"num_rollout": 1, "rollout_batch_size": 1, "lr": 1e-2, "save_interval": 10},
        "plugins": {"reward_function": f"{__name__}:parity_reward"}}),
        TrainOptions(run_root=tmp_path / "run", progress=False),
        model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records)
    first.run()
    trained = {n: p.detach().clone() for n, p in first.parts.policy.model.named_parameters()}
    served = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")  # the base weights
    with serve_in_thread(create_app(served, "tiny", tokenizer=tok, reload_roots=[tmp_path / "run"])) as url:
        cfg = Config.model_validate({
            "engine": {"kind": "openai", "server_url": url},
            "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
            "sampling": {"n_samples": 4},
            "train": {"num_rollout": 2, "rollout_batch_size": 1, "lr": 1e-2, "save_interval": 10},  # 1 step left
            "plugins": {"reward_function": f"{__name__}:parity_reward"}})
        Trainer(cfg, TrainOptions(run_root=tmp_path / "run", progress=False, load=tmp_path / "run"),
                model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records)
        for name, param in served.model.named_parameters():  # synced before any rollout of the resumed run
            torch.testing.assert_close(param, trained[name], atol=0, rtol=0, msg=name)


def test_the_overlapped_pipeline_feeds_a_served_engine_one_folder_per_weight_version(tmp_path):
    # train.max_staleness=1 with engine.kind=openai: each published version is a folder of its own that
    # the server reloads before the rollouts that sample with it; the schedule and the samples are those of
    # the in-process engine's pipeline, and no version folder is left once the run ends.
    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    records = [QuestionRecord(id=f"q{k}", question="Which city?", answers=["Paris"],
                              context=f"Document {k}: Paris is the capital of France. " * 3, metadata={})
               for k in range(2)]

    def run(root, **engine):
        cfg = Config.model_validate({
            "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
            "sampling": {"n_samples": 4}, "engine": engine,
            "train": {"num_rollout": 3, "rollout_batch_size": 1, "lr": 1e-2, "save_interval": 10, "max_staleness": 1},
            "plugins": {"reward_function": f"{__name__}:parity_reward"}})
        return Trainer(cfg, TrainOptions(run_root=root, progress=False),
                       model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records).run()

    in_process = run(tmp_path / "local")
    served = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    reloads = []
    real_reload = served.reload_from_path

    def counting_reload(path):
        reloads.append(Path(path).name)
        return real_reload(path)

    served.reload_from_path = counting_reload
    with serve_in_thread(create_app(served, "tiny", tokenizer=tok, reload_roots=[tmp_path / "run"])) as url:
        history = run(tmp_path / "run", kind="openai", server_url=url)
    assert [m["pipeline/staleness"] for m in history] == [m["pipeline/staleness"] for m in in_process] == [0, 1, 1]
    assert [m["reward/mean"] for m in history] == [m["reward/mean"] for m in in_process]
    assert reloads == ["v0000001"]  # rollout 2 samples with version 1; rollouts 0 and 1 with the served model's
    assert not list((tmp_path / "run" / "weights_versions").iterdir())


def test_a_served_engine_that_does_not_reload_is_caught_at_the_next_step(tmp_path):
    # The weight-sync canary: the server answers every reload with success but keeps serving the starting
    # weights. The check before the first rollout passes (it does serve them); the one after step 0 stops
    # the run, naming weight version 1, before rollout 1 samples with stale weights.
    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    served = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    reloads = []
    served.reload_from_path = reloads.append  # "reloaded", weights unchanged
    records = [QuestionRecord(id="q0", question="Which city?", answers=["Paris"],
                              context="Document 1: Paris is the capital of France. " * 3, metadata={})]
    rollouts = []
    with serve_in_thread(create_app(served, "tiny", tokenizer=tok, reload_roots=[tmp_path / "run"])) as url:
        cfg = Config.model_validate({
            "engine": {"kind": "openai", "server_url": url},
            "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
            "sampling": {"n_samples": 4},
            "train": {"num_rollout": 2, "rollout_batch_size": 1, "lr": 1e-2, "save_interval": 10},
            "plugins": {"reward_function": f"{__name__}:parity_reward"}})
        trainer = Trainer(cfg, TrainOptions(run_root=tmp_path / "run", progress=False),
                          model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records)
        real_generate = trainer.parts.rollout.generate
        trainer.parts.rollout.generate = lambda rollout_id, *a, **kw: (rollouts.append(rollout_id),
                                                                       real_generate(rollout_id, *a, **kw))[1]
        with pytest.raises(TrainingError, match=r"at weight version 1, the rollout engine "
                                                r"\(OpenAIEngine\) scores the probe at .* > tolerance"):
            trainer.run()
    assert len(reloads) == 1 and rollouts == [0]  # asked to reload once; rollout 1 never generated


def test_a_server_that_cannot_score_fails_at_start_saying_how_to_train_without_the_canary(tmp_path):
    # vLLM's OpenAI server cannot score a given continuation: the run stops before its first rollout (not a
    # silent skip of the check). With train.sync_check=false it generates, then fails where vLLM must reload.
    from test_openai_client import vllm_like_app

    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    records = [QuestionRecord(id="q0", question="Which city?", answers=["Paris"],
                              context="Paris is the capital of France. " * 3, metadata={})]
    for check, error in ((True, "server kind 'vllm' .* set train.sync_check=false"), (False, "no reload endpoint")):
        completions = []
        with serve_in_thread(vllm_like_app("ok", completions)) as url:
            cfg = Config.model_validate({
                "engine": {"kind": "openai", "server_url": url},
                "task": {"chunk_tokens": 48, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 2},
                "sampling": {"n_samples": 4},
                "train": {"num_rollout": 1, "rollout_batch_size": 1, "save_interval": 10, "sync_check": check},
                "plugins": {"reward_function": f"{__name__}:parity_reward"}})
            trainer = Trainer(cfg, TrainOptions(run_root=tmp_path / f"run_{check}", progress=False),
                              model=AutoModelForCausalLM.from_pretrained(model_dir), tokenizer=tok, records=records)
            with pytest.raises(EngineError, match=error):
                trainer.run()
        assert bool(completions) is not check  # generated only without the check
