"""The plain 1:1 path end to end: a single-turn task trains through the same loop with no row count."""

import json

import pytest

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.tiny import build_tiny_model, build_tiny_tokenizer
from memrl.train.controller import Trainer, TrainOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def first_token_even(traj, golds):
    return float(traj.turns[0].response_ids[0] % 2 == 0)


def test_single_turn_task_trains_one_row_per_trajectory(tmp_path):
    tok = build_tiny_tokenizer()
    cfg = Config.model_validate({
        "rollout": {"final_tokens": 4, "n_samples": 4, "max_batch_size": 8},
        "train": {"num_rollout": 2, "rollout_batch_size": 2, "lr": 1e-3, "save_interval": 10},
        "plugins": {"task": "memrl.tasks.single_turn:SingleTurnTask", "reward_function": f"{__name__}:first_token_even"},
    })
    records = [QuestionRecord(id=f"q{k}", question="Which city?", answers=["Paris"], context=f"Text {k}: Paris.",
                              metadata={}) for k in range(3)]
    model = build_tiny_model(len(tok), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64,
                             eos_token_id=tok.eos_token_id)
    history = Trainer(cfg, TrainOptions(run_root=tmp_path, progress=False), model=model, tokenizer=tok,
                      records=records).run()
    # 2 questions x 4 samples x 1 turn = 8 rows, no row count announced
    assert [m["rows/consumed"] for m in history] == [8, 8]
    assert all(m["rows/saved"] == m["rows/transferred"] == 8 for m in history)
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["rollout_id"] == 1
