"""Command-line options made from a stage's settings class (:mod:`dpflow_core.settings`): declared once.

``dpflow convert`` (:class:`~dpflow_core.conversion.settings.ConversionSettings`), ``dpflow smoke|train`` and
``dpflow scale smoke|train`` (:class:`~dpflow_core.runs.settings.SmokeSettings` /
:class:`~dpflow_core.runs.settings.TrainSettings`) take one option per settings field, made here from the field's
default, type and metadata, and receive them as one ``settings`` value: a new field reaches the command line
without being written there, and an option cannot have another default than its setting.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, List, Optional

import typer

from dpflow_core.errors import DpflowError


_SCALARS = {"int": int, "float": float, "str": str}


def _annotation(field: dataclasses.Field) -> tuple[Any, Any]:
    """(annotation, default) of the option of settings field ``field``."""
    meta, default = field.metadata, field.default
    if "cli" in meta:
        return meta["cli"]
    if meta.get("repeat"):
        return List[str], list(default or ())
    if isinstance(default, tuple):
        return str, ",".join(map(str, default))
    if default is None:  # "int | None" (the settings modules' annotations are text): an optional int
        parts = [p.strip() for p in str(field.type).split("|") if p.strip() != "None"]
        return Optional[_SCALARS.get(parts[0], str) if len(parts) == 1 else str], None
    return type(default), default


def settings_options(cls: type, *, skip: Callable[[dict], bool] = lambda meta: False):
    """Decorate a Typer command so it takes one option per field of the settings dataclass ``cls`` (those whose
    metadata ``skip`` does not reject) and receives them as ``settings`` (``cls.from_options``).

    Each option is the field's ``option`` flag and ``help`` (:func:`dpflow_core.settings.front_ends`); its default
    is the field's (a tuple as ``"a,b"`` text, a ``repeat`` tuple as a repeatable option, None as no value, or
    the metadata's ``cli`` pair). The decorated function declares a parameter ``settings``; a bad value is
    refused by the settings class (one line, as every ``DpflowError``).

    Raises:
        TypeError: the function has no ``settings`` parameter.
    """

    def decorate(func):
        signature = inspect.signature(func)
        hints = typing.get_type_hints(func)
        if "settings" not in signature.parameters:
            raise TypeError(f"{func.__name__} must take a 'settings' parameter")
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in signature.parameters.values() if p.name != "settings"]
        added = []
        for f in dataclasses.fields(cls):
            if skip(dict(f.metadata)):
                continue
            annotation, default = _annotation(f)
            flags = [f.metadata["option"], *([f.metadata["short"]] if f.metadata.get("short") else [])]
            option = typer.Option(default, *flags, help=f.metadata["help"])
            name = f.metadata["option"].lstrip("-").replace("-", "_")
            added.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            values = {p.name: kwargs.pop(p.name) for p in added if p.name in kwargs}
            try:
                settings = cls.from_options(values)
            except DpflowError:
                raise  # the command line's one-line report
            except (TypeError, ValueError) as exc:  # a settings class that raises plain ValueError
                raise typer.BadParameter(str(exc)) from None
            return func(*args, settings=settings, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=own + added, return_annotation=None)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
        return wrapper

    return decorate
