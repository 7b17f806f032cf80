"""Typed stage results: the frozen dataclasses each stage returns and the Dagster assets pass on.

Each result class mixes in :class:`StageResult`, which gives it ``to_dict()`` (JSON-safe values:
paths as strings, tuples as lists, nested results as dicts) and ``from_dict()`` (the inverse, which
checks every field against the dataclass's annotation and raises :class:`ResultError` naming the
class, the missing or bad field and what it holds). ``coerce()`` accepts either form: downstream
code reads a result whether the upstream value was stored as an instance or, by an earlier dpflow
version, as a plain dict of the same keys.

Supported field annotations: ``str``, ``int``, ``float``, ``bool``, ``Path``, ``Any``, ``X | None``,
``tuple[X, ...]``, ``list[X]``, ``dict[str, X]``, and classes with a ``from_dict`` of their own
(nested results, :class:`~dpflow_core.runs.spec.RunSpec`). An int is a float where a float is
expected; a bool is never a number.

Why not pydantic's ``TypeAdapter``: in its lax mode it takes ``True`` for a count and ``"3"`` for
a number, and its strict mode refuses the lists and strings that JSON gives for tuples and paths;
this converter is the one rule in between, and it needs no package the core does not already use.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from dpflow_core.errors import ResultError

R = TypeVar("R", bound="StageResult")


def _json_safe(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(value, "to_dict"):
        return _json_safe(value.to_dict())
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _convert(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the annotation ``hint`` wants it; :class:`ResultError` naming ``where`` otherwise."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _convert(value, inner[0], where)
        raise ResultError(f"{where}: unsupported annotation {hint!r}", code="bad_result")
    if value is None:
        raise ResultError(f"{where} must not be null", code="bad_field")
    if origin is tuple or origin is list:
        if not isinstance(value, (list, tuple)):
            raise ResultError(f"{where} must be a list, got {_describe(value)}", code="bad_field")
        fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis
        if fixed and len(value) != len(args):
            raise ResultError(f"{where} must have {len(args)} items, got {_describe(value)}", code="bad_field")
        item = args[0] if args else Any
        items = [_convert(v, args[i] if fixed else item, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ResultError(f"{where} must be a mapping, got {_describe(value)}", code="bad_field")
        item = args[1] if len(args) == 2 else Any
        return {str(k): _convert(v, item, f"{where}[{k!r}]") for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise ResultError(f"{where} must be true or false, got {_describe(value)}", code="bad_field")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ResultError(f"{where} must be an integer, got {_describe(value)}", code="bad_field")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ResultError(f"{where} must be a number, got {_describe(value)}", code="bad_field")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ResultError(f"{where} must be a string, got {_describe(value)}", code="bad_field")
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)):
            raise ResultError(f"{where} must be a path, got {_describe(value)}", code="bad_field")
        return Path(value)
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    if isinstance(hint, type) and hasattr(hint, "from_dict"):
        if not isinstance(value, Mapping):
            raise ResultError(f"{where} must be a mapping, got {_describe(value)}", code="bad_field")
        try:
            return hint.from_dict(value)
        except ResultError:
            raise
        except (TypeError, ValueError, KeyError) as exc:  # a from_dict of its own (RunSpec) and its checks
            raise ResultError(f"{where}: {exc}", code="bad_field") from exc
    raise ResultError(f"{where}: unsupported annotation {hint!r}", code="bad_result")


class StageResult:
    """Mix-in of the frozen result dataclasses: ``to_dict``, ``from_dict``, ``coerce``.

    ``from_dict`` ignores keys that are not fields (the derived figures some ``to_dict`` add).
    """

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-safe (``json.dumps`` accepts it): paths as strings, tuples as lists."""
        return {f.name: _json_safe(getattr(self, f.name)) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls: type[R], data: Mapping[str, Any]) -> R:
        """The result ``data`` describes (the form :meth:`to_dict` gives).

        Raises:
            ResultError: ``data`` is not a mapping, a field without a default is missing, or a
                value does not fit the field's type; the message names the class and the field.
        """
        if not isinstance(data, Mapping):
            raise ResultError(f"{cls.__name__}: expected a mapping, got {_describe(data)}", code="bad_result")
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if not f.init:
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ResultError(f"{cls.__name__}: field {f.name!r} is missing", code="missing_field")
                continue
            values[f.name] = _convert(data[f.name], hints[f.name], f"{cls.__name__}.{f.name}")
        return cls(**values)

    @classmethod
    def coerce(cls: type[R], value: Any) -> R:
        """``value`` itself when it is a ``cls``, else :meth:`from_dict` of it (a value stored as a dict)."""
        return value if isinstance(value, cls) else cls.from_dict(value)
