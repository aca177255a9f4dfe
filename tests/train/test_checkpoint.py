"""Checkpoint round trip, atomicity under a crash, discovery, pruning and Hugging Face export."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from memrl.tiny import build_tiny_tokenizer
from memrl.train import checkpoint as ckpt_mod
from memrl.train.checkpoint import (
    COMPLETE_MARKER,
    CheckpointError,
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from memrl.train.export import export_to_hf


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return Qwen3ForCausalLM(config)


def training_setup(seed: int = 0):
    model = tiny_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def train_steps(model, optimizer, scheduler, steps: int = 3) -> None:
    ids = torch.randint(0, 512, (2, 10))
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def save_simple(run_root, rollout_id, seed=0, **kwargs):
    model, optimizer, scheduler = training_setup(seed)
    state = {"next_rollout_id": rollout_id + 1, "data_cursor": 16 * (rollout_id + 1), "global_step": rollout_id}
    return save_checkpoint(run_root, rollout_id, model, optimizer, scheduler, state, **kwargs), model


def test_round_trip_restores_weights_optimizer_scheduler_and_rng(tmp_path):
    model, optimizer, scheduler = training_setup(seed=0)
    train_steps(model, optimizer, scheduler)
    state = {"next_rollout_id": 4, "data_cursor": 48, "global_step": 3, "config": {"train": {"lr": 1e-3}}}
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, state, tokenizer=build_tiny_tokenizer())
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(4))

    assert path == tmp_path / "checkpoints" / "iter_0000003"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE", "model", "optimizer.pt", "rng.pt", "scheduler.pt", "state.json"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000003"
    assert list((path / "model").glob("*.safetensors"))
    assert (path / "model" / "tokenizer.json").is_file()

    # Disturb every RNG, then restore into a freshly initialised model / optimizer / scheduler.
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    fresh_model, fresh_opt, fresh_sched = training_setup(seed=1)
    assert not torch.equal(fresh_model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    loaded = load_checkpoint(tmp_path, fresh_model, fresh_opt, fresh_sched)

    assert (random.random(), float(np.random.rand())) == expected_draws[:2]
    assert torch.equal(torch.rand(4), expected_draws[2])
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh_model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert fresh_sched.last_epoch == scheduler.last_epoch == 3
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    saved_opt, loaded_opt = optimizer.state_dict(), fresh_opt.state_dict()
    assert saved_opt["state"].keys() == loaded_opt["state"].keys()
    for key, entry in saved_opt["state"].items():
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[field], loaded_opt["state"][key][field])
    assert {k: loaded[k] for k in state} == state
    assert loaded["rollout_id"] == 3 and loaded["memrl_version"] and loaded["created"]

    # Training on continues identically from the restored objects.
    torch.manual_seed(5)
    train_steps(model, optimizer, scheduler, steps=1)
    torch.manual_seed(5)
    train_steps(fresh_model, fresh_opt, fresh_sched, steps=1)
    assert torch.equal(model.lm_head.weight, fresh_model.lm_head.weight)


def test_state_accepts_pydantic_config_and_fills_defaults(tmp_path):
    from memrl.config import Config

    model, optimizer, scheduler = training_setup()
    path = save_checkpoint(tmp_path, 0, model, optimizer, scheduler, {"config": Config()})
    state = json.loads((path / "state.json").read_text())
    assert state["next_rollout_id"] == 1
    assert state["config"]["train"]["lr"] == Config().train.lr


def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path, monkeypatch):
    first, first_model = save_simple(tmp_path, 1, seed=0)
    real_save = torch.save

    def crashing_save(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise OSError("disk full (simulated)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated"):
        save_simple(tmp_path, 2, seed=1)
    monkeypatch.undo()

    assert list_checkpoints(tmp_path) == [first]
    assert find_latest_checkpoint(tmp_path) == first
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000001"
    assert not any(".tmp-" in p.name for p in (tmp_path / "checkpoints").iterdir())
    fresh, *_ = training_setup(seed=3)
    assert load_checkpoint(tmp_path, fresh)["rollout_id"] == 1
    assert torch.equal(fresh.lm_head.weight, first_model.lm_head.weight)


def test_killed_save_leftovers_are_never_picked(tmp_path):
    first, _ = save_simple(tmp_path, 1)
    # What a SIGKILL mid-save leaves: a temp dir, or (by hand) an iter_ dir with no COMPLETE marker.
    half = tmp_path / "checkpoints" / "iter_0000002"
    half.mkdir()
    (half / "state.json").write_text("{}")
    (tmp_path / "checkpoints" / "iter_0000003.tmp-12345" / "model").mkdir(parents=True)

    assert list_checkpoints(tmp_path) == [first]
    assert find_latest_checkpoint(tmp_path) == first
    with pytest.raises(CheckpointError, match=r"incomplete.*iter_0000001"):
        load_checkpoint(half, tiny_model())


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    return child.pid


@pytest.fixture
def leftovers(tmp_path):
    """Tmp folders of a killed writer on this host, of a live one, of another host, and an old-style one."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host, dead = socket.gethostname(), _dead_pid()
    ckpt_dir = tmp_path / "checkpoints"
    names = {"dead": f"iter_0000003.tmp-{host}-{dead}", "live": f"iter_0000004.tmp-{host}-{live.pid}",
             "other_host": f"iter_0000005.tmp-{host}x-{dead}", "no_host": f"iter_0000006.tmp-{dead}"}
    for name in names.values():
        (ckpt_dir / name / "model").mkdir(parents=True)
        (ckpt_dir / name / "model" / "model.safetensors").write_bytes(b"half")
    yield ckpt_dir, names
    live.kill()
    live.wait()


def _remaining(ckpt_dir, names):
    return sorted(k for k, name in names.items() if (ckpt_dir / name).exists())


def test_next_save_removes_only_dead_writers_tmp_folders_of_this_host(tmp_path, leftovers):
    ckpt_dir, names = leftovers
    save_simple(tmp_path, 1)
    assert _remaining(ckpt_dir, names) == ["live", "no_host", "other_host"]


def test_resume_removes_dead_writers_tmp_folders(tmp_path, leftovers):
    ckpt_dir, names = leftovers
    (ckpt_dir / names["dead"]).rename(ckpt_dir / "keep")  # the save below would remove it already
    save_simple(tmp_path, 1)
    (ckpt_dir / "keep").rename(ckpt_dir / names["dead"])
    load_checkpoint(tmp_path, tiny_model())
    assert _remaining(ckpt_dir, names) == ["live", "no_host", "other_host"]


def test_a_finished_checkpoint_left_in_its_tmp_folder_is_put_in_place_not_deleted(tmp_path):
    # Killed between moving the old iter_X aside and renaming the finished tmp folder: the tmp folder is the
    # checkpoint (COMPLETE written); the next save recovers it.
    first, _ = save_simple(tmp_path, 2)
    tmp = first.with_name(f"{first.name}.tmp-{socket.gethostname()}-{_dead_pid()}")
    first.rename(tmp)
    save_simple(tmp_path, 3)
    assert (first / COMPLETE_MARKER).is_file() and not tmp.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_0000002", "iter_0000003"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads fsync's descriptors back via /proc")
def test_every_file_and_folder_is_fsynced_before_complete(tmp_path, monkeypatch):
    # fsync gets a descriptor: read back which path it is, and whether COMPLETE existed at that moment.
    synced: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        tmp = next((p for p in [path, *path.parents] if ".tmp-" in p.name), None)
        if tmp is not None:
            synced.append((path.relative_to(tmp).as_posix(), (tmp / "COMPLETE").exists()))
        real_fsync(fd)

    monkeypatch.setattr(ckpt_mod.os, "fsync", recording_fsync)
    path, _ = save_simple(tmp_path, 1, tokenizer=build_tiny_tokenizer())
    before_complete = {rel for rel, complete in synced if not complete}
    written = {p.relative_to(path).as_posix() for p in path.rglob("*")} | {"."}
    assert written - {"COMPLETE"} <= before_complete, written - before_complete
    assert {"model", "model/model.safetensors", "optimizer.pt", "state.json", "."} <= before_complete


def test_latest_falls_back_when_named_checkpoint_was_removed(tmp_path):
    first, _ = save_simple(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_text("iter_0000009\n")
    assert find_latest_checkpoint(tmp_path) == first
    assert find_latest_checkpoint(tmp_path / "checkpoints") == first


def test_resave_same_id_replaces_it_and_keep_last_prunes(tmp_path):
    save_simple(tmp_path, 1, seed=0)
    path, replacement = save_simple(tmp_path, 1, seed=1)
    fresh = tiny_model(seed=2)
    load_checkpoint(path, fresh, restore_rng=False)
    assert torch.equal(fresh.lm_head.weight, replacement.lm_head.weight)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_0000001", "latest"]

    for rollout_id in (2, 3, 4):
        save_simple(tmp_path, rollout_id)
        prune_checkpoints(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_0000003", "iter_0000004"]
    with pytest.raises(CheckpointError, match="keep_last"):
        prune_checkpoints(tmp_path, 0)


def test_missing_or_mismatched_checkpoints_raise_clear_errors(tmp_path):
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path, tiny_model())
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", tiny_model())
    path, _ = save_simple(tmp_path, 0)
    other = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(CheckpointError, match="miss keys"):
        load_checkpoint(path, other)
    wider = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(CheckpointError, match=r"another architecture: \d+ tensors differ in shape .*"
                                              r"model.embed_tokens.weight \(512, 32\) vs \(512, 64\)"):
        load_checkpoint(path, wider)


def test_export_to_hf_loads_with_auto_classes_and_gives_same_logits(tmp_path):
    model, optimizer, scheduler = training_setup()
    train_steps(model, optimizer, scheduler, steps=1)
    path = save_checkpoint(tmp_path / "run", 1, model, optimizer, scheduler, {}, tokenizer=build_tiny_tokenizer())

    out = export_to_hf(tmp_path / "run", tmp_path / "hf")
    assert out == tmp_path / "hf" and not (out / "optimizer.pt").exists()
    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("The capital of France is Paris.")["input_ids"]])
    model.eval()
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, model(ids).logits, atol=1e-6)

    with pytest.raises(CheckpointError, match="not empty"):
        export_to_hf(path, out)
    export_to_hf(path, tmp_path / "hf2", tokenizer=None)
    assert (tmp_path / "hf2" / "config.json").is_file()


def test_export_adds_tokenizer_when_checkpoint_has_none(tmp_path):
    path, _ = save_simple(tmp_path / "run", 0)
    with pytest.warns(UserWarning, match="no tokenizer"):
        export_to_hf(path, tmp_path / "bare")
    export_to_hf(path, tmp_path / "with_tok", tokenizer=build_tiny_tokenizer())
    assert AutoTokenizer.from_pretrained(tmp_path / "with_tok").vocab_size > 0


def test_tied_embeddings_round_trip(tmp_path):
    # Qwen3-0.6B ties lm_head to the embeddings; save_pretrained stores the shared tensor once.
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    path = save_checkpoint(tmp_path, 0, model, None, None, {})
    torch.manual_seed(1)
    fresh = Qwen3ForCausalLM(config)
    load_checkpoint(path, fresh)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    with pytest.raises(CheckpointError, match="no optimizer.pt"):
        load_checkpoint(path, fresh, optimizer=torch.optim.AdamW(fresh.parameters()))


def test_prune_keeps_the_newest_n_the_latest_and_the_best(tmp_path):
    from memrl.train.checkpoint import find_best_checkpoint, prune_checkpoints, read_best, write_best

    for rollout_id in range(4):
        save_simple(tmp_path, rollout_id)
    write_best(tmp_path, 0, "eval/heldout/em", 50.0, "max")
    removed = prune_checkpoints(tmp_path, keep_last_n=1)
    assert sorted(p.name for p in removed) == ["iter_0000001", "iter_0000002"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["iter_0000000", "iter_0000003"]
    assert find_best_checkpoint(tmp_path).name == "iter_0000000"
    assert find_latest_checkpoint(tmp_path).name == "iter_0000003"
    shutil.rmtree(tmp_path / "checkpoints" / "iter_0000000")  # deleted by hand: best.json names nothing
    assert read_best(tmp_path) is None
    with pytest.raises(CheckpointError, match="complete checkpoint"):
        write_best(tmp_path, 7, "eval/heldout/em", 1.0, "max")
