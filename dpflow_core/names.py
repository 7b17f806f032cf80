"""Validation of names that reach file paths and remote shells.

Task, run and stem names become directory names, tmux session names and shell
arguments on the GPU server, so they are checked against a strict pattern
before anything runs (``x; rm -rf ~`` or ``../../etc`` never get through).
"""

from __future__ import annotations

import re

from dpflow_core.errors import InvalidNameError

#: Letters, digits, ``.``, ``_`` and ``-``; must start with a letter or digit; at most 128 chars.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_name(value: str, kind: str = "name") -> str:
    """Return ``value`` unchanged when it is a safe name, else raise.

    Raises:
        InvalidNameError: when ``value`` is empty, longer than 128 characters,
            contains anything but ``[A-Za-z0-9._-]``, starts with ``.``/``_``/``-``
            or contains ``..``.
    """
    if not isinstance(value, str) or not NAME_PATTERN.match(value) or ".." in value:
        raise InvalidNameError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-' only "
            "(starting with a letter or digit, no '..', at most 128 characters)"
        )
    return value
