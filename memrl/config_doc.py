"""`memrl config`: every field of every config section with its type, constraints (`> 0`), value and
description, read from the pydantic models themselves so that the listing cannot drift from the checks."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel

from memrl.config import Config

_SECRETS = frozenset({"api_key"})
_BOUNDS = {annotated_types.Gt: ">", annotated_types.Ge: ">=", annotated_types.Lt: "<",
           annotated_types.Le: "<="}


def type_name(annotation: Any) -> str:
    """`int`, `float | None`, `'head' | 'tail'`, `list[str]`, `tuple[float, float]` for a field's annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field: Any) -> str:
    # Each annotated_types bound holds its number in the attribute named like the class (Gt.gt).
    return ", ".join(f"{_BOUNDS[type(meta)]} {getattr(meta, type(meta).__name__.lower())}"
                     for meta in field.metadata if type(meta) in _BOUNDS)


def _value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def describe_config(cfg: Config) -> str:
    """One block per section, one entry per field: `key: type (constraints) = value` and its description;
    values that differ from the default are marked `(set)`, so a recipe's choices stand out."""
    lines: list[str] = []
    for section_name in type(cfg).model_fields:
        section = getattr(cfg, section_name)
        lines.append(f"[{section_name}]")
        doc = (type(section).__doc__ or "").strip().splitlines()
        if doc:
            lines.append(f"  # {doc[0]}")
        for name, field in type(section).model_fields.items():
            value = getattr(section, name)
            if name in _SECRETS and value is not None:
                value = "<hidden>"  # a listing gets pasted into bug reports
            default = field.get_default(call_default_factory=True)
            bounds = _constraints(field)
            head = f"  {section_name}.{name}: {type_name(field.annotation)}" + (f" ({bounds})" if bounds else "")
            mark = "" if value == default else f"   (set; default {_value(default)})"
            lines.append(f"{head} = {_value(value)}{mark}")
            if field.description:
                lines.append(f"      {field.description}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
