"""The Ray runtime on a local CPU cluster: DDP parity with one process, faults, and a 2-step run.

One Ray instance for the module (starting Ray costs ~10 s); every test kills the actors it made.
"""

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from memrl.config import Config  # noqa: E402
from memrl.data.records import QuestionRecord  # noqa: E402
from memrl.distributed.rows import put_rows  # noqa: E402
from memrl.distributed.runtime import RolloutPool, TrainerGroup, _scheduling, run_ray_training  # noqa: E402
from memrl.distributed.workers import WorkerDiedError, WorkerError, WorkerTimeoutError, wait_named  # noqa: E402
from memrl.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from memrl.train.actor import Actor  # noqa: E402
from memrl.train.checkpoint import list_checkpoints  # noqa: E402
from memrl.train.controller import Trainer, TrainOptions  # noqa: E402
from memrl.types import TrainRow  # noqa: E402

# Worker start-up (a process per worker, imports, model load, process-group setup) takes ~10-40 s alone and
# grows with the machine's load (120 s ran out at load ~6); no test measures it, so its bound is far above
# any load, and each test's own limit (pytest-timeout, 600 s elsewhere) leaves room for it and the steps.
# The step timeouts stay as they are: the dead/hung-worker tests measure against them.
STARTUP_TIMEOUT_S = 900
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"),
              pytest.mark.timeout(2 * STARTUP_TIMEOUT_S)]
HERE = Path(__file__).resolve().parent
TIMEOUTS = {"startup_timeout_s": STARTUP_TIMEOUT_S, "rollout_timeout_s": 120, "train_timeout_s": 120,
            "sync_timeout_s": 60}


@pytest.fixture(scope="module")
def cluster():
    path = os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})  # workers import ray_test_plugins
    yield ray
    ray.shutdown()


@pytest.fixture
def handles(cluster):
    made = []
    yield made
    for handle in made:
        ray.kill(handle)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def tiny(tokenizer, seed=0):
    return build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=seed,
                            eos_token_id=tokenizer.eos_token_id)


def records(n=6):
    out = []
    for k in range(n):
        text = " ".join(f"Document {j}: fact{k}{j} is the capital of France." for j in range(4))
        out.append(QuestionRecord(id=f"q{k}", question=f"What is fact{k}?", answers=["Paris"], context=text,
                                  metadata={}))
    return out


def config(plugins=None, ray_section=None, task=None, **train):
    return Config.model_validate({
        "ray": {**TIMEOUTS, **(ray_section or {})},
        "plugins": {"reward_function": "ray_test_plugins:parity_reward", **(plugins or {})},
        "task": task or {"chunk_tokens": 24, "memory_tokens": 6, "final_tokens": 5, "max_chunks": 3},
        "sampling": {"n_samples": 8, "temperature": 1.0},
        "engine": {"max_batch_size": 1},
        "algorithm": {"kl_coef": 0.01},
        "train": {"lr": 1e-3, "num_rollout": 2, "rollout_batch_size": 1, "save_interval": 1, **train},
        "queue": {"train_sample_expansion_factor": 4},
    })


def random_rows(vocab, n_groups=3, seed=0):
    rng = random.Random(seed)
    rows = []
    for g in range(n_groups):
        for s in range(2):
            for turn in range(rng.randint(1, 3)):
                p, r = rng.randint(3, 20), rng.randint(1, 6)
                rows.append(TrainRow(tokens=[rng.randrange(1, vocab) for _ in range(p + r)], response_length=r,
                                     loss_mask=[1] * r, rollout_log_probs=[-rng.random() * 3 for _ in range(r)],
                                     advantage=rng.uniform(-1, 1), group_id=f"g{g}", trajectory_id=f"g{g}s{s}",
                                     turn_index=turn, rollout_id=0))
    return rows


def trainer_group(cfg, tokenizer, handles, model):
    trainer_opts, _ = _scheduling(ray, cfg.ray, cfg.train.dp_size, handles)
    return TrainerGroup(ray, cfg, trainer_opts, 0, ray.put(model), None, handles)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_trainer_workers_give_the_single_process_weights_and_a_dead_rank_is_named(tokenizer, handles, strategy):
    # an odd row count: padding rows (all-zero loss mask) on one rank; 40 tokens: several micro-batches per rank
    cfg = config(dp_size=2, pad_to_dp=True, num_optimizer_steps=2, micro_batch_tokens=40, strategy=strategy,
                 runtime="ray")
    rows = random_rows(len(tokenizer))
    rows = rows if len(rows) % 2 else rows[:-1]
    group = trainer_group(cfg, tokenizer, handles, tiny(tokenizer))
    for rollout_id in (0, 1):
        metrics = group.train_rollout(put_rows(rows), rollout_id)  # the rows as a rollout worker leaves them
    trained = group.state_dict()  # gathered from the shards under FSDP
    # both ranks compute with the same weights (a collective under FSDP: asked of both at once)
    per_rank = wait_named({f"rank {k}": w.log_probs.remote(rows[:3]) for k, w in enumerate(group.workers)}, 60,
                          "log-probs")
    assert per_rank["rank 0"] == per_rank["rank 1"]

    one = Actor(tiny(tokenizer), config(pad_to_dp=True, num_optimizer_steps=2, micro_batch_tokens=40), pad_token_id=0)
    for rollout_id in (0, 1):
        expected = one.train_rollout(rows, rollout_id)
    assert metrics["rows/consumed"] == expected["rows/consumed"] == len(rows)
    assert metrics["loss/total"] == pytest.approx(expected["loss/total"], abs=1e-6)
    assert metrics["kl/mean"] == pytest.approx(expected["kl/mean"], abs=1e-7) and metrics["kl/mean"] > 0
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)  # the global norm, also sharded
    assert metrics["micro_batches"] > 2  # summed over ranks: every rank ran several
    assert group.global_step == one.global_step == 4
    moved = False
    initial = tiny(tokenizer).state_dict()
    assert sorted(trained) == sorted(one.model.state_dict())
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0, msg=name)
        moved |= not torch.equal(value, initial[name])
    assert moved  # the comparison is about trained weights, not two untouched copies

    ray.kill(group.workers[1])  # rank 0 will block in the all-reduce; the driver must not wait for it
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rollout 2: train: trainer rank 1 \(pid \d+\) died"):
        group.train_rollout(put_rows(rows), 2)
    assert time.monotonic() - start < cfg.ray.train_timeout_s / 2


def test_trajectory_level_options_on_two_ranks_give_the_single_process_weights(tokenizer, handles):
    # GSPO and sequence-level rollout correction sum log-ratios over a trajectory's rows, which the planner
    # may deal to different ranks: the ranks exchange their per-trajectory totals, so two ranks train as one.
    from memrl.train.partition import plan_rollout

    algorithm = {"credit": "share", "loss_mode": "gspo", "rollout_is": "sequence", "rollout_is_threshold": 1.5,
                 "rollout_rs": "geometric", "rollout_rs_threshold": 1.05}

    def with_options(cfg):
        for key, value in algorithm.items():
            setattr(cfg.algorithm, key, value)
        return cfg

    train = {"pad_to_dp": True, "num_optimizer_steps": 2, "micro_batch_tokens": 40}
    rows = random_rows(len(tokenizer), n_groups=4, seed=3)
    # Engine log-probs near the trainer's (ratios near 1, as in a real run), so partial and whole trajectory
    # sums give different weights and masks: far-off random ones would mask or zero every trajectory alike.
    rng = random.Random(4)
    for row, logp in zip(rows, Actor(tiny(tokenizer), config(**train), pad_token_id=0).log_probs(rows), strict=True):
        row.rollout_log_probs = [x + rng.uniform(-0.3, 0.3) for x in logp]
    cfg = with_options(config(dp_size=2, runtime="ray", **train))
    plan = plan_rollout(rows, cfg, 0, 0)
    on_rank = [{r.trajectory_id for step in plan for mb in step[k].micro_batches for r in mb if r.loss_mask[0]}
               for k in (0, 1)]
    assert on_rank[0] & on_rank[1], "the test needs a trajectory whose rows are trained on both ranks"
    group = trainer_group(cfg, tokenizer, handles, tiny(tokenizer))
    metrics = group.train_rollout(put_rows(rows), 0)
    one = Actor(tiny(tokenizer), with_options(config(**train)), pad_token_id=0)
    expected = one.train_rollout(rows, 0)
    assert metrics["loss/total"] == pytest.approx(expected["loss/total"], abs=1e-6)
    assert 0 < expected["rollout_corr/rs_masked_fraction"] < 1  # the mask has work, and leaves rows to train
    assert metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(expected["rollout_corr/rs_masked_fraction"])
    trained = group.state_dict()
    for name, value in one.model.state_dict().items():
        torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=0, msg=name)


def test_rollout_workers_dead_or_hung_fail_the_step_within_their_timeout(tokenizer, handles):
    cfg = config(plugins={"task": "ray_test_plugins:HangingTask"},
                 ray_section={"num_rollout_workers": 2, "rollout_timeout_s": 60})
    settings = cfg.ray
    _, opts = _scheduling(ray, settings, 1, handles)
    pool = RolloutPool(ray, cfg, opts, tokenizer, ray.put(tiny(tokenizer)), handles)
    out = pool.generate(0, records(2))  # both workers serve: one question each, merged in batch order
    assert len(out.trajectories) == 16 and out.train_row_count == 64
    assert [t.metadata["question_id"] for t in out.trajectories] == ["q0"] * 8 + ["q1"] * 8
    ray.kill(pool.workers[1])
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rollout 1: generate: rollout worker 1 \(pid \d+\) died"):
        pool.generate(1, records(2))
    assert time.monotonic() - start < settings.rollout_timeout_s
    # a worker that never answers (its generate function hangs) is named once its timeout passes
    pool.settings = settings.model_copy(update={"rollout_timeout_s": 2})
    hang = QuestionRecord(id="hang", question="?", answers=["x"], context="", metadata={})
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"rollout 2: generate: rollout worker 0 \(pid \d+\) did not answer"):
        pool.generate(2, [hang])
    # not a speed check: it must end, named, not hang; it waited about its 2 s (Ray's clock may end a
    # hair before ours: 1.99997 s was seen), not failed at once
    assert 1.5 <= time.monotonic() - start < 60


def test_a_raising_worker_is_named(cluster, handles):
    @ray.remote(num_cpus=0)
    class Broken:
        def work(self):
            raise ValueError("bad rows")

    worker = Broken.remote()
    handles.append(worker)
    with pytest.raises(WorkerError, match="step 3: worker A raised ValueError: bad rows"):
        wait_named({"worker A": worker.work.remote()}, 30, "step 3")


def read_metrics(run_root):
    return [json.loads(line) for line in (run_root / "logs" / "metrics.jsonl").read_text().splitlines()]


def files_of(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_step_ray_run_matches_the_single_process_run_and_resumes(cluster, tokenizer, tmp_path, strategy):
    cfg = config(dp_size=2, runtime="ray", strategy=strategy)
    local_root, ray_root = tmp_path / "local", tmp_path / "ray"
    local = Trainer(config(dp_size=2), TrainOptions(run_root=local_root, progress=False), model=tiny(tokenizer),
                    tokenizer=tokenizer, records=records()).run()
    history = run_ray_training(cfg, TrainOptions(run_root=ray_root, progress=False),
                               model=tiny(tokenizer), tokenizer=tokenizer, records=records())
    assert len(history) == len(local) == 2
    for got, want in zip(history, local, strict=True):
        assert got["rows/saved"] == got["rows/transferred"] == got["rows/consumed"] == want["rows/consumed"] == 32
        assert got["reward/mean"] == want["reward/mean"]  # same seeds, same weights synced: same trajectories
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-6)
        assert got["sync_check/max_abs_diff"] >= 0  # the weight-sync canary checked every rollout worker's sync
    # the same kinds of logs and checkpoints
    assert [p.name for p in list_checkpoints(ray_root)] == [p.name for p in list_checkpoints(local_root)]
    for name in ("iter_0000000", "iter_0000001"):
        assert files_of(ray_root / "checkpoints" / name) == files_of(local_root / "checkpoints" / name)
    assert [m["rollout_id"] for m in read_metrics(ray_root)] == [0, 1]
    assert (ray_root / "logs" / "rollouts" / "rollout_0000001.jsonl").is_file()
    assert list((ray_root / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((ray_root / "reward_summary.json").read_text())
    from safetensors.torch import load_file

    def weights(root):
        return load_file(str(root / "checkpoints" / "iter_0000001" / "model" / "model.safetensors"))

    want = weights(local_root)
    for name, value in weights(ray_root).items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=0, msg=name)

    def optimizer(root):
        return torch.load(root / "checkpoints" / "iter_0000001" / "optimizer.pt", weights_only=True)

    # the optimizer state in the same (torch.optim) form, gathered from the shards under FSDP
    got, want = optimizer(ray_root), optimizer(local_root)
    assert got["param_groups"] == want["param_groups"] and sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, atol=1e-5, rtol=0, msg=f"{index} {key}")
    # resume the Ray run from its last complete checkpoint
    resumed = run_ray_training(config(dp_size=2, num_rollout=3, runtime="ray", strategy=strategy), TrainOptions(
        run_root=ray_root, progress=False, load=ray_root / "checkpoints" / "iter_0000001"),
        model=tiny(tokenizer), tokenizer=tokenizer, records=records())
    assert len(resumed) == 1 and resumed[0]["rows/consumed"] == 32
    assert [m["rollout_id"] for m in read_metrics(ray_root)] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(ray_root)][-1] == "iter_0000002"


@pytest.mark.slow
def test_a_replay_on_ray_trains_its_rows_from_the_object_store_as_one_process_does(cluster, tokenizer, tmp_path):
    # The replay converts in the driver and puts its rows into the object store: the ranks fetch them as they
    # fetch a rollout worker's, and the steps are the one-process run's that saved the rollouts.
    local = Trainer(config(dp_size=2), TrainOptions(run_root=tmp_path / "local", progress=False, save_rollouts=True),
                    model=tiny(tokenizer), tokenizer=tokenizer, records=records()).run()
    replayed = run_ray_training(config(dp_size=2, runtime="ray"), TrainOptions(
        run_root=tmp_path / "ray", progress=False, replay_rollouts=tmp_path / "local" / "rollouts_raw"),
        model=tiny(tokenizer), tokenizer=tokenizer, records=records())
    for got, want in zip(replayed, local, strict=True):
        assert got["rows/saved"] == got["rows/transferred"] == got["rows/consumed"] == want["rows/consumed"] == 32
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-6)


@pytest.mark.slow
def test_fsdp_trainers_feed_a_served_engine_through_a_weights_folder(cluster, tmp_path):
    # engine.kind=openai under FSDP: every rank helps gather, rank 0 writes RUN_ROOT/weights_sync, the
    # server reloads it; after the run the served weights are the trained (checkpointed) ones.
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from memrl.engines.hf import HFEngine
    from memrl.engines.server import create_app
    from memrl.tiny import save_tiny_model

    sys.path.insert(0, str(HERE.parent / "engines"))
    from test_server import serve_in_thread

    model_dir = save_tiny_model(tmp_path / "model", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    served = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    with serve_in_thread(create_app(served, "tiny", tokenizer=tok, reload_roots=[tmp_path / "run"])) as url:
        cfg = config(dp_size=2, runtime="ray", strategy="fsdp", num_rollout=1,
                     ray_section={"rollout_server_urls": [url]})
        cfg.model.path = str(model_dir)
        cfg.engine.kind = "openai"
        history = run_ray_training(cfg, TrainOptions(run_root=tmp_path / "run", progress=False), tokenizer=tok,
                                   records=records())
    assert history[0]["rows/saved"] == history[0]["rows/consumed"] > 0 and history[0]["grad_norm"] > 0
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "iter_0000000" / "model" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert any(not torch.equal(initial[name], value) for name, value in trained.items())
    reloaded = served.model.state_dict()
    for name, value in trained.items():
        torch.testing.assert_close(reloaded[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_single_turn_task_on_two_rollout_workers_equals_one_process_row_for_row(cluster, tokenizer, tmp_path):
    # The framework numbers slots (memrl.rollout): a worker serving the second half of a batch names groups and
    # seeds requests as one process does, whatever the task plugin (the single-turn task once numbered from 0).
    single_turn = {"task": "memrl.tasks.single_turn:SingleTurnTask"}
    runs = {}
    for name, runtime in (("local", "local"), ("ray", "ray")):
        cfg = config(plugins=single_turn, ray_section={"num_rollout_workers": 2}, task={"final_tokens": 5},
                     rollout_batch_size=4, num_rollout=1, runtime=runtime)
        options = TrainOptions(run_root=tmp_path / name, progress=False, save_rollouts=True)
        train = run_ray_training if runtime == "ray" else (lambda c, o, **kw: Trainer(c, o, **kw).run())
        runs[name] = train(cfg, options, model=tiny(tokenizer), tokenizer=tokenizer, records=records(4))

    def trajectories(name):
        lines = (tmp_path / name / "rollouts_raw" / "rollout_0000000.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines[1:]]

    local, ray_run = trajectories("local"), trajectories("ray")
    assert len(local) == len(ray_run) == 32
    sys.path.insert(0, str(HERE.parent / "engines"))
    from numerics import logprob_atol

    atol = logprob_atol(tiny(tokenizer), [t["turns"][0]["prompt_ids"] for t in local])
    for a, b in zip(local, ray_run, strict=True):  # ids, groups, seeds (so tokens) and rewards agree exactly
        assert (a["trajectory_id"], a["group_id"], a["reward"]) == (b["trajectory_id"], b["group_id"], b["reward"])
        (ta,), (tb,) = a["turns"], b["turns"]
        assert (ta["prompt_ids"], ta["response_ids"]) == (tb["prompt_ids"], tb["response_ids"])
        # another process, other torch threads: log-probs agree to float32 rounding, not bit for bit
        assert ta["rollout_log_probs"] == pytest.approx(tb["rollout_log_probs"], abs=atol)
    assert len({t["group_id"] for t in local}) == 4
    assert runs["local"][0]["rows/consumed"] == runs["ray"][0]["rows/consumed"] == 32
    assert runs["local"][0]["loss/total"] == pytest.approx(runs["ray"][0]["loss/total"], abs=1e-6)


@pytest.mark.slow
def test_overlapped_ray_run_streams_row_references_and_matches_the_one_process_pipeline(cluster, tokenizer, tmp_path,
                                                                                       monkeypatch):
    # train.max_staleness=1 on Ray (2 rollout workers, 2 DDP ranks): the same schedule of weight versions,
    # the same trajectories and the same weights as the overlapped one-process run; and the driver's queue
    # only ever holds references, never rows (they go from the rollout workers to the ranks).
    from memrl.distributed.rows import RowRef
    from memrl.train.queue import TransferQueue

    put_kinds = []
    real_put = TransferQueue.put

    def spy(self, rollout_id, rows, *args, **kwargs):
        put_kinds.append({type(r).__name__ for r in rows})
        return real_put(self, rollout_id, rows, *args, **kwargs)

    common = {"dp_size": 2, "max_staleness": 1, "num_rollout": 3, "save_interval": 3, "rollout_batch_size": 2}
    local = Trainer(config(**common), TrainOptions(run_root=tmp_path / "local", progress=False),
                    model=tiny(tokenizer), tokenizer=tokenizer, records=records()).run()
    monkeypatch.setattr(TransferQueue, "put", spy)
    ray_run = run_ray_training(config(ray_section={"num_rollout_workers": 2}, runtime="ray", **common),
                               TrainOptions(run_root=tmp_path / "ray", progress=False),
                               model=tiny(tokenizer), tokenizer=tokenizer, records=records())
    assert put_kinds == [{RowRef.__name__}] * 3
    assert [m["pipeline/staleness"] for m in ray_run] == [m["pipeline/staleness"] for m in local] == [0.0, 1.0, 1.0]
    logged = [{json.loads(line)["weight_version"] for line in
               (tmp_path / "ray" / "logs" / "rollouts" / f"rollout_{r:07d}.jsonl").read_text().splitlines()}
              for r in range(3)]
    assert logged == [{0}, {0}, {1}]  # stamped by the rollout workers, as the rows they convert
    for got, want in zip(ray_run, local, strict=True):
        assert got["rows/saved"] == got["rows/transferred"] == got["rows/consumed"] == want["rows/consumed"] == 64
        assert got["reward/mean"] == want["reward/mean"]
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-6)
    from safetensors.torch import load_file

    def weights(root):
        return load_file(str(root / "checkpoints" / "iter_0000002" / "model" / "model.safetensors"))

    want = weights(tmp_path / "local")
    for name, value in weights(tmp_path / "ray").items():
        torch.testing.assert_close(value, want[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_dynamic_sampling_on_two_rollout_workers_matches_one_process(cluster, tokenizer, tmp_path):
    # algorithm.filter_groups on Ray: the further generation batches go to the rollout workers (slots after
    # the step's batch), the kept groups' row references go to the ranks, and the run equals one process's.
    def filtered(cfg):
        cfg.sampling.n_samples = 2  # groups of 2 under the parity reward: about half have equal rewards
        cfg.algorithm.filter_groups, cfg.algorithm.over_sampling_batch_size = True, 2
        cfg.algorithm.max_num_gen_batches = 6
        return cfg

    common = {"num_rollout": 2, "save_interval": 2, "rollout_batch_size": 2, "dp_size": 2, "pad_to_dp": True}
    local = Trainer(filtered(config(**common)), TrainOptions(run_root=tmp_path / "local", progress=False),
                    model=tiny(tokenizer), tokenizer=tokenizer, records=records()).run()
    ray_run = run_ray_training(filtered(config(ray_section={"num_rollout_workers": 2}, runtime="ray", **common)),
                               TrainOptions(run_root=tmp_path / "ray", progress=False),
                               model=tiny(tokenizer), tokenizer=tokenizer, records=records())
    assert sum(m["dynamic_sampling/groups_filtered_equal_reward"] for m in local) > 0  # the filter had work
    for got, want in zip(ray_run, local, strict=True):
        for key in ("dynamic_sampling/generation_batches", "dynamic_sampling/groups_kept",
                    "dynamic_sampling/groups_filtered_equal_reward", "reward/mean"):
            assert got[key] == want[key], key
        assert got["rows/saved"] == got["rows/transferred"] == got["rows/consumed"] == want["rows/consumed"]
        assert got["loss/total"] == pytest.approx(want["loss/total"], abs=1e-6)

    def credit(root):  # each logged trajectory's advantage and its turns' credit (None: not trained on)
        lines = (root / "logs" / "rollouts" / "rollout_0000001.jsonl").read_text().splitlines()
        return {r["trajectory_id"]: (r["advantage"], [t["advantage"] for t in r["turns"]])
                for r in map(json.loads, lines)}

    # The rows' own advantages travel with them from the rollout workers: Ray logs what one process logs.
    ray_credit, local_credit = credit(tmp_path / "ray"), credit(tmp_path / "local")
    assert ray_credit == local_credit
    assert any(a is not None and None not in turns for a, turns in ray_credit.values())
