"""The ``dpflow`` command line (Typer).

Every command calls the same ``dpflow_core`` function as the matching Dagster
asset. Each stage registers its commands from its own module below; errors of
type :class:`dpflow_core.errors.DpflowError`, and OS errors, are printed in one line
and exit 2 (never a traceback). ``pair`` and ``report`` exit 1 when no episode is usable.
"""

from __future__ import annotations

import re
import sys

import typer
from typer.core import TyperCommand, TyperGroup

from dpflow_core.errors import DpflowError

def _flags_without_type(params):
    """On/off flags take no value: no "<bool>" after them in the help (this Typer shows one, which reads as if
    ``--overwrite true`` were asked for). Returns ``params``."""
    for p in params:
        if getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = ""
    return params


class _Group(TyperGroup):
    """The app and its sub-apps: their own flags (``--version``, ``--help``) without a value type."""

    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))


class _Command(TyperCommand):
    """A command whose usage line names its arguments the POSIX way: ``dpflow convert [OPTIONS] INPUTS...``,
    a required argument in capitals and an optional one in brackets (this Typer writes ``{inputs}...``), and whose
    on/off flags show no value type."""

    def get_params(self, ctx):
        return _flags_without_type(super().get_params(ctx))

    def collect_usage_pieces(self, ctx):
        pieces = super().collect_usage_pieces(ctx)
        return [re.sub(r"^\{(.+)\}|^\[(.+)\]",
                       lambda m: m.group(1).upper() if m.group(1) else f"[{m.group(2).upper()}]", p)
                if p != self.options_metavar else p for p in pieces]


app = typer.Typer(
    name="dpflow",
    help="Matrix Studio recordings -> replay buffer -> GPU server -> Diffusion Policy checkpoint.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def posix_usage(typer_app: typer.Typer) -> typer.Typer:
    """``typer_app`` with its commands' usage lines the POSIX way (:class:`_Command`) unless a command asks for
    another class; the same app, returned."""
    typer_app.info.cls = _Group
    register = typer_app.command

    def command(*args, cls=_Command, **kwargs):
        return register(*args, cls=cls, **kwargs)

    typer_app.command = command
    return typer_app


posix_usage(app)


def counted(n: int, noun: str) -> str:
    """``"1 episode"``, ``"3 episodes"``: a count with its noun in the number it needs (English ``-s`` plural)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _print_version(value: bool) -> None:
    if value:
        from dpflow_core import __version__

        typer.echo(f"dpflow {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Matrix Studio recordings -> replay buffer -> GPU server -> Diffusion Policy checkpoint."""


# Stage modules register their commands on ``app`` when imported.
from dpflow_core.cli import recordings as _recordings  # noqa: E402,F401
from dpflow_core.cli import dataset as _dataset  # noqa: E402,F401
from dpflow_core.cli import remote as _remote  # noqa: E402,F401
from dpflow_core.cli import runs as _runs  # noqa: E402,F401
from dpflow_core.cli import platform as _platform  # noqa: E402,F401
from dpflow_core.cli import lerobot as _lerobot  # noqa: E402,F401
from dpflow_core.cli import demo as _demo  # noqa: E402,F401
from dpflow_core.cli import validate as _validate  # noqa: E402,F401
from dpflow_core.cli import scale as _scale  # noqa: E402,F401
from dpflow_core.cli import serve as _serve  # noqa: E402,F401
from dpflow_core.cli import sim as _sim  # noqa: E402,F401
from dpflow_core.cli import view as _view  # noqa: E402,F401
from dpflow_core.cli import curate as _curate  # noqa: E402,F401
from dpflow_core.cli import clean as _clean  # noqa: E402,F401


def main() -> None:
    """Console-script entry point: run the app, print DpflowError in one line."""
    try:
        _run_app()
    except DpflowError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        _json_error(exc.code, exc.path, exc.reason)
        sys.exit(2)
    except OSError as exc:
        # An I/O error the stage did not expect (output folder not writable, disk full): one line, no traceback.
        where = f"{exc.filename}: " if exc.filename else ""
        typer.secho(f"error: {where}{exc.strerror or exc} (errno {exc.errno})", fg=typer.colors.RED, err=True)
        _json_error("os_error", None if exc.filename is None else str(exc.filename), f"{exc.strerror or exc} (errno {exc.errno})")
        sys.exit(2)


def _run_app() -> None:
    """Run the app. With ``--json``, Click does not exit on a usage error (a refused option value, a missing
    argument) but hands it here, where it is printed as Click prints it and, as JSON, on stdout."""
    if "--json" not in sys.argv[1:]:
        app()
        return
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except Exception as exc:
        # Typer's own Click exceptions (ClickException and its usage errors) carry show(), format_message() and
        # exit_code; every other exception (DpflowError, OSError) goes on to main()
        if not all(hasattr(exc, a) for a in ("show", "format_message", "exit_code")):
            raise
        exc.show()
        _json_error("usage", None, exc.format_message())
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def _json_error(code: str, path: str | None, reason: str) -> None:
    """A command asked for ``--json`` gets its refusal as JSON on stdout too, ``{"error": {"code", "path",
    "reason"}}``, so that a script reading stdout sees why instead of nothing (the line on stderr stays)."""
    if "--json" in sys.argv[1:]:
        import json

        typer.echo(json.dumps({"error": {"code": code, "path": path, "reason": reason}}))
