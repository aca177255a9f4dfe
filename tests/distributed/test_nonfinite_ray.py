"""On Ray, a non-finite loss stops every trainer rank with the step unapplied, and the driver names it."""

import dataclasses

import pytest

ray = pytest.importorskip("ray")

from test_ray_runtime import cluster, config, handles, random_rows, tiny, tokenizer, trainer_group  # noqa: E402, F401

from memrl.distributed.rows import put_rows  # noqa: E402
from memrl.distributed.workers import WorkerError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def test_non_finite_loss_stops_both_ddp_ranks_with_weights_unchanged(tokenizer, handles):  # noqa: F811
    cfg = config(dp_size=2, pad_to_dp=True, runtime="ray")
    group = trainer_group(cfg, tokenizer, handles, tiny(tokenizer))
    before = group.state_dict()
    rows = random_rows(len(tokenizer))
    # Finite as a Python float, so the rows pass the ranks' validation; infinite in the float32 loss.
    rows[0] = dataclasses.replace(rows[0], advantage=1e300)
    with pytest.raises(WorkerError, match=r"NonFiniteUpdateError: rollout 4, optimizer step 0: non-finite loss"):
        group.train_rollout(put_rows(rows), 4)
    # Both ranks answer again (neither hangs in a collective) and the weights are the initial ones.
    after = group.state_dict()
    assert sorted(after) == sorted(before)
    assert all(after[name].equal(value) for name, value in before.items())
