"""How a stage's settings are declared once (DESIGN rule 16): a frozen dataclass whose fields carry their front ends.

Each settings class (:class:`~dpflow_core.conversion.settings.ConversionSettings`,
:class:`~dpflow_core.runs.settings.SmokeSettings`, :class:`~dpflow_core.runs.settings.TrainSettings`) declares
every field with :func:`setting`: its default, and in the field's metadata

* ``option``: the command-line flag (``dpflow convert``, ``dpflow smoke``, ...);
* ``config``: the field of the asset's Dagster config (a tuple when one setting spreads over several);
* ``help``: what the setting means, one sentence: the CLI help and the Dagster description;
* any further keys a stage needs (the runs' ``scale`` and ``unset``; ``cli``: ``(annotation, default)`` of an
  option whose command-line form differs from the field's, such as one GPU index for a tuple of them;
  ``repeat``: a tuple given as a repeatable option; ``short``: a one-letter flag beside the option).

:func:`front_ends` reads them back: the CLI options are made from them
(:func:`dpflow_core.cli.options.settings_options`), the Dagster configs name them, and tests fail when a field
lacks a front end. This module imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def setting(default: Any, option: str, config: str | tuple[str, ...], help: str = "", **extra: Any) -> Any:
    """A settings field with its ``default`` and its front ends (module doc): a :func:`dataclasses.field`."""
    return dataclasses.field(default=default, metadata={"option": option, "config": config, "help": help, **extra})


def front_ends(cls: type) -> dict[str, dict[str, Any]]:
    """Per field of the settings dataclass ``cls``: its metadata (``option``, ``config``, ``help`` and the rest)."""
    return {f.name: dict(f.metadata) for f in dataclasses.fields(cls)}


def fields_from_options(cls: type, values: Any) -> dict[str, Any]:
    """The keyword arguments of settings class ``cls`` from a command's parameters ``values`` (a mapping), named as
    the ``option`` flags (``--max-gap`` -> ``max_gap``); a parameter left out, or None, is left out (its default)."""
    names = {f: m["option"].lstrip("-").replace("-", "_") for f, m in front_ends(cls).items()}
    return {f: values[p] for f, p in names.items() if values.get(p) is not None}
