"""Reading a configuration: YAML recipes (duplicate keys refused), `--set a.b=v` overrides, validation errors
as one `ConfigError` naming each key, and model paths checked before Hugging Face reads them."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from memrl.config.base import ConfigError, import_object
from memrl.config.root import Config, configured_task, task_settings

__all__ = ["apply_overrides", "check_model_path", "config_from_dict", "load_config", "load_pretrained",
           "load_yaml", "parse_override"]


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one, so a
    second `train:` block silently dropped the first. Merge keys (`<<: *base`) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:  # the mapping's own keys, before merges are flattened into it
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    where = f"line {line}" if first_line[key] == line else f"lines {first_line[key]} and {line}"
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {key!r} on {where}: the second would silently replace the first; "
                        f"merge them into one")
                first_line[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                pass
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """yaml.safe_load for config text (a recipe, an override's value), refusing duplicate keys."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' must look like section.key=value")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from e
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return raw


def _describe_error(cls: type[BaseModel], err: dict[str, Any], task: type[BaseModel] | None) -> str:
    loc = [str(p) for p in err["loc"]]
    if not loc:  # a check of the whole config (e.g. the retired rollout section): its message says it all
        return str(err["msg"]).removeprefix("Value error, ")
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(cls, loc[:-1], task)
        hint = difflib.get_close_matches(loc[-1], allowed, n=1)
        guess = f" (did you mean '{'.'.join(loc[:-1] + hint)}'?)" if hint else ""
        return f"unknown key '{key}'{guess}; allowed here: {', '.join(allowed)}"
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    return f"{key}{shown}: {err['msg']}"


def _allowed_keys(cls: type[BaseModel], loc: list[str], task: type[BaseModel] | None) -> list[str]:
    """The keys of the section at `loc`; the `task` section's are those of the configured task's Settings."""
    fields: dict[str, Any] = cls.model_fields
    for depth, part in enumerate(loc):  # a part that is no section (an optional section): no keys
        if depth == 0 and part == "task" and task is not None:
            fields = task.model_fields
        elif str(part).isdigit() and depth:  # an item of a list of sections (eval.sets.0): the item's keys
            continue
        else:
            annotation = fields[part].annotation if part in fields else None
            item = (getattr(annotation, "__args__", None) or [annotation])[0]  # list[EvalSetConfig]
            fields = getattr(annotation, "model_fields", None) or getattr(item, "model_fields", {})
    return sorted(fields)


def config_from_dict(raw: dict[str, Any], config_class: type[Config] | None = None) -> Config:
    if config_class is None:
        spec = (raw["plugins"] if isinstance(raw.get("plugins"), dict) else {}).get("config_class")
        config_class = import_object(spec) if spec else Config
        if not (isinstance(config_class, type) and issubclass(config_class, Config)):
            raise ConfigError(f"plugins.config_class '{spec}' must be a subclass of memrl.config.Config")
    try:
        return config_class.model_validate(raw)
    except ValidationError as e:
        try:  # the task section's keys, for the hints (a plugins.task that cannot load is an error of its own)
            task = task_settings(configured_task(raw) or "")
        except ConfigError:
            task = None
        lines = [_describe_error(config_class, err, task) for err in e.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                config_class: type[Config] | None = None) -> Config:
    """Read a YAML recipe (or start from defaults), apply `a.b=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe '{p}' does not exist" if not p.exists() else f"recipe '{p}' is not a file")
        try:
            raw = load_yaml(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"recipe '{p}' is not UTF-8 text (byte {e.start}: {e.reason}); "
                              f"save it as UTF-8") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe '{p}' is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe '{p}' must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, config_class)


# A hub id is `name` or `namespace/name` of word characters, '-' and '.'; anything else (a leading
# / . ~, a second slash, a space) can only be a local path.
_HUB_ID = re.compile(r"^[\w-][\w.-]*(/[\w.-]+)?$")


def check_model_path(path: str | Path, what: str = "model path") -> None:
    """Refuse a local-looking path that does not exist, before Hugging Face reads it as a hub id and
    answers "Repo id must be in the form ...", which hides that the folder is missing."""
    text = str(path)
    if not _HUB_ID.match(text) and not Path(text).exists():
        raise ConfigError(f"{what} {text} does not exist; pass an existing folder "
                          f"(or a hub id such as Qwen/Qwen3-0.6B)")


def load_pretrained(loader: Any, path: str | Path, what: str = "model", **kwargs: Any) -> Any:
    """`loader.from_pretrained(path, **kwargs)` (a transformers Auto class), its failures a `ConfigError`
    naming the path (check_model_path's for a missing local folder, else with the loader's reason)."""
    check_model_path(path, f"{what} path")
    try:
        return loader.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the {what} from {path}: {e}") from e
