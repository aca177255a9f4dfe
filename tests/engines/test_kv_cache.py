"""SpareLayer (memrl/engines/kv_cache.py): a KV-cache layer that appends in place into spare columns.

Every test compares against the plain-tensor result the running batch relied on before (torch.cat of
the cache with each new token, left-padding with zeros, row selection, left slicing), so any layout
slip shows as a value mismatch, not only as a shape error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.engines.kv_cache import SpareLayer
from memrl.tiny import build_tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs on one torch thread (the fixture is in tests/engines/conftest.py)."""


def kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def assert_holds(layer: SpareLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert layer.get_seq_length() == keys.shape[2]


def test_appends_past_capacity_grow_and_keep_every_column():
    keys, values = kv(3, 5, seed=0)
    layer = SpareLayer.from_tensors(keys, values, spare=2)
    assert layer.capacity == 7
    for step, n in enumerate([1, 1, 1, 2, 1]):  # the third append no longer fits: the buffers grow
        new_keys, new_values = kv(3, n, seed=10 + step)
        returned = layer.update(new_keys, new_values)
        keys, values = torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2)
        assert_holds(layer, keys, values)
        assert torch.equal(returned[0], keys) and torch.equal(returned[1], values)  # what attention sees
    assert layer.capacity >= 2 * 7  # grown by doubling, not one column at a time


def test_appends_within_capacity_write_in_place():
    """The point of the layer: while spare columns last, an append copies nothing else (same storage)."""
    layer = SpareLayer.from_tensors(*kv(2, 4, seed=0), spare=3)
    storage = layer.keys.untyped_storage().data_ptr()
    for step in range(3):
        layer.update(*kv(2, 1, seed=step))
        assert layer.keys.untyped_storage().data_ptr() == storage
        assert layer.values.untyped_storage().data_ptr() == layer._value_buffer.untyped_storage().data_ptr()


def test_merge_of_batches_of_different_widths_left_pads_with_zeros():
    (k1, v1), (k2, v2) = kv(2, 6, seed=1), kv(3, 3, seed=2)
    narrow = SpareLayer.from_tensors(k2, v2, spare=1)  # a SpareLayer's views merge like plain tensors
    layer = SpareLayer.merged([(k1, v1), (narrow.keys, narrow.values)], width=8, spare=2)
    pad = lambda x: F.pad(x, (0, 0, 8 - x.shape[2], 0))  # noqa: E731 - zeros before each row, as before
    keys, values = torch.cat([pad(k1), pad(k2)]), torch.cat([pad(v1), pad(v2)])
    assert_holds(layer, keys, values)
    for step in range(3):  # appends after a merge, past its spare columns too
        new_keys, new_values = kv(5, 1, seed=20 + step)
        layer.update(new_keys, new_values)
        keys, values = torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2)
        assert_holds(layer, keys, values)


def test_keep_rows_and_trim_left_then_append():
    keys, values = kv(4, 6, seed=3)
    layer = SpareLayer.from_tensors(keys, values, spare=4)
    index = torch.tensor([3, 1])
    layer.batch_select_indices(index)
    layer.trim_left(2)
    keys, values = keys[index][:, :, 2:], values[index][:, :, 2:]
    assert_holds(layer, keys, values)
    storage = layer.keys.untyped_storage().data_ptr()
    for step in range(4):  # the spare columns survived both operations
        new_keys, new_values = kv(2, 1, seed=30 + step)
        layer.update(new_keys, new_values)
        keys, values = torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2)
        assert_holds(layer, keys, values)
    assert layer.keys.untyped_storage().data_ptr() == storage
    layer.trim_left(3)  # then a trim right after appends
    assert_holds(layer, keys[:, :, 3:], values[:, :, 3:])


def test_keys_assigned_from_outside_are_adopted():
    """transformers' own methods (crop, reorder, offload) assign keys/values; the next append must
    build on what they assigned, not on the buffers."""
    keys, values = kv(2, 5, seed=4)
    layer = SpareLayer.from_tensors(keys, values, spare=3)
    layer.crop(-2)  # a view of the buffers, from column 0
    layer.reorder_cache(torch.tensor([1, 0]))  # new tensors, rows swapped
    keys, values = keys[[1, 0], :, :3], values[[1, 0], :, :3]
    assert_holds(layer, keys, values)
    new_keys, new_values = kv(2, 1, seed=5)
    layer.update(new_keys, new_values)
    assert_holds(layer, torch.cat([keys, new_keys], 2), torch.cat([values, new_values], 2))


def test_model_logits_equal_with_spare_layers():
    """Inside a real DynamicCache, the model sees the same keys/values (and mask sizes) as with DynamicLayer."""
    model = build_tiny_model(512, seed=0).eval()
    ids = torch.tensor([[5, 9, 13, 17, 21, 25], [0, 0, 7, 11, 15, 19]])
    mask = (ids != 0).long()
    logits = []
    for spare in (False, True):
        cache, m = DynamicCache(config=model.config), mask
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(1) - 1).clamp(min=0),
                        cache=cache)
            if spare:
                cache.layers[:] = [SpareLayer.from_tensors(layer.keys, layer.values, 1) for layer in cache.layers]
            steps, position = [out.logits[:, -1]], m.sum(1)
            for token in (30, 31, 32):  # past the one spare column
                m = torch.cat([m, m.new_ones(2, 1)], 1)
                out = model(input_ids=torch.full((2, 1), token), attention_mask=m, position_ids=position[:, None],
                            cache=cache)
                steps.append(out.logits[:, -1])
                position = position + 1
        logits.append(torch.stack(steps))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def test_running_batch_decodes_in_place():
    """HFEngine's running batch uses spare layers: with no row leaving, every decode step after the
    first sees the same cache storage (DynamicLayer's torch.cat would give a new one each step)."""
    engine = HFEngine(build_tiny_model(512, seed=0))
    storages: list[int] = []
    original = engine._forward

    def recording_forward(input_ids, attention_mask, position_ids, cache):
        if input_ids.shape[1] == 1:  # a decode step: the cache already holds the prompts
            storages.append(cache.layers[0].keys.untyped_storage().data_ptr())
        return original(input_ids, attention_mask, position_ids, cache)

    engine._forward = recording_forward
    requests = [GenerationRequest([5 + i, 9, 13, 17][i:], max_tokens=8, temperature=1.0, seed=i) for i in range(3)]
    with torch.inference_mode():
        results = engine._decode(requests)
    assert [len(r.output_ids) for r in results] == [8, 8, 8]
    assert len(storages) == 7 and len(set(storages)) == 1
