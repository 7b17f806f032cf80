"""Validation of names that reach file paths and remote shells.

Task, run and stem names become directory names, tmux session names and shell
arguments on the GPU server, so they are checked against a strict pattern
before anything runs (``x; rm -rf ~`` or ``../../etc`` never get through).

Stems (a recording's file name without its suffix) follow their own, wider rule,
:func:`validate_stem`: lab members name recordings in their own script and with
spaces (``抓取 0001``, ``pick_placé_0004``), and a stem only ever becomes a file
name inside a folder dpflow owns and a string in a dataset's metadata, never a
shell argument or a remote path. What could escape a folder stays out: path
separators, ``..``, a leading ``.``/``-``, control and other non-printing characters.
Every reader of a stem (pairing, manifest, conversion, cache, report) checks it
with ``validate_name(stem, "stem")`` or :func:`validate_stem`: the same rule.
"""

from __future__ import annotations

import re
import unicodedata

from dpflow_core.errors import InvalidNameError

#: Letters, digits, ``.``, ``_`` and ``-``; must start with a letter or digit; at most 128 chars.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Longest stem, in characters.
STEM_MAX_CHARS = 128
#: Characters a stem may hold besides Unicode letters (L*), digits (N*) and combining marks (M*);
#: parentheses: a file manager names its copies "X (1)".
STEM_PUNCTUATION = frozenset(" ._-()")


def validate_name(value: str, kind: str = "name") -> str:
    """Return ``value`` unchanged when it is a safe name, else raise.

    ``kind == "stem"`` applies :func:`validate_stem`'s rule instead.

    Raises:
        InvalidNameError: when ``value`` is empty, longer than 128 characters,
            contains anything but ``[A-Za-z0-9._-]``, starts with ``.``/``_``/``-``
            or contains ``..``.
    """
    if kind == "stem":
        return validate_stem(value)
    if not isinstance(value, str) or not NAME_PATTERN.match(value) or ".." in value:
        raise InvalidNameError(
            f"invalid {kind} {value!r}: use letters, digits, '.', '_' and '-' only "
            "(starting with a letter or digit, no '..', at most 128 characters)"
        )
    return value


def validate_stem(value: str) -> str:
    """Return the recording stem ``value`` unchanged when it is safe as a file name, else raise.

    A stem is 1 to :data:`STEM_MAX_CHARS` characters: Unicode letters and digits of any script,
    combining marks (a name copied from macOS arrives decomposed, ``e`` + U+0301) and
    :data:`STEM_PUNCTUATION`; it starts with a letter or digit, does not end in a space or ``.``
    (Windows drops those) and holds no ``..``. Bytes that were not UTF-8 (surrogate escapes) fail.

    Raises:
        InvalidNameError: naming the first offending character (as ``U+XXXX`` and its Unicode name).
    """
    def bad(why: str) -> InvalidNameError:
        return InvalidNameError(
            f"invalid stem {value!r}: {why}; a stem may hold letters and digits of any script, spaces, "
            "'.', '_', '-', '(' and ')' (starting with a letter or digit, not ending in a space or '.', no '..', "
            f"at most {STEM_MAX_CHARS} characters)")

    if not isinstance(value, str) or not value:
        raise bad("empty")
    if len(value) > STEM_MAX_CHARS:
        raise bad(f"{len(value)} characters")
    for i, ch in enumerate(value):
        cat = unicodedata.category(ch)
        letter_or_digit = cat[0] in "LN"
        if not (letter_or_digit or (i and (cat[0] == "M" or ch in STEM_PUNCTUATION))):
            name = unicodedata.name(ch, "unnamed")
            raise bad(f"character {i} is U+{ord(ch):04X} ({name})" + (" at the start" if i == 0 else ""))
    if value[-1] in " .":
        raise bad("it ends in a space or '.'")
    if ".." in value:
        raise bad("it holds '..'")
    return value
