"""Lazy re-exports for package ``__init__`` modules (PEP 562 module ``__getattr__``).

A package that re-exports its submodules' public names imports every submodule, and their
heavy dependencies (NumPy, SciPy, PyAV, mcap, Fabric), whenever any one submodule is imported:
``from dpflow_core.recordings.topics import DAS_DEFAULT`` would load the whole reader. With
:func:`lazy_exports` a name is imported from its submodule the first time it is looked up, so a
command pays only for what it uses (``python -X importtime`` shows the difference).
"""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` that import ``names`` on first use.

    Args:
        package: the package's ``__name__``.
        names: public name -> submodule (relative to ``package``) that defines it.

    Returns:
        (``__getattr__``, ``__dir__``) to assign in the package's namespace. The
        ``__getattr__`` raises AttributeError for any other name, as a module does.
    """

    def __getattr__(name: str) -> object:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(names) | set(vars(importlib.import_module(package))))

    return __getattr__, __dir__
