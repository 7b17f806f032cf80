"""`dpflow demo`: the main job, materialised through Dagster.

The Dagster side lives in ``dpflow_dagster.demo`` (``dpflow_core`` never imports
Dagster), so this command hands its arguments to that module in a fresh
interpreter of the same environment.
"""

from __future__ import annotations

import os
import sys

import typer

from dpflow_core.cli import app


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
    add_help_option=False,
)
def demo(ctx: typer.Context) -> None:
    """Recordings -> dataset -> GPU server -> smoke run -> training -> checkpoint -> evaluation,
    on the embedded Dagster instance (see `dpflow demo --help` for the options)."""
    args = [sys.executable, "-m", "dpflow_dagster.demo", *ctx.args]
    sys.stdout.flush()
    os.execv(sys.executable, args)
