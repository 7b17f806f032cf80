"""Project-wide rules: dpflow_core never imports Dagster; Definitions load; no import cycle; the sizes.

Sizes (issue 30), over ``dpflow_core``, ``dpflow_dagster`` and ``dpflow_pipes``: no module over 700 lines,
whatever its docstring; no function over 150 lines or with more than 10 parameters; no private name
imported from another dpflow module. A softer rule stays for the core: a module past 500 lines says why
in its docstring ("over 500 lines because ..."). Each rule is one test with no exemption list.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


#: The trainer's Pipes reporter: a plug-in outside the core that imports the standalone ``dagster-pipes``
#: package inside a function only (plain runs, and servers without the package, never import it).
PIPES_MODULE = "dpflow_pipes/reporter.py"


def _function_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module)
                elif isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
    return names


def test_core_never_imports_dagster_statically():
    offenders = []
    for p in sorted((REPO / "dpflow_core").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        bad = {m for m in _imported_modules(p) if m == "dagster" or m.startswith(("dagster.", "dagster_"))}
        if bad:
            offenders.append((rel, sorted(bad)))
    assert offenders == []
    plugin = REPO / PIPES_MODULE
    assert {m for m in _imported_modules(plugin) if m.startswith("dagster")} == {"dagster_pipes"}
    assert "dagster_pipes" in _function_level_imports(plugin)  # and nowhere at module level:
    top = {n.module for n in ast.parse(plugin.read_text()).body if isinstance(n, ast.ImportFrom)}
    assert not any(str(m).startswith("dagster") for m in top)


def test_plain_trainer_run_does_not_import_dagster_pipes(tmp_path):
    """Without the Pipes variables the trainer's reporter is None and nothing of Dagster is loaded."""
    code = (
        "import os, sys\n"
        "os.environ.pop('DAGSTER_PIPES_CONTEXT', None); os.environ.pop('DAGSTER_PIPES_MESSAGES', None)\n"
        "import dpflow_core.train.workspace\n"
        "from dpflow_core.train.reporting import open_reporter\n"
        "assert open_reporter(total_steps=10) is None\n"
        "bad = sorted(m for m in sys.modules if m == 'dagster' or m.startswith(('dagster.', 'dagster_')))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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


def test_dg_check_defs_loads_the_project():
    """The ``dg`` command line finds the project through pyproject.toml's [tool.dg] table and loads the
    definitions from the ``dpflow_dagster/defs`` folder, with no warning on the way."""
    dg_cli = Path(sys.executable).with_name("dg")
    proc = subprocess.run([str(dg_cli), "check", "defs"], capture_output=True, text=True, cwd=REPO, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "All definitions loaded successfully." in out
    assert "warning" not in out.lower(), out
    from dpflow_dagster import definitions

    stage_modules = {p.stem for p in (REPO / "dpflow_dagster" / "defs").glob("*.py")} - {"__init__"}
    assert stage_modules == {"recordings", "dataset", "lerobot", "remote", "training", "rollouts", "pipeline", "resources", "run_config"}
    assert {"paired_episodes", "dataset_npz", "remote_dataset", "train_run"} <= {
        k.to_user_string() for k in definitions.defs.resolve_asset_graph().get_all_asset_keys()}


# ------------------------------------------------------------------ module graph and size

MAX_MODULE_LINES = 500
#: A module above MAX_MODULE_LINES states why in its docstring with these words.
_SIZE_REASON = re.compile(r"\bover 500 lines\b", re.IGNORECASE)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _core_modules(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _import_targets(path: Path, name: str, known: set[str]) -> set[str]:
    """Every dpflow module ``path`` imports, at module level or inside a function.

    ``from a.b import c`` counts as importing ``a.b.c`` when that is a module, else ``a.b``.
    Relative imports are resolved against ``name``.
    """
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                targets.add(sub if sub in known else mod)
    return {t for t in targets if t in known}


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules whose code runs when it is imported.

    Importing ``p.q.m`` also runs the ``__init__`` of ``p`` and ``p.q``, except the packages the
    importer is itself inside (those are already being imported, and Python allows that).
    """
    modules = _core_modules(root)
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        parts = name.split(".")
        own = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        edges = set()
        for t in _import_targets(path, name, known):
            tparts = t.split(".")
            for i in range(1, len(tparts) + 1):
                dep = ".".join(tparts[:i])
                if dep in known and dep not in own:
                    edges.add(dep)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_core_modules():
    cycles = _cycles(_import_graph(REPO / "dpflow_core"))
    assert cycles == [], f"import cycles (module-level or inside functions): {cycles}"


def test_cycle_check_finds_a_cycle_and_accepts_sibling_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import f\n")
    (pkg / "sub" / "a.py").write_text("from pkg.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    return 1\n")
    (pkg / "c.py").write_text("def h():\n    from pkg.d import k\n")
    (pkg / "d.py").write_text("from pkg import c\n")
    graph = _import_graph(pkg)
    assert graph["pkg.sub.a"] == {"pkg.sub.b"}
    assert _cycles(graph) == [["pkg.c", "pkg.d"]]


def _oversized(root: Path) -> list[str]:
    out = []
    for name, path in _core_modules(root).items():
        n_lines = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if n_lines > MAX_MODULE_LINES and not _SIZE_REASON.search(doc):
            out.append(f"{name} ({n_lines} lines)")
    return out


def test_no_core_module_above_500_lines_without_a_stated_reason():
    assert _oversized(REPO / "dpflow_core") == []


def test_size_check_flags_a_long_module_without_a_reason(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "x = 1\n" * MAX_MODULE_LINES
    (pkg / "long.py").write_text('"""Long."""\n' + body)
    (pkg / "reasoned.py").write_text('"""Long: over 500 lines because it must be."""\n' + body)
    (pkg / "short.py").write_text('"""Short."""\n' + "x = 1\n" * (MAX_MODULE_LINES - 1))
    assert _oversized(pkg) == [f"pkg.long ({MAX_MODULE_LINES + 1} lines)"]


PACKAGES = ("dpflow_core", "dpflow_dagster", "dpflow_pipes")
HARD_MODULE_LINES = 700
MAX_FUNCTION_LINES = 150
MAX_PARAMETERS = 10


def _package_modules(roots: list[Path]) -> dict[str, Path]:
    return {name: path for root in roots for name, path in _core_modules(root).items()}


def _modules_over(roots: list[Path], limit: int) -> list[str]:
    """``"module (N lines)"`` for every module of ``roots`` longer than ``limit`` lines, docstring or not."""
    out = []
    for name, path in _package_modules(roots).items():
        n_lines = len(path.read_text().splitlines())
        if n_lines > limit:
            out.append(f"{name} ({n_lines} lines)")
    return out


def _private_imports(roots: list[Path]) -> list[str]:
    """``"module: other.module._name"`` for each private name one module takes from another.

    Both ``from other.module import _name`` (relative imports resolved) and ``alias._name`` where
    ``alias`` is another dpflow module (``import a.b as m``, ``from a import b``). Dunder names are
    public. A module's own names, and private *aliases* (``import x as _x``), are fine.
    """
    modules = _package_modules(roots)
    known = set(modules)
    out = []
    for name, path in modules.items():
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(), filename=str(path))
        module_alias: dict[str, str] = {}

        def private(n: str) -> bool:
            return n.startswith("_") and not n.startswith("__")

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.split(".")[0] not in known:
                    continue
                for a in node.names:
                    if f"{mod}.{a.name}" in known:
                        module_alias[a.asname or a.name] = f"{mod}.{a.name}"
                    elif private(a.name) and mod != name:
                        out.append(f"{name}: {mod}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known:
                        module_alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and private(node.attr)):
                continue
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not (isinstance(value, ast.Name) and value.id in module_alias):
                continue
            target = ".".join([module_alias[value.id], *reversed(chain)])
            if target in known and target != name:
                out.append(f"{name}: {target}.{node.attr}")
    return sorted(set(out))


def _function_offenders(roots: list[Path]) -> dict[str, str]:
    """``"module:qualname"`` -> why, for each function over MAX_FUNCTION_LINES lines (decorators left
    out) or with more than MAX_PARAMETERS parameters (``self``/``cls`` left out; ``*args``, ``**kwargs``
    and keyword-only ones counted)."""
    out: dict[str, str] = {}

    def visit(node: ast.AST, module: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, module, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                if prefix and a.args and a.args[0].arg in ("self", "cls"):
                    params = params[1:]
                n_lines = child.end_lineno - child.lineno + 1
                why = [f"{n_lines} lines"] if n_lines > MAX_FUNCTION_LINES else []
                why += [f"{len(params)} parameters"] if len(params) > MAX_PARAMETERS else []
                if why:
                    out[f"{module}:{prefix}{child.name}"] = ", ".join(why)
                visit(child, module, f"{prefix}{child.name}.")

    for name, path in _package_modules(roots).items():
        visit(ast.parse(path.read_text(), filename=str(path)), name, "")
    return out


_ROOTS = [REPO / pkg for pkg in PACKAGES]

def test_no_module_over_700_lines():
    assert _modules_over(_ROOTS, HARD_MODULE_LINES) == []


def test_no_private_name_imported_across_modules():
    assert _private_imports(_ROOTS) == []


def test_no_function_over_150_lines_or_10_parameters():
    assert _function_offenders(_ROOTS) == {}


def test_hard_size_check_flags_a_long_module_whatever_its_docstring(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "reasoned.py").write_text('"""Long: over 500 lines because it must be."""\n' + "x = 1\n" * HARD_MODULE_LINES)
    (pkg / "short.py").write_text("x = 1\n" * HARD_MODULE_LINES)
    assert _modules_over([pkg], HARD_MODULE_LINES) == [f"pkg.reasoned ({HARD_MODULE_LINES + 1} lines)"]


def test_private_import_check_flags_both_forms_and_nothing_else(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import _helper\n")
    (pkg / "sub" / "a.py").write_text("_LIMIT = 3\ndef _helper():\n    return _LIMIT\n")
    (pkg / "b.py").write_text(
        "import pkg.sub.a as m\nfrom pkg.sub import a\nfrom pkg import sub as _sub\nfrom pkg.sub.a import __doc__\n"
        "def f():\n    from pkg.sub.a import _LIMIT\n    return m._helper(), a._LIMIT, _sub.a, a.__name__\n")
    (pkg / "c.py").write_text("class K:\n    _x = 1\ndef g(k):\n    return k._x, K._x\n")
    assert _private_imports([pkg]) == [
        "pkg.b: pkg.sub.a._LIMIT", "pkg.b: pkg.sub.a._helper", "pkg.sub: pkg.sub.a._helper",
    ]


def test_function_check_flags_a_long_and_a_wide_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    long_body = "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    (pkg / "m.py").write_text(
        f"def just_short():\n{long_body}"
        f"def too_long():\n{long_body}    return x\n"
        "def ten(a, b, c, d, e, f, g, h, i, j):\n    pass\n"
        "def eleven(a, b, c, d, e, f, g, h, i, *, j, **k):\n    pass\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g, h, i, j):\n        pass\n"
        "    def wide(self, a, b, c, d, e, f, g, h, i, j, k):\n        def inner():\n" + "            y = 1\n" * MAX_FUNCTION_LINES)
    assert _function_offenders([pkg]) == {
        "pkg.m:too_long": f"{MAX_FUNCTION_LINES + 1} lines",
        "pkg.m:eleven": "11 parameters",
        "pkg.m:C.wide": f"{MAX_FUNCTION_LINES + 2} lines, 11 parameters",
        "pkg.m:C.wide.inner": f"{MAX_FUNCTION_LINES + 1} lines",
    }


# ------------------------------------------------------------------ README layout section

_LAYOUT_LINE = re.compile(r"^- `((?:dpflow_core|dpflow_dagster|dpflow_pipes)/[A-Za-z0-9_]+(?:/|\.py))`: \S")


def _readme_layout(text: str) -> list[str]:
    """The entries of the README's "How the code is laid out" section, in order."""
    section = text.split("## How the code is laid out", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for line in section.splitlines() if (m := _LAYOUT_LINE.match(line))]


def _top_level_entries(package: Path) -> set[str]:
    """``pkg/name/`` for each sub-package, ``pkg/name.py`` for each module (``__init__`` left out)."""
    out = set()
    for p in package.iterdir():
        if p.is_dir() and (p / "__init__.py").is_file():
            out.add(f"{package.name}/{p.name}/")
        elif p.suffix == ".py" and p.name != "__init__.py":
            out.add(f"{package.name}/{p.name}")
    return out


def test_readme_layout_lists_every_package_and_module_once():
    listed = _readme_layout((REPO / "README.md").read_text())
    assert len(listed) == len(set(listed)), "an entry is listed twice"
    actual = set().union(*(_top_level_entries(REPO / pkg) for pkg in ("dpflow_core", "dpflow_dagster", "dpflow_pipes")))
    assert set(listed) == actual, {"missing": sorted(actual - set(listed)), "stale": sorted(set(listed) - actual)}


def test_readme_layout_check_sees_a_missing_module(tmp_path):
    pkg = tmp_path / "dpflow_core"
    (pkg / "runs").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "runs" / "__init__.py").write_text("")
    (pkg / "files.py").write_text("")
    (pkg / "notes").mkdir()  # not a package
    readme = "## How the code is laid out\n\n- `dpflow_core/runs/`: runs.\n- `dpflow_core/gone.py`: old.\n\n## Next\n"
    assert _top_level_entries(pkg) == {"dpflow_core/runs/", "dpflow_core/files.py"}
    assert _readme_layout(readme) == ["dpflow_core/runs/", "dpflow_core/gone.py"]


#: Modules the command line must not load before a command that needs them runs (issue 19: start-up).
HEAVY_MODULES = ("numpy", "scipy", "torch", "av", "mcap", "pyarrow", "fabric", "paramiko", "cv2", "dagster")


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["convert", "--help"], ["export-lerobot", "--help"]])
def test_command_line_start_up_loads_no_heavy_module(argv):
    """``dpflow --version`` and the help pages register every command without importing NumPy, SciPy,
    torch, PyAV, mcap, pyarrow, Fabric or Dagster (each costs tenths of a second at every start)."""
    code = (
        "import sys\n"
        "from dpflow_core.cli import main\n"
        f"sys.argv = ['dpflow', *{argv!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code in (0, None), exc.code\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})\n"
        "sys.stderr.write(repr(bad)); sys.exit(3 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_slow_modules_listed_first_exist_and_the_suite_keeps_their_order():
    """tests/conftest.py's SLOW_MODULES_FIRST names real modules, each by its file name, found once in the
    folders under tests/ (a renamed one would silently lose its place), and scripts/test.sh keeps that order
    (xdist reorders modules by test count otherwise)."""
    from conftest import SLOW_MODULES_FIRST

    assert len(set(SLOW_MODULES_FIRST)) == len(SLOW_MODULES_FIRST)
    assert [m for m in SLOW_MODULES_FIRST if len(list((REPO / "tests").rglob(m))) != 1] == []
    assert "--no-loadscope-reorder" in (REPO / "scripts" / "test.sh").read_text()
