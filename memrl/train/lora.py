"""LoRA (`model.lora`): the actor trains peft adapters on a frozen base; everything outside it sees a plain model.

The KL reference is the same model with the adapters disabled (no second copy). Engines and
`save_pretrained` folders get *merged* weights (base + peft's `get_delta_weight`, Hugging Face names), so
the weight-sync contract is unchanged. A checkpoint's `model/` holds the adapters only; adapters mean
something only on the base, rank, alpha and layers they were trained with, so `add_adapters` records the
base (`base_record`) and resume and `convert-to-hf` compare against it (memrl/train/checkpoint.py refuses).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from memrl.config import ConfigError, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's name of the one adapter memrl trains
BASE_RECORD = "memrl_base_record"  # attribute of the PeftModel that add_adapters returns: its base_record
# The config fields that make two bases the same architecture (adapter shapes follow from them).
_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim")
_FINGERPRINT_SAMPLES = 1024  # values of each tensor hashed by weights_fingerprint


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ConfigError(f"model.lora needs peft ({error}): pip install 'memrl[lora]', or unset model.lora") from error
    return peft


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """`model` with adapters injected in place (base frozen), as a `PeftModel` carrying its `base_record`."""
    peft = _peft()
    _check_targets(model, lora.target_modules)
    record = base_record(model)  # before injection: the plain model's names, as convert-to-hf loads it
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha if lora.alpha is not None else 2 * lora.rank,
                             lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, config)
    setattr(peft_model, BASE_RECORD, record)
    return peft_model


def _check_targets(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Every entry of model.lora.target_modules names a layer, by peft's rule (a name or its last dotted
    parts; a string: a regex): peft ignores a misspelt entry beside good ones."""
    from transformers.pytorch_utils import Conv1D

    if targets == "all-linear":
        return
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    layers = [name for name, module in model.named_modules() if isinstance(module, kinds)]
    if isinstance(targets, str):
        unmatched = [] if any(re.fullmatch(targets, name) for name in layers) else [targets]
    else:
        unmatched = [t for t in targets if not any(name == t or name.endswith(f".{t}") for name in layers)]
    if unmatched:
        raise ConfigError(f"model.lora.target_modules: {unmatched} names no layer of this model that LoRA can "
                          f"adapt; its layers: {', '.join(_leaf_names(layers))} (or use all-linear)")


def _leaf_names(names: Any) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name in names})


def base_record(model: torch.nn.Module) -> dict[str, Any]:
    """What a LoRA checkpoint keeps of its base: `folder` absolute (a relative model.path means nothing
    elsewhere; `cwd` says what it was relative to), `architecture`, a `fingerprint` of its weights."""
    source = getattr(model, "name_or_path", "") or ""
    folder = Path(source).resolve() if source and Path(source).is_dir() else None
    return {"path": source or None, "folder": str(folder) if folder else None, "cwd": os.getcwd(),
            "architecture": architecture(model.config), "fingerprint": weights_fingerprint(model)}


def describe_base(record: Mapping[str, Any]) -> str:
    return record.get("folder") or record.get("path") or "a model built in code, not loaded from a folder"


def architecture(config: Any) -> dict[str, Any]:
    return {key: getattr(config, key, None) for key in _ARCHITECTURE}


def config_differences(recorded: Mapping[str, Any], config: Any) -> list[str]:
    now = architecture(config)
    return [f"{key} {recorded.get(key)} vs {now[key]}" for key in _ARCHITECTURE if recorded.get(key) != now[key]]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of each weight's name, shape and _FINGERPRINT_SAMPLES evenly spaced values (not all bytes:
    seconds per GB; a fine-tune differs nearly everywhere), as float32, as training loads the base."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        count = min(flat.numel(), _FINGERPRINT_SAMPLES)
        index = torch.arange(count, dtype=torch.int64) * (flat.numel() - 1) // max(count - 1, 1)
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(flat[index.to(flat.device)].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def adapter_differences(peft_model: Any, folder: Path) -> list[str]:
    """`model.lora.X saved vs now` for rank, alpha (another silently scales every update) and layers;
    dropout may change, it does not change what the weights mean."""
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    saved = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    now = peft_model.peft_config[ADAPTER]
    differ = []
    if saved.get("r") != now.r:
        differ.append(f"model.lora.rank {saved.get('r')} vs {now.r}")
    alpha = float(saved.get("lora_alpha") or 0)
    if alpha != float(now.lora_alpha):
        differ.append(f"model.lora.alpha {alpha:g} vs {float(now.lora_alpha):g}")
    with safe_open(str(Path(folder) / ADAPTER_WEIGHTS), "pt") as f:
        saved_layers = {key.split(".lora_")[0] for key in f.keys() if ".lora_" in key}
    layers = {name for name, module in peft_model.named_modules() if isinstance(module, LoraLayer)}
    if saved_layers != layers:
        differ.append(f"model.lora.target_modules {len(saved_layers)} layers {_leaf_names(saved_layers)} vs "
                      f"{len(layers)} layers {_leaf_names(layers)}")
    return differ


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def merged_weights(peft_model: Any) -> dict[str, torch.Tensor]:
    """The policy as new plain Hugging Face tensors: each adapted weight plus its adapter's delta."""
    from peft.tuners.lora import LoraLayer

    inner = peft_model.base_model.model
    deltas = {f"{name}.weight": module.get_delta_weight(ADAPTER)
              for name, module in inner.named_modules() if isinstance(module, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    for key, value in inner.state_dict().items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        value = value.detach()
        out[plain] = (value + deltas[plain].to(value.dtype)) if plain in deltas else value.clone()
    return out


def merged_model(peft_model: Any) -> torch.nn.Module:
    """A plain Hugging Face model (a new one) holding the merged weights; the actor's model is untouched."""
    return copy.deepcopy(peft_model).merge_and_unload()  # peft's merge: W + get_delta_weight, as merged_weights


class WithoutAdapters(torch.nn.Module):
    """`inner`'s forward with `peft_model`'s adapters off: the KL reference without a second copy."""

    def __init__(self, inner: torch.nn.Module, peft_model: Any) -> None:
        super().__init__()
        self.inner = inner
        self._peft = [peft_model]  # a list: not registered as a submodule a second time

    def forward(self, *args: Any) -> torch.Tensor:
        with self._peft[0].disable_adapter():
            return self.inner(*args)


def load_adapters(peft_model: Any, folder: Path) -> None:
    """A checkpoint's adapter tensors into `peft_model` (the caller checked `adapter_differences`)."""
    from safetensors.torch import load_file

    _peft().set_peft_model_state_dict(peft_model, load_file(str(Path(folder) / ADAPTER_WEIGHTS)))


def export_merged(adapter_folder: Path, base: torch.nn.Module, out: Path) -> None:
    peft_model = _peft().PeftModel.from_pretrained(base, str(adapter_folder))
    peft_model.merge_and_unload().save_pretrained(out)
