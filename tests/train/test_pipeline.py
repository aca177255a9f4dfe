"""The overlapped pipeline (train.max_staleness): which weights each rollout samples with, exact resume,
faults waking the other stage, and the row ledger unchanged."""

import sys
import time
from pathlib import Path

import pytest
import torch

from memrl.config import ConfigError, load_config
from memrl.engines.base import WeightsInMemory
from memrl.train.controller import TrainingError
from memrl.train.pipeline import WeightBoard, sampling_version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_controller import config, make_trainer, read_metrics, tokenizer  # noqa: E402, F401

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_sampling_version_is_a_function_of_the_rollout_id():
    never = lambda r: False  # noqa: E731
    assert [sampling_version(r, 0, 0, never) for r in range(4)] == [0, 1, 2, 3]  # k = 0: synchronous
    assert [sampling_version(r, 0, 1, never) for r in range(4)] == [0, 0, 1, 2]
    assert [sampling_version(r, 0, 2, never) for r in range(5)] == [0, 0, 0, 1, 2]
    every_2nd = lambda r: (r + 1) % 2 == 0  # noqa: E731 - checkpoints after steps 1, 3, ...
    assert [sampling_version(r, 0, 1, every_2nd) for r in range(5)] == [0, 0, 2, 2, 4]  # drained after saves
    assert [sampling_version(r, 2, 1, every_2nd) for r in range(2, 5)] == [2, 2, 4]  # resumed at 2: the same
    # k = 2: never older than the last checkpoint, never going back
    assert [sampling_version(r, 0, 2, every_2nd) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    assert [sampling_version(r, 2, 2, every_2nd) for r in range(2, 6)] == [2, 2, 4, 4]


def test_weight_board_waits_with_a_timeout_and_wakes_on_failure():
    board = WeightBoard(start_version=0, timeout_s=0.3)
    assert board.take(0) is None  # the engine's own starting weights
    board.publish(1, WeightsInMemory({"w": torch.ones(1)}))
    assert board.take(1).whole_weights()["w"].item() == 1.0
    start = time.monotonic()
    with pytest.raises(TrainingError, match="version 2 not published within 0.3s"):
        board.take(2)
    assert time.monotonic() - start < 2
    board.fail(RuntimeError("trainer died"))
    with pytest.raises(TrainingError, match="trainer died"):
        board.take(2)


def test_overlapped_run_keeps_the_ledger_and_logs_staleness(tokenizer, tmp_path):  # noqa: F811
    history = make_trainer(tokenizer, tmp_path / "run", config(num_rollout=4, save_interval=2, max_staleness=1)).run()
    assert [m["rows/saved"] == m["rows/transferred"] == m["rows/consumed"] == 32 for m in history] == [True] * 4
    # rollout 1 samples with the starting weights (1 step old), rollout 2 with the checkpoint's (drained)
    assert [m["pipeline/staleness"] for m in history] == [0.0, 1.0, 0.0, 1.0]
    assert all(m["time/wait_rows_s"] >= 0 for m in history)
    # only versions some rollout samples with are copied: 2 (rollout 2, after the checkpoint of step 1)
    assert ["time/publish_s" in m for m in history] == [False, True, False, False]
    assert all(torch.isfinite(p).all() for p in torch.load(
        tmp_path / "run" / "checkpoints" / "iter_0000003" / "optimizer.pt", weights_only=True)["state"][0].values())


def test_every_row_and_logged_trajectory_records_the_weight_version_it_was_sampled_with(tokenizer, tmp_path,  # noqa: F811
                                                                                        monkeypatch):
    import json

    from memrl.train.queue import TransferQueue

    versions = {}
    real_put = TransferQueue.put

    def spy(self, rollout_id, rows, *args, **kwargs):
        versions[rollout_id] = {r.weight_version for r in rows}
        return real_put(self, rollout_id, rows, *args, **kwargs)

    monkeypatch.setattr(TransferQueue, "put", spy)
    for k, want in ((0, [0, 1, 2, 3]), (1, [0, 0, 2, 2])):  # k = 1: drained by the checkpoint after step 1
        make_trainer(tokenizer, tmp_path / f"k{k}", config(num_rollout=4, save_interval=2, max_staleness=k)).run()
        assert [versions[r] for r in range(4)] == [{v} for v in want]
        logged = [{json.loads(line)["weight_version"] for line in
                   (tmp_path / f"k{k}" / "logs" / "rollouts" / f"rollout_{r:07d}.jsonl").read_text().splitlines()}
                  for r in range(4)]
        assert logged == [{v} for v in want]


def test_kill_and_resume_mid_run_is_exact_with_max_staleness_1(tokenizer, tmp_path):  # noqa: F811
    straight = make_trainer(tokenizer, tmp_path / "a", config(num_rollout=4, save_interval=2, max_staleness=1))
    straight.run()
    first = make_trainer(tokenizer, tmp_path / "b", config(num_rollout=4, save_interval=2, max_staleness=1))

    def killed(rows, rollout_id, original=first.parts.policy.train_rollout):
        if rollout_id == 3:
            raise KeyboardInterrupt  # killed after the checkpoint of step 1, in the middle of step 3
        return original(rows, rollout_id)

    first.parts.policy.train_rollout = killed
    with pytest.raises(KeyboardInterrupt):
        first.run()
    second = make_trainer(tokenizer, tmp_path / "b", config(num_rollout=4, save_interval=2, max_staleness=1),
                          load=tmp_path / "b" / "checkpoints" / "iter_0000001")
    second.run()
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["rollout_id"] for m in b] == [0, 1, 2, 3]  # the killed run's step 2 log is replaced on resume
    assert [m["reward/mean"] for m in a] == [m["reward/mean"] for m in b]
    assert [m["loss/total"] for m in a] == pytest.approx([m["loss/total"] for m in b], abs=1e-7)
    for (name, pa), pb in zip(straight.parts.policy.model.named_parameters(), second.parts.policy.model.parameters(),
                              strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0, msg=name)


def overlapped_trainer(tokenizer, run_root, num_rollout, **opts):  # noqa: F811
    """k = 1, no checkpoint before the end, and a 60 s queue timeout that a test must never wait out."""
    cfg = config(num_rollout=num_rollout, max_staleness=1, save_interval=10)
    cfg.queue.timeout_s = 60.0
    return make_trainer(tokenizer, run_root, cfg, **opts)


def test_a_producer_failure_wakes_the_trainer_within_its_timeout(tokenizer, tmp_path):  # noqa: F811
    trainer = overlapped_trainer(tokenizer, tmp_path / "run", num_rollout=4)
    real = trainer.parts.rollout.generate

    def generate(rollout_id, records, weight_version=None):
        if rollout_id == 2:
            raise RuntimeError("engine lost")
        return real(rollout_id, records, weight_version)

    trainer.parts.rollout.generate = generate
    start = time.monotonic()
    with pytest.raises(TrainingError, match=r"pipeline: rollout 2 failed: RuntimeError\('engine lost'\)"):
        trainer.run()
    assert time.monotonic() - start < 30  # woken by the failure, not by the 60 s timeout
    assert [m["rollout_id"] for m in read_metrics(tmp_path / "run")] == [0, 1]


def test_an_interrupt_while_the_producer_waits_for_weights_stops_at_once(tokenizer, tmp_path):  # noqa: F811
    # The producer is ahead, waiting for the next weight version; Ctrl-C in the trainer must wake it, not
    # leave the run waiting queue.timeout_s for it (and the engine must still be closed cleanly).
    trainer = overlapped_trainer(tokenizer, tmp_path / "run", num_rollout=6)
    real = trainer.parts.policy.train_rollout

    def train_rollout(rows, rollout_id):
        if rollout_id == 2:
            time.sleep(0.5)  # the producer has generated rollout 3 and now waits for version 3
            raise KeyboardInterrupt
        return real(rows, rollout_id)

    trainer.parts.policy.train_rollout = train_rollout
    threads = torch.get_num_threads()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert time.monotonic() - start < 20
    assert not trainer._producer.thread.is_alive() and trainer.parts.rollout.loop.is_closed()
    assert torch.get_num_threads() == threads  # the pipeline's split of torch threads is undone


def test_a_failure_saving_the_raw_rollout_reaches_the_trainer(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    import memrl.train.controller as controller

    trainer = overlapped_trainer(tokenizer, tmp_path / "run", num_rollout=4, save_rollouts=True)
    real = controller.save_raw_rollout

    def save(directory, rollout_id, out):
        if rollout_id == 2:
            raise OSError("disk full")
        return real(directory, rollout_id, out)

    monkeypatch.setattr(controller, "save_raw_rollout", save)
    start = time.monotonic()
    with pytest.raises(TrainingError, match="disk full"):
        trainer.run()
    assert time.monotonic() - start < 30


def test_max_staleness_runs_everywhere_and_must_be_at_least_0():
    assert load_config(None, ["train.max_staleness=1", "train.runtime=ray"]).train.max_staleness == 1
    assert load_config(None, ["train.max_staleness=2", "engine.kind=openai",
                              "engine.server_url=http://x"]).train.max_staleness == 2
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(None, ["train.max_staleness=-1"])


def test_the_producer_hands_the_rows_over_once_through_the_queue(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """What the trainer takes from the producer for its logs is the rollout without its rows (they went to
    the queue) and their count; the logs' advantages travel with the trajectories."""
    from memrl.train.pipeline import Producer

    taken, real_take = [], Producer.take
    monkeypatch.setattr(Producer, "take", lambda self, rid: (taken.append(real_take(self, rid)), taken[-1])[1])
    history = make_trainer(tokenizer, tmp_path / "run", config(num_rollout=2, max_staleness=1)).run()
    assert [p.out.rows for p in taken] == [None, None]
    assert [p.saved for p in taken] == [m["rows/consumed"] for m in history] == [32, 32]
    assert all(len(p.out.turn_advantages) == 32 and len(p.out.advantages) == 8 for p in taken)
