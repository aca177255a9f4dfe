"""What every config section shares: `Section` (unknown keys refused, strict ints and bools, retired keys
named with their replacement), `ConfigError`, `import_object` for the config's `module:name` paths, and
`task_instance`, the one loader of the Task a config names."""

from __future__ import annotations

import importlib
import inspect
import numbers
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from memrl.errors import MemrlError

__all__ = ["ConfigError", "Section", "import_object", "task_instance"]


class ConfigError(ValueError, MemrlError):
    """A recipe or override that cannot be used; the message names the key and what to change."""


_SCALARS = {bool, int, float, str}


def _accepted_scalars(annotation: Any) -> set[type]:
    """The scalar types a field, or the items of a list/tuple field or the values of a dict field, accepts:
    `int | None` -> {int}, `tuple[float, float]` -> {float}, `Literal[0, 1]` -> {int}; empty for sections."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _accepted_scalars(get_args(annotation)[0])
    if origin is Literal:
        return {type(arg) for arg in get_args(annotation)} & _SCALARS
    if origin in (Union, types.UnionType, list, tuple):
        return set().union(*(_accepted_scalars(arg) for arg in get_args(annotation) if arg is not Ellipsis))
    if origin is dict:  # a mapping's values
        return _accepted_scalars(get_args(annotation)[1])
    return {annotation} & _SCALARS


def _lax_coercion(value: Any, accepted: set[type]) -> str | None:
    """Why pydantic's lax mode would silently change `value` (None if it would not): `true` would become
    1, `1.5` an int 1 or an error far from the cause, `"yes"` a bool. Floats still take ints (`lr: 1`) and
    numeric text (YAML 1.1 reads `1e-6` as a string); NaN and infinities are refused by allow_inf_nan."""
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_lax_coercion(item, accepted) for item in value)), None)
    if isinstance(value, dict):  # naming the entry
        return next((f"{key}: {why}" for key, item in value.items() if (why := _lax_coercion(item, accepted))), None)
    numeric = accepted & {int, float}
    if isinstance(value, bool):
        return (None if bool in accepted or not numeric
                else f"{value!r} is a bool where a number belongs; write the number")
    if type(value) in accepted or value is None:
        return None
    if bool in accepted and not numeric:
        return f"{value!r} is not a bool; write true or false"
    if numeric == {int} and not isinstance(value, numbers.Integral):
        return f"{value!r} is not a whole number; write an integer such as 4 (not 4.0, 1.5 or '4')"
    return None


def _on_off_switch(annotation: Any) -> bool:
    """Whether a field takes the words on and off (`Literal["auto", "on", "off"]`), which YAML 1.1 reads,
    unquoted, as the bools true and false."""
    return get_origin(annotation) is Literal and {"on", "off"} <= set(get_args(annotation))


class Section(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` turned every weight into NaN, `queue.timeout_s=.inf` overflowed
    # a later wait. Strict ints and bools (see `_lax_coercion`) for every field, also of plugin sections.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # Keys an earlier release had, each with the message that names what replaces it (or says it is gone):
    # refused even when set to null, so an old recipe stops with what to write instead of a bare "unknown key".
    retired_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired_keys(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and (old := [msg for key, msg in cls.retired_keys.items() if key in raw]):
            raise ValueError("; ".join(old))
        return raw

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _on_off_switch(annotation):
            return "on" if value else "off"  # what YAML made of the documented, unquoted `on` / `off`
        problem = _lax_coercion(value, _accepted_scalars(annotation))
        if problem is not None:
            raise ValueError(problem)
        return value


def import_object(spec: str) -> Any:
    """Load `module:attr` (also `module.attr`); a clear error when either part is missing."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"'{spec}' is not an import path; write it as 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module '{module_name}' of '{spec}': {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"module '{module_name}' has no '{attr}' (from '{spec}')") from e



# The base every task derives from, named rather than imported: memrl.task imports this package.
TASK_BASE = ("memrl.task", "Task")
_TASKS: dict[type, Any] = {}


def _not_a_task(found: Any) -> str:
    if isinstance(found, type):
        return f"the class {found.__module__}.{found.__qualname__}, which does not derive from memrl.task.Task"
    if callable(found):
        return f"a {type(found).__name__} ({getattr(found, '__qualname__', found)!r}), not a class"
    text = repr(found)
    return f"a {type(found).__name__} value ({text if len(text) <= 40 else text[:37] + '...'}), not a class"


def task_instance(spec: str, what: str = "plugins.task") -> Any:
    """The Task `spec` (`module:Class`) names, built once per process: loading a config (which asks it to
    `validate_config`), sizing the queue and running a command share it, as every config naming the class
    does (a task keeps per-run state in `ctx.scratch`, docs/custom-tasks.md). Anything but a Task subclass
    that takes no arguments is a one-line ConfigError saying what was found."""
    try:
        found = import_object(spec)
    except ConfigError as e:
        raise ConfigError(f"{what} = '{spec}': {e}; install what it needs or fix the path") from e
    if not (isinstance(found, type) and any((c.__module__, c.__qualname__) == TASK_BASE for c in found.__mro__)):
        raise ConfigError(f"{what} = '{spec}' is {_not_a_task(found)}; expected a Task class (a subclass of "
                          f"memrl.task.Task, e.g. memrl.tasks.single_turn:SingleTurnTask)")
    if found not in _TASKS:
        try:
            inspect.signature(found).bind()
        except TypeError as e:
            raise ConfigError(f"{what} = '{spec}': {found.__qualname__}() needs arguments ({e}); a Task is built "
                              f"with none (its settings come from the config): give them defaults") from None
        _TASKS[found] = found()
    return _TASKS[found]
