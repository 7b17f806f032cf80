"""`dpflow serve`: a checkpoint behind openpi's websocket policy protocol (:mod:`dpflow_core.serving`)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from dpflow_core.cli import app
from dpflow_core.serving.settings import ServeSettings, cli_option


def _option(name: str):
    """The option of the ServeSettings field ``name``: its default, flag and help are declared on the field."""
    default, flag, help_ = cli_option(name)
    return typer.Option(default, flag, help=help_)


@app.command("serve")
def serve_cmd(
    checkpoint: Path = typer.Argument(..., help="The trainer checkpoint (.ckpt) to serve."),
    host: str = _option("host"),
    port: int = _option("port"),
    device: str = _option("device"),
    max_age_s: float = _option("max_age_s"),
    threads: int = _option("threads"),
    batch_window_s: float = _option("batch_window_s"),
    max_batch: int = _option("max_batch"),
    mkldnn: bool = _option("mkldnn"),
) -> None:
    """Serve CHECKPOINT to robots: metadata on connect, an action chunk with target times per observation."""
    from dpflow_core.serving.server import serve

    try:
        settings = ServeSettings(host=host, port=port, device=device, max_age_s=max_age_s, threads=threads,
                                 batch_window_s=batch_window_s, max_batch=max_batch, mkldnn=mkldnn)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def ready(bound_host: str, bound_port: int) -> None:
        print(f"serving {checkpoint} on ws://{bound_host}:{bound_port}", flush=True)  # a supervisor waits for it

    try:
        serve(checkpoint, settings, ready=ready)
    except KeyboardInterrupt:
        typer.echo("stopped")
