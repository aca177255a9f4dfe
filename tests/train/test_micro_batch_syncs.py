"""No host sync inside the micro-batch loop: metrics stay on the device until the optimizer step's end.

On a GPU every `float(tensor)`, `.item()`, `.tolist()` or `if tensor:` waits for all queued kernels, so a
sync per metric per micro-batch keeps the GPU idle between micro-batches. On the CPU the same calls are
counted by patching them while `_micro_batch` runs. Packed micro-batches make none at all; padded ones
make none in memrl (transformers' sdpa mask code reads the padding mask back to choose `is_causal`).
"""

import sys
from pathlib import Path

import pytest
import torch
from test_actor import make_rows, tiny_model

from memrl.config import Config
from memrl.train import actor as actor_module
from memrl.train.actor import Actor

SYNCS = ("__float__", "__int__", "__bool__", "item", "tolist")
MEMRL = str(Path(actor_module.__file__).parents[1])


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_read_nothing_back_from_the_device(monkeypatch, packing):
    cfg = Config.model_validate({"train": {"micro_batch_tokens": 40, "packing": packing},
                                 "algorithm": {"kl_coef": 0.05, "entropy_coef": 0.01,
                                               "rollout_is": "token", "rollout_is_threshold": 2.0}})
    actor = Actor(tiny_model(), cfg, pad_token_id=0)
    calls: list[str] = []
    inside = [False]
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if inside[0] and (packing or caller.startswith(MEMRL)):
                calls.append(f"{_name} from {caller}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    micro_batch = Actor._micro_batch

    def watched(self, *args, **kwargs):
        inside[0] = True
        try:
            return micro_batch(self, *args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(actor_module.Actor, "_micro_batch", watched)
    metrics = actor.train_rollout(make_rows(), rollout_id=0)
    assert metrics["micro_batches"] > 1 and calls == []
