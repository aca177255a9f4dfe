"""A non-finite loss stops the training loop at the step that produced it, before any checkpoint of it."""

import math

import pytest
import torch
from test_controller import config, make_trainer, tokenizer  # noqa: F401 - tokenizer is a fixture

from memrl.train.checkpoint import list_checkpoints
from memrl.train.controller import TrainingError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_infinite_loss_stops_the_run_naming_the_step_and_saves_no_checkpoint_after(tokenizer, tmp_path):  # noqa: F811
    run_root = tmp_path / "run"
    trainer = make_trainer(tokenizer, run_root, config(num_rollout=3, save_interval=1))
    original = trainer.parts.policy.train_rollout

    def overflow_at_step_1(rows, rollout_id):
        # From rollout 1 on the LM head overflows, as diverged weights would; the rows stay valid.
        if rollout_id == 1:
            trainer.parts.policy.model.get_output_embeddings().register_forward_hook(lambda m, a, out: out * math.inf)
        return original(rows, rollout_id)

    trainer.parts.policy.train_rollout = overflow_at_step_1
    with pytest.raises(TrainingError, match=r"rollout 1, optimizer step 1: non-finite loss"):
        trainer.run()
    assert [p.name for p in list_checkpoints(run_root)] == ["iter_0000000"]  # nothing after the bad step
    assert trainer.parts.policy.global_step == 1
    assert all(torch.isfinite(p).all() for p in trainer.parts.policy.model.parameters())
