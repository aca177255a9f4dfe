"""LoRA (`model.lora`): the actor trains peft adapters on a frozen base; everything outside it sees a plain model.

- The actor wraps its model with `peft.get_peft_model`; the optimizer holds the adapters only.
- The reference of the KL term is the same model with the adapters disabled (`peft`'s
  `disable_adapter()`), not a second copy of the weights.
- Engines and `save_pretrained` folders get *merged* weights (`merged_weights`: base + peft's own
  `get_delta_weight`, under the Hugging Face names): the weight-sync contract (memrl/engines/base.py) is
  unchanged, so in-process engines copy them and served ones reload a plain folder.
- A checkpoint's `model/` holds the adapters (peft's `save_pretrained`: adapter_config.json +
  adapter_model.safetensors); resuming loads them onto the base model named by `model.path`.
  `convert-to-hf` merges them into a plain Hugging Face folder (`export_merged`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memrl.config import ConfigError, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's name of the one adapter memrl trains


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ConfigError(f"model.lora needs peft ({error}): pip install 'memrl[lora]', or unset model.lora") from error
    return peft


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """`model` with LoRA adapters injected in place (its base weights frozen), as a peft `PeftModel`."""
    peft = _peft()
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha if lora.alpha is not None else 2 * lora.rank,
                             lora_dropout=lora.dropout, target_modules=lora.target_modules, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def merged_weights(peft_model: Any) -> dict[str, torch.Tensor]:
    """The policy as plain Hugging Face tensors: each adapted layer's base weight plus its adapter's
    delta (peft's `get_delta_weight`), adapter tensors left out. New tensors, detached."""
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
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()  # peft's merge: W + get_delta_weight, as merged_weights


class WithoutAdapters(torch.nn.Module):
    """`inner`'s forward with the adapters of `peft_model` turned off: the base model, i.e. the KL reference,
    without a second copy of its weights."""

    def __init__(self, inner: torch.nn.Module, peft_model: Any) -> None:
        super().__init__()
        self.inner = inner
        self._peft = [peft_model]  # a list: not registered as a submodule a second time

    def forward(self, *args: Any) -> torch.Tensor:
        with self._peft[0].disable_adapter():
            return self.inner(*args)


def load_adapters(peft_model: Any, folder: Path) -> None:
    """Load a checkpoint's adapter tensors into `peft_model` (which must have the same adapters)."""
    from safetensors.torch import load_file

    peft = _peft()
    result = peft.set_peft_model_state_dict(peft_model, load_file(str(Path(folder) / ADAPTER_WEIGHTS)))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if result.unexpected_keys or missing:
        raise ConfigError(f"the adapters in {folder} do not fit this model's (unexpected {result.unexpected_keys[:3]}, "
                          f"missing {missing[:3]}); set model.lora (rank, target_modules) as in the run that saved them")


def export_merged(adapter_folder: Path, base_model: str, out: Path) -> None:
    """A plain Hugging Face folder at `out`: `base_model` (folder or hub id) with the adapters merged in."""
    from transformers import AutoModelForCausalLM

    from memrl.config import load_pretrained

    peft = _peft()
    base = load_pretrained(AutoModelForCausalLM, base_model, "base model", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, str(adapter_folder))
    peft_model.merge_and_unload().save_pretrained(out)
