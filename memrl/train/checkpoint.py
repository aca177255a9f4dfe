"""Checkpoints `RUN_ROOT/checkpoints/iter_XXXXXXX/` (the rollout id of the last *completed* step): save
atomically, resume exactly. One holds model/ (`save_pretrained`, or with LoRA peft's adapter folder),
optimizer.pt, scheduler.pt, rng.pt (python, numpy, torch CPU and CUDA generators), state.json (where to
resume, the config, with LoRA the base model's fingerprint) and COMPLETE, written last. Beside them:
`latest` (the newest complete one's name) and, with `train.keep_best`, `best.json`.

Invariants:
- Written into `iter_XXXXXXX.tmp-<host>-<pid>`, every file fsynced, COMPLETE, then renamed into place and
  only then `latest` replaced: a kill or power loss at any point leaves the previous checkpoint loadable,
  and COMPLETE never stands beside truncated weights. Killed writers' tmp folders (this host, pid gone)
  are removed at the next save and at a resume; live writers' and other hosts' are kept.
- Only directories named `iter_\\d{7}` holding COMPLETE are listed or loaded.
- Only rank 0 saves (under FSDP after every rank helped gather): the files are the same whichever strategy
  wrote them, so a run resumes under any strategy.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import time
import warnings
from collections.abc import Mapping
from contextlib import suppress
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from memrl.errors import MemrlError
from memrl.io import atomic_write_json, atomic_write_text
from memrl.train import lora

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
BEST_FILE = "best.json"
COMPLETE_MARKER = "COMPLETE"
MODEL_DIR = "model"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
LORA_BASE = "lora_base"  # state.json: lora.base_record of the base model a LoRA run trained
_CHECKPOINT_NAME = re.compile(r"^iter_(\d{7})$")
_TMP_NAME = re.compile(r"^iter_\d{7}\.tmp-(?P<host>.+)-(?P<pid>\d+)$")


class CheckpointError(RuntimeError, MemrlError):
    """A checkpoint that cannot be saved, found or loaded; the message says which and what to do."""


def checkpoint_name(rollout_id: int) -> str:
    if not 0 <= rollout_id <= 9_999_999:
        raise CheckpointError(f"rollout_id {rollout_id} does not fit iter_XXXXXXX (0..9999999)")
    return f"iter_{rollout_id:07d}"


def _memrl_version() -> str:
    try:
        return metadata.version("memrl")
    except metadata.PackageNotFoundError:
        return "unknown"


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE_MARKER).is_file()


def _checkpoints_dir(run_root: str | Path) -> Path:
    return Path(run_root) / CHECKPOINTS_DIR


def list_checkpoints(run_root: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest rollout id first (`run_root` may also be its checkpoints dir)."""
    root = Path(run_root)
    ckpt_dir = root / CHECKPOINTS_DIR if (root / CHECKPOINTS_DIR).is_dir() else root
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if _CHECKPOINT_NAME.match(p.name) and _is_complete(p)]
    return sorted(found, key=lambda p: int(_CHECKPOINT_NAME.match(p.name).group(1)))


def find_latest_checkpoint(run_root: str | Path) -> Path | None:
    """The checkpoint named by `latest` if complete, else the newest complete one, else None."""
    complete = list_checkpoints(run_root)
    if not complete:
        return None
    latest_file = complete[-1].parent / LATEST_FILE
    if latest_file.is_file():
        named = latest_file.parent / latest_file.read_text().strip()
        # `latest` is only ever written after its checkpoint completed, but a user may have deleted
        # that directory by hand: then fall back to the newest complete one.
        if _CHECKPOINT_NAME.match(named.name) and _is_complete(named):
            return named
    return complete[-1]


# ---------------------------------------------------------------------------------------------- saving


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    # numpy's MT19937 key is stored as a tensor so `torch.load(weights_only=True)` can read it back.
    numpy_state = {"bit_generator": np_state["bit_generator"],
                   "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                   "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                   "gauss": float(np_state["gauss"])}
    state: dict[str, Any] = {"python": random.getstate(), "numpy": numpy_state, "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_saved = state["numpy"]
    np.random.set_state({"bit_generator": np_saved["bit_generator"],
                         "state": {"key": np_saved["key"].numpy().astype(np.uint32), "pos": np_saved["pos"]},
                         "has_gauss": np_saved["has_gauss"], "gauss": np_saved["gauss"]})
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states and torch.cuda.is_available():
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.warn(f"checkpoint holds CUDA RNG states for {len(cuda_states)} devices but "
                          f"{torch.cuda.device_count()} are visible; CUDA RNG not restored (sampling on GPU will "
                          f"differ from the original run)", stacklevel=3)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):  # a pydantic config
        return value.model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"state value of type {type(value).__name__} is not JSON-serializable")


def _fsync_dir(path: Path) -> None:
    # Make the renames durable; not all platforms allow opening a directory, which is harmless.
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder bottom-up: save_pretrained and torch.save only
    write, so a power loss after COMPLETE could leave it beside truncated weights."""
    folders = []
    for folder, _, files in os.walk(root):
        folders.append(Path(folder))
        for name in files:
            with open(Path(folder) / name, "rb") as f:
                os.fsync(f.fileno())
    for folder in reversed(folders):
        _fsync_dir(folder)


def _tmp_name(name: str) -> str:
    # The host as well as the pid: a checkpoints folder on shared storage may hold tmp folders of
    # writers on other machines, whose pids cannot be checked from here.
    return f"{name}.tmp-{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by another user
    return True


def remove_dead_writers_tmp(ckpt_dir: Path) -> list[Path]:
    """Remove the tmp folders of killed saves (this host, pid gone; gigabytes each); returns them."""
    removed = []
    host = socket.gethostname()
    for path in ckpt_dir.iterdir() if ckpt_dir.is_dir() else []:
        match = _TMP_NAME.match(path.name)
        if match and path.is_dir() and match["host"] == host and not _pid_alive(int(match["pid"])):
            final = ckpt_dir / path.name.partition(".tmp-")[0]
            if _is_complete(path) and not final.exists():
                # Killed between moving an old copy aside and renaming this finished one into place: this
                # is the checkpoint; put it where it belongs instead of deleting it.
                os.replace(path, final)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _write_checkpoint_files(target: Path, rollout_id: int, model: torch.nn.Module, optimizer: Any,
                            scheduler: Any, state: dict[str, Any], tokenizer: Any,
                            weights: Mapping[str, torch.Tensor] | None) -> None:
    """Everything of one checkpoint into `target`, COMPLETE last."""
    target.mkdir(parents=True)
    model.save_pretrained(target / MODEL_DIR, **({"state_dict": dict(weights)} if weights is not None else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(target / MODEL_DIR)
    if optimizer is not None:
        torch.save(optimizer if isinstance(optimizer, Mapping) else optimizer.state_dict(), target / OPTIMIZER_FILE)
    if scheduler is not None:
        torch.save(scheduler.state_dict(), target / SCHEDULER_FILE)
    torch.save(_rng_state(), target / RNG_FILE)
    full_state = {
        "rollout_id": rollout_id, "next_rollout_id": rollout_id + 1, "data_cursor": None, "global_step": None,
        "config": None, **state,
        **({LORA_BASE: getattr(model, lora.BASE_RECORD)} if hasattr(model, lora.BASE_RECORD) else {}),
        "memrl_version": _memrl_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (target / STATE_FILE).write_text(json.dumps(full_state, indent=2, default=_jsonable) + "\n")
    _fsync_tree(target)
    atomic_write_text(target / COMPLETE_MARKER, f"{checkpoint_name(rollout_id)}\n")
    _fsync_dir(target)


def save_checkpoint(run_root: str | Path, rollout_id: int, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any, state: dict[str, Any], tokenizer: Any = None,
                    weights: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Save `iter_{rollout_id:07d}` atomically and point `latest` at it.
    `optimizer`/`scheduler` may be None (no file). A sharded model (FSDP) passes its gathered `weights`
    and its gathered optimizer state (a `state_dict()`-form mapping) as `optimizer`."""
    name = checkpoint_name(rollout_id)
    ckpt_dir = _checkpoints_dir(run_root)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / name
    remove_dead_writers_tmp(ckpt_dir)
    tmp = ckpt_dir / _tmp_name(name)
    if tmp.exists():  # left by an earlier crash of a process with our pid
        shutil.rmtree(tmp)
    try:
        _write_checkpoint_files(tmp, rollout_id, model, optimizer, scheduler, state, tokenizer, weights)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        # Replace an existing checkpoint of the same id without a moment where neither is complete
        # under a name we list: the old one is moved aside first, deleted only after the new is in place.
        old = ckpt_dir / f"{name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    atomic_write_text(ckpt_dir / LATEST_FILE, name + "\n")
    return final


def write_best(run_root: str | Path, rollout_id: int, metric: str, value: float, mode: str) -> Path:
    """Point `best.json` at the complete checkpoint of `rollout_id` (written atomically, after it)."""
    ckpt_dir = _checkpoints_dir(run_root)
    name = checkpoint_name(rollout_id)
    if not _is_complete(ckpt_dir / name):
        raise CheckpointError(f"best.json may only name a complete checkpoint; {ckpt_dir / name} is not one")
    record = {"checkpoint": name, "rollout_id": rollout_id, "metric": metric, "value": value, "mode": mode}
    return atomic_write_json(ckpt_dir / BEST_FILE, record)


def read_best(run_root: str | Path) -> dict[str, Any] | None:
    """The record of `best.json` when it names a complete checkpoint (else None: none yet, or deleted)."""
    path = _checkpoints_dir(run_root) / BEST_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record if _is_complete(path.parent / str(record.get("checkpoint"))) else None


def find_best_checkpoint(run_root: str | Path) -> Path | None:
    best = read_best(run_root)
    return None if best is None else _checkpoints_dir(run_root) / best["checkpoint"]


def prune_checkpoints(run_root: str | Path, keep_last_n: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last_n`, except the latest and the best;
    returns those deleted."""
    if keep_last_n < 1:
        raise CheckpointError(f"keep_last_n = {keep_last_n}; keep at least one checkpoint")
    keep = {find_latest_checkpoint(run_root), find_best_checkpoint(run_root)}
    removed = [p for p in list_checkpoints(run_root)[:-keep_last_n] if p not in keep]
    for path in removed:
        # Not complete first, then gone: a kill mid-delete leaves a folder nothing lists or loads.
        (path / COMPLETE_MARKER).unlink()
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --------------------------------------------------------------------------------------------- loading


def resolve_checkpoint(path: str | Path) -> Path:
    """A complete checkpoint directory from a checkpoint dir, a checkpoints dir or a run root."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    named = _CHECKPOINT_NAME.match(path.name) or (path / MODEL_DIR).is_dir()
    if named or (path / STATE_FILE).exists() or (path / COMPLETE_MARKER).exists():
        if not _is_complete(path):
            complete = [p.name for p in list_checkpoints(path.parent)]
            raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE_MARKER} marker: its save was "
                                  f"interrupted); complete checkpoints next to it: {complete or 'none'}")
        return path
    latest = find_latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"no complete checkpoint under {path}; pass a run root, its `{CHECKPOINTS_DIR}/` "
                              f"folder or an `iter_XXXXXXX` folder")
    return latest


def _check_shapes(weights: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], model_dir: Path) -> None:
    """Another architecture's weights: a CheckpointError naming the first tensors that differ (not
    load_state_dict's RuntimeError listing every one)."""
    differ = [f"{k} {tuple(v.shape)} vs {tuple(params[k].shape)}" for k, v in weights.items()
              if k in params and v.shape != params[k].shape]
    if differ:
        raise CheckpointError(f"checkpoint weights in {model_dir} are of another architecture: {len(differ)} "
                              f"tensors differ in shape (checkpoint vs model), e.g. {'; '.join(differ[:3])}; set "
                              f"model.path to the model the checkpoint was trained from, or --load one of this model")


def _check_adapters(peft_model: Any, ckpt: Path) -> None:
    """A resume's adapters (model.lora) and base architecture must be the checkpoint's; another base's
    weights of that architecture only warn (going on from adapters on an updated base is a user's choice)."""
    differ = lora.adapter_differences(peft_model, ckpt / MODEL_DIR)
    if differ:
        raise CheckpointError(f"checkpoint {ckpt} holds other adapters than this run's model.lora: "
                              f"{'; '.join(differ)} (checkpoint vs this run); set model.lora as in the run that "
                              f"saved it")
    recorded = read_state_file(ckpt).get(LORA_BASE)
    now = getattr(peft_model, lora.BASE_RECORD, None)
    if recorded is None or now is None:  # saved before memrl recorded the base, or a hand-made PeftModel
        return
    other = lora.config_differences(recorded["architecture"], peft_model.base_model.model.config)
    if other:
        raise CheckpointError(f"this run's base model ({lora.describe_base(now)}) is another architecture than "
                              f"the one the adapters of {ckpt} were trained on ({lora.describe_base(recorded)}): "
                              f"{'; '.join(other)} (checkpoint vs this run); set model.path to that base")
    if recorded["fingerprint"] != now["fingerprint"]:
        warnings.warn(f"this run's base model ({lora.describe_base(now)}) has other weights than the one the "
                      f"adapters of {ckpt} were trained on ({lora.describe_base(recorded)}; fingerprint "
                      f"{recorded['fingerprint']} vs {now['fingerprint']}); the resumed policy is not the saved one",
                      stacklevel=2)


def _load_model_weights(model: torch.nn.Module, model_dir: Path) -> None:
    has_adapters = hasattr(model, "peft_config")
    if lora.is_adapter_folder(model_dir) != has_adapters:
        held = "LoRA adapters" if not has_adapters else "whole weights, no adapters"
        raise CheckpointError(f"checkpoint {model_dir.parent} holds {held}, and this model "
                              f"{'has' if has_adapters else 'has no'} adapters; set model.lora as in the run that "
                              f"saved it")
    if has_adapters:
        _check_adapters(model, model_dir.parent)
        lora.load_adapters(model, model_dir)
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    _check_shapes(weights, model.state_dict(), model_dir)
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"checkpoint weights in {model_dir} do not fit this model: unexpected keys "
                              f"{result.unexpected_keys[:5]} (is the model built from the checkpoint's config.json?)")
    # save_pretrained drops tied weights (e.g. lm_head tied to the embeddings); those may be missing,
    # as long as they share storage with a loaded tensor.
    params = model.state_dict()
    loaded_ptrs = {params[k].data_ptr() for k in weights if k in params}
    untied_missing = [k for k in result.missing_keys if params[k].data_ptr() not in loaded_ptrs]
    if untied_missing:
        raise CheckpointError(f"checkpoint weights in {model_dir} miss keys {untied_missing[:5]}; the model has "
                              f"parameters the checkpoint does not (is it the same architecture?)")


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Load weights (and optimizer, scheduler, RNG states) into the given objects; return state.json.
    `path` as for `resolve_checkpoint`. Load the optimizer after the model is on its training device:
    `Optimizer.load_state_dict` moves the state tensors to their parameters' device."""
    ckpt = resolve_checkpoint(path)
    remove_dead_writers_tmp(ckpt.parent)  # a resume after a kill: the killed save's tmp folder goes now
    _load_model_weights(model, ckpt / MODEL_DIR)
    for obj, filename in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if obj is not None:
            obj.load_state_dict(read_checkpoint_file(ckpt, filename))
    if restore_rng:
        _restore_rng(read_checkpoint_file(ckpt, RNG_FILE))
    return read_state_file(ckpt)


def read_state_file(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def read_checkpoint_file(ckpt: Path, filename: str) -> Any:
    """One saved state of a complete checkpoint dir (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE), on the CPU."""
    if not (ckpt / filename).is_file():
        raise CheckpointError(f"{ckpt} has no {filename} (saved without one); pass None to skip it")
    return torch.load(ckpt / filename, map_location="cpu", weights_only=True)


def restore_rng(ckpt: Path) -> None:
    _restore_rng(read_checkpoint_file(ckpt, RNG_FILE))
