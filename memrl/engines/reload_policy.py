"""Which folders `memrl serve` may reload weights from, and what they must hold (POST /v1/reload_weights).

Reloads are disabled unless the operator names folders (`--reload-root`). A path outside them gets one
403 whether or not it exists (`..` collapsed as text, then symlinks resolved and checked again), as does
a folder holding a link (at any depth) that resolves outside them; a folder whose config or tokenizer
differs from the served model's is a 409, never a silent swap; a path the OS cannot look at is a 400.

What is checked is what is loaded: the folder is opened from its root one name at a time without following
a link (`O_NOFOLLOW`, relative to the folder above), each file likewise from the opened folder, and copied
from those open files into a private temporary folder; the checks and the engine read that copy. A file or
folder swapped for a link meanwhile is refused or never seen, not followed (tests/engines/test_reload_races.py).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import tempfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from memrl.config import ConfigError
from memrl.engines.server_requests import APIError

logger = logging.getLogger("memrl.engines.server")  # the server's log, where refusals are explained


RELOAD_DISABLED_MESSAGE = (
    "weight reloads are disabled on this server: start memrl serve with --reload-root DIR (repeatable) "
    "naming the folders it may reload from, e.g. the training run root that holds weights_sync"
)
RELOAD_FORBIDDEN_MESSAGE = (
    "reload path is outside the folders this server may reload from; write the weights under one of "
    "them, or restart memrl serve with a --reload-root that covers this path"
)
LINK_OUT_MESSAGE = (
    "reload folder {given!r} holds {entry!r}, a link that leads outside the folders this server may "
    "reload from; copy the file into the folder instead of linking it"
)
# Config fields that decide the shapes of a model's weights (or, model_type/architectures, which module
# holds them). Names differ between model families, so each is compared only where a config has it.
ARCHITECTURE_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "num_experts",
    "num_local_experts", "moe_intermediate_size", "n_embd", "n_layer", "n_head", "n_inner", "n_positions",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
# Every file a tokenizer's vocabulary is read from: equal bytes, equal vocabulary, no reload needed.
TOKENIZER_INPUTS = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.txt")
CHECKED_FILES = ("config.json", *TOKENIZER_INPUTS)  # what the checks read: all a first check copies
# O_NONBLOCK: opening a FIFO planted in the folder must not hang the reload (it is then skipped, not read).
_NO_LINKS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CHUNK = 1 << 24


def _tokenizer_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in TOKENIZER_INPUTS:
        if (folder / name).is_file():
            digest.update(f"{name}\0{(folder / name).stat().st_size}\0".encode())
            digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def _copy_file(fd: int, target: Path) -> None:
    """Copy the open file `fd` to the new file `target`. No room for it is the server's problem (507)."""
    try:
        with open(target, "xb") as out:
            while chunk := os.read(fd, _CHUNK):
                out.write(chunk)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise APIError(507, f"no room for the private copy a reload loads from ({target.parent}): {exc.strerror}; "
                            "free space there or point TMPDIR at a larger disk", "server_error") from exc


def _architecture_differences(served: Mapping[str, Any], other: Mapping[str, Any],
                              prefix: str = "") -> list[str]:
    """'field: other (served: value)' for each architecture field that differs, nested text_config too."""
    diffs = []
    for key in ARCHITECTURE_FIELDS:
        mine, theirs = served.get(key), other.get(key)
        if key == "architectures" and not (mine and theirs):
            continue  # a config loaded without it only gains it on save; model_type still decides
        if mine != theirs:
            diffs.append(f"{prefix}{key}: {theirs!r} (served: {mine!r})")
    sub_served, sub_other = served.get("text_config"), other.get("text_config")
    if isinstance(sub_served, Mapping) and isinstance(sub_other, Mapping):
        diffs += _architecture_differences(sub_served, sub_other, prefix + "text_config.")
    return diffs


def read_model_config(folder: Path) -> dict[str, Any]:
    """The folder's config with transformers' defaults filled in (as the served model's own config)."""
    from transformers import AutoConfig

    # Never trust_remote_code: a reload request must not run code from the folder it names.
    return AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False).to_dict()


def _first_vocab_difference(served: Mapping[str, int], other: Mapping[str, int]) -> str:
    for token, token_id in served.items():
        if other.get(token) != token_id:
            return f"{token!r} is id {token_id} in the served tokenizer, {other.get(token)!r} there"
    extra = next(iter(set(other) - set(served)))
    return f"{extra!r} (id {other[extra]}) is not in the served tokenizer"


def check_reload_roots(roots: Sequence[str | os.PathLike] | None) -> None:
    """ConfigError for a root that exists but is not a folder (one that does not exist yet is fine:
    training creates its run root after the server starts)."""
    for root in roots or ():
        real = Path(os.path.realpath(root))
        if real.exists() and not real.is_dir():
            raise ConfigError(f"reload root {str(root)!r} is not a folder; pass the folder that holds the weights "
                              "(e.g. the training run root)")


class ReloadPolicy:
    """Which folders /v1/reload_weights may load, and what they must hold to fit the served model.
    `roots` are kept as given (made absolute) and with symlinks resolved at startup, so a root reached through
    a symlink is recognised either way, while a path's own symlinks (resolved per request) cannot lead out."""

    def __init__(self, roots: Sequence[str | os.PathLike] | None, config: Mapping[str, Any] | None,
                 tokenizer: Any) -> None:
        check_reload_roots(roots)
        self.roots = [(Path(os.path.abspath(root)), Path(os.path.realpath(root))) for root in roots or ()]
        self.config = dict(config) if config is not None else None
        get_vocab = getattr(tokenizer, "get_vocab", None)
        self.vocab = dict(get_vocab()) if callable(get_vocab) else None
        self._matching_tokenizers: set[str] = set()  # digests of tokenizer files found to match

    def check(self, path: str) -> None:
        """An APIError (4xx) unless the engine may load `path` (blocking I/O). Copies only the files the
        checks read: a quick first answer, before the reload waits for generations (`copy_checked` then
        copies and checks again what the engine will load)."""
        with tempfile.TemporaryDirectory(prefix="memrl-reload-check-") as private:
            self.copy_checked(path, Path(private), only=CHECKED_FILES)

    def copy_checked(self, path: str, into: Path, only: Collection[str] | None = None) -> Path:
        """Copy the folder `path` names into `into` (a private folder), through files opened without following
        links, and check the copy; return it (named as the folder) for the engine to load. `only`: the names,
        in the folder itself, to copy (all else is opened and checked but not copied). APIError (4xx) if not."""
        folder = self.resolve(path)
        copy = into / (folder.name or "model")
        try:
            try:
                fd = self._open_beneath(folder, os.O_DIRECTORY)
            except (FileNotFoundError, NotADirectoryError):
                raise APIError(400, f"reload path {path!r} is not a folder on the server's machine") from None
            try:
                self._copy_tree(fd, str(folder), copy, "", path, only, set())
            finally:
                os.close(fd)
            if self.config is not None:
                self._check_config(copy, path)
            if self.vocab is not None and any((copy / name).is_file() for name in TOKENIZER_FILES):
                self._check_vocab(copy, path)
        except OSError as exc:  # ENAMETOOLONG, EACCES, ELOOP (a link swapped in since it was resolved)
            raise APIError(400, f"reload path {path!r} cannot be read on the server's machine: "
                                f"{exc.strerror or exc}") from exc
        return copy

    def _inside_roots(self, real: Path) -> bool:
        return any(real.is_relative_to(root) for _, root in self.roots)

    def _open_beneath(self, real: Path, flags: int = 0) -> int:
        """A descriptor of `real`, a resolved path inside a root, opened from the root one name at a time,
        each relative to the folder above and none followed if it is a link: a folder on the way swapped for
        a link since `real` was resolved fails (ELOOP, ENOTDIR), instead of leading out of the roots."""
        root = next(root for _, root in self.roots if real.is_relative_to(root))
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in real.relative_to(root).parts:
                fd, above = os.open(name, _NO_LINKS | flags, dir_fd=fd), fd
                os.close(above)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _copy_tree(self, fd: int, real: str, copy: Path, relative: str, given: str,
                   only: Collection[str] | None, seen: set[tuple[int, int]]) -> None:
        """Copy the folder open at `fd` (its real path `real`) to `copy`, refusing (403) an entry, at any depth,
        that links outside every root: the engine would read through it. Links inside the roots are followed,
        each folder copied once (a link loop ends); an entry that vanished meanwhile is skipped."""
        info = os.fstat(fd)
        seen.add((info.st_dev, info.st_ino))
        copy.mkdir()
        for name in os.listdir(fd):
            entry, entry_real = relative + name, os.path.join(real, name)
            try:
                child = os.open(name, _NO_LINKS, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.ELOOP:  # ELOOP: a link, which O_NOFOLLOW did not follow
                    raise
                entry_real = os.path.realpath(os.path.join(real, os.readlink(name, dir_fd=fd)))
                if not self._inside_roots(Path(entry_real)):
                    logger.warning("refused a reload from %r: %s links outside the roots", given, entry)
                    raise APIError(403, LINK_OUT_MESSAGE.format(given=given, entry=entry),
                                   "permission_denied") from None
                try:
                    child = self._open_beneath(Path(entry_real))
                except FileNotFoundError:  # a dangling link: nothing to copy
                    continue
            try:
                info = os.fstat(child)
                if stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) not in seen:
                    self._copy_tree(child, entry_real, copy / name, entry + "/", given,
                                    None if only is None else (), seen)
                elif stat.S_ISREG(info.st_mode) and (only is None or entry in only):
                    _copy_file(child, copy / name)
            finally:
                os.close(child)

    def resolve(self, path: str) -> Path:
        """The real folder `path` names: a 403 unless it lies under a root, whether it exists or not (`..`
        collapsed as text first, so nothing outside the roots is even looked at)."""
        if not self.roots:
            raise APIError(403, RELOAD_DISABLED_MESSAGE, "permission_denied")
        lexical = Path(os.path.abspath(path))
        if not any(lexical.is_relative_to(given) or lexical.is_relative_to(real) for given, real in self.roots):
            self._forbid(path)
        try:
            real = Path(os.path.realpath(lexical))
        except (OSError, ValueError):
            self._forbid(path)
        if not self._inside_roots(real):
            self._forbid(path)
        return real

    def _forbid(self, path: str) -> NoReturn:
        # The caller learns nothing about the path; the operator finds what was asked in the log.
        logger.warning("refused a reload from %r: outside --reload-root %s", path, [str(r) for r, _ in self.roots])
        raise APIError(403, RELOAD_FORBIDDEN_MESSAGE, "permission_denied")

    def _check_config(self, folder: Path, given: str) -> None:
        if not (folder / "config.json").is_file():
            raise APIError(400, f"reload folder {given!r} has no config.json; reload from a Hugging Face model folder")
        try:
            config = read_model_config(folder)
        except Exception as exc:  # unknown model_type, broken JSON: not the served architecture either way
            raise APIError(409, f"the config.json in {given!r} does not load as the served model's config ({exc}); "
                                "reload only checkpoints of the served model, or restart memrl serve on the new model",
                                "conflict") from exc
        diffs = _architecture_differences(self.config, config)
        if diffs:
            raise APIError(409, f"reload folder {given!r} holds a different model than the one served: "
                                f"{'; '.join(diffs)}. Reload only checkpoints of the served model (same architecture "
                                "and vocabulary), or restart memrl serve on the new model", "conflict")

    def _check_vocab(self, folder: Path, given: str) -> None:
        from transformers import AutoTokenizer

        # Training writes the same tokenizer with every step's weights; loading a 150k-token tokenizer
        # costs seconds, hashing its files milliseconds, so each distinct set of files is loaded once.
        digest = _tokenizer_digest(folder)
        if digest in self._matching_tokenizers:
            return
        try:
            vocab = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                  trust_remote_code=False).get_vocab()
        except Exception as exc:
            raise APIError(409, f"the tokenizer files in {given!r} do not load ({type(exc).__name__}: {exc}); the "
                                "served tokenizer decodes every reply, so a reload folder may only carry that same "
                                "tokenizer", "conflict") from exc
        if vocab != self.vocab:
            raise APIError(409, f"the tokenizer in {given!r} has a different vocabulary ({len(vocab)} tokens, "
                                f"served: {len(self.vocab)}; {_first_vocab_difference(self.vocab, vocab)}). Token ids "
                                "are checked and decoded with the served tokenizer: reload only folders with that "
                                "tokenizer (or none)", "conflict")
        self._matching_tokenizers.add(digest)
