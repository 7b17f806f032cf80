"""Project-wide rules: dpflow_core never imports Dagster; Definitions load."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_never_imports_dagster_statically():
    offenders = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "dpflow_core").rglob("*.py"))
        if any(m == "dagster" or m.startswith(("dagster.", "dagster_")) for m in _imported_modules(p))
    ]
    assert offenders == []


def test_core_import_does_not_load_dagster():
    code = (
        "import sys, importlib, pkgutil, dpflow_core, dpflow_core.cli\n"
        "for m in pkgutil.walk_packages(dpflow_core.__path__, 'dpflow_core.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'dagster' or m.startswith(('dagster.', 'dagster_')))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_definitions_load():
    from dpflow_dagster.definitions import defs

    defs.validate_loadable(defs) if hasattr(defs, "validate_loadable") else None
    repo = defs.get_repository_def()
    assert repo is not None
