"""`memrl convert-to-hf`: a checkpoint (memrl/train/checkpoint.py) as a plain Hugging Face folder.

A LoRA checkpoint is merged into the base model its adapters were trained on: by default the one recorded
at training time (`lora_base` of state.json: an absolute folder, so a relative model.path works from any
directory), else `--base-model`. The base must be of the recorded architecture (other shapes cannot merge)
and hold the recorded weights (`lora.weights_fingerprint`; `--allow-other-base` merges anyway, with a
warning). memrl_export.json in the folder written names the checkpoint, the base and what was checked.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from memrl.config import ConfigError, load_pretrained
from memrl.io import atomic_folder
from memrl.train import lora
from memrl.train.checkpoint import LORA_BASE, MODEL_DIR, CheckpointError, read_state_file, resolve_checkpoint

EXPORT_FILE = "memrl_export.json"  # an exported folder's provenance: checkpoint, rollout id, base model


def export_to_hf(checkpoint_path: str | Path, out_dir: str | Path, tokenizer: Any = None,
                 base_model: str | None = None, allow_other_base: bool = False) -> Path:
    """`memrl convert-to-hf`: a plain Hugging Face folder that `from_pretrained` loads, filled via a temporary
    sibling (an interrupted export never looks finished). `tokenizer` (an object or a folder / hub id) adds
    tokenizer files a checkpoint was saved without; `checkpoint_path` may be a run root."""
    ckpt = resolve_checkpoint(checkpoint_path)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export target {out} exists and is not empty; pick a new or empty folder")
    state = read_state_file(ckpt)
    provenance = {"checkpoint": str(ckpt.resolve()), "rollout_id": state.get("rollout_id"),
                  "memrl_version": state.get("memrl_version")}
    with atomic_folder(out) as tmp:
        if lora.is_adapter_folder(ckpt / MODEL_DIR):
            provenance.update(_merge_adapters(ckpt, state, tmp, base_model, allow_other_base))
            for file in (ckpt / MODEL_DIR).iterdir():  # the tokenizer files saved beside the adapters
                if file.is_file() and not file.name.startswith("adapter_") and file.name != "README.md":
                    shutil.copy2(file, tmp / file.name)
        else:
            shutil.copytree(ckpt / MODEL_DIR, tmp)
        if tokenizer is not None:
            if isinstance(tokenizer, str | Path):
                from transformers import AutoTokenizer

                tokenizer = load_pretrained(AutoTokenizer, tokenizer, "tokenizer")
            tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    if not any(out.glob("tokenizer*")):
        warnings.warn(f"{out} has no tokenizer files; pass a tokenizer to load it with AutoTokenizer", stacklevel=2)
    return out


def _lora_base_path(ckpt: Path, state: Mapping[str, Any]) -> tuple[str, str | None]:
    """The base model (and hub revision) a LoRA run trained from: the folder recorded at training time,
    else its hub id, else (older checkpoints) the run's model.path."""
    recorded = state.get(LORA_BASE) or {}
    model_cfg = (state.get("config") or {}).get("model") or {}
    if recorded.get("folder"):
        if not Path(recorded["folder"]).is_dir():
            relative = "" if Path(recorded["path"]).is_absolute() else f", relative to {recorded['cwd']}"
            raise CheckpointError(f"the base model {recorded['path']} of {ckpt} (recorded at training time{relative}: "
                                  f"{recorded['folder']}) is not found; pass --base-model DIR")
        return recorded["folder"], None
    path = recorded.get("path") or model_cfg.get("path")
    if not path:
        raise CheckpointError(f"{ckpt} holds LoRA adapters and its run names no model.path to merge them into; "
                              f"pass --base-model DIR")
    return path, model_cfg.get("revision")


def _merge_adapters(ckpt: Path, state: Mapping[str, Any], tmp: Path, base_model: str | None,
                    allow_other_base: bool) -> dict[str, Any]:
    """Merge the adapters of `ckpt` into their base model, written to `tmp`; the base and what was checked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, revision = (base_model, None) if base_model else _lora_base_path(ckpt, state)
    hint = "" if base_model else " (the base model recorded at training time); pass --base-model DIR"
    recorded = state.get(LORA_BASE)
    try:
        if recorded is not None:  # before loading gigabytes of weights
            other = lora.config_differences(recorded["architecture"],
                                            load_pretrained(AutoConfig, path, "base model", revision=revision))
            if other:
                raise CheckpointError(f"base model {path} is another architecture than the one the adapters of {ckpt} "
                                      f"were trained on ({lora.describe_base(recorded)}): "
                                      f"{'; '.join(other)} (checkpoint vs "
                                      f"{path}); pass that model as --base-model")
        base = load_pretrained(AutoModelForCausalLM, path, "base model", revision=revision, dtype=torch.float32)
    except ConfigError as error:
        raise CheckpointError(f"{error}{hint}") from error
    if recorded is None:
        checked = "nothing: the checkpoint was saved before memrl recorded its base model"
        warnings.warn(f"{ckpt} records no base model: not checked that {path} is the one its adapters were "
                      f"trained on", stacklevel=3)
    elif (fingerprint := lora.weights_fingerprint(base)) == recorded["fingerprint"]:
        checked = "architecture and weights fingerprint match the checkpoint's record"
    elif allow_other_base:
        checked = "architecture only: other weights than at training time (--allow-other-base)"
        warnings.warn(f"merging the adapters of {ckpt} into {path}, whose weights differ from the base they were "
                      f"trained on ({lora.describe_base(recorded)}): --allow-other-base", stacklevel=3)
    else:
        raise CheckpointError(f"base model {path} has the architecture but not the weights of the one the adapters "
                              f"of {ckpt} were trained on ({lora.describe_base(recorded)}; "
                              f"fingerprint of sampled weights "
                              f"{fingerprint} vs {recorded['fingerprint']}); pass that model as --base-model, or "
                              f"--allow-other-base to merge anyway")
    lora.export_merged(ckpt / MODEL_DIR, base, tmp)
    return {"base_model": path, "base_model_checked": checked}

