"""`dpflow serve`: a checkpoint behind openpi's websocket policy protocol (:mod:`dpflow_core.serving`)."""

from __future__ import annotations

import logging
from pathlib import Path

import typer

from dpflow_core.cli import app
from dpflow_core.serving.settings import ServeSettings

_DEFAULT = ServeSettings()


@app.command("serve")
def serve_cmd(
    checkpoint: Path = typer.Argument(..., help="The trainer checkpoint (.ckpt) to serve."),
    host: str = typer.Option(_DEFAULT.host, "--host", help="Address to bind; anything but loopback is warned about."),
    port: int = typer.Option(_DEFAULT.port, "--port", help="TCP port (0: any free port, printed when bound)."),
    device: str = typer.Option(_DEFAULT.device, "--device", help="torch device for inference (cpu, cuda, cuda:1, ...)."),
    threads: int = typer.Option(_DEFAULT.threads, "--threads", help="torch intra-op threads for CPU inference."),
    max_age_s: float = typer.Option(
        _DEFAULT.max_age_s, "--max-age-s", help="Refuse observations whose newest frame is older than this at the request's now_s."),
    batch_window_s: float = typer.Option(
        _DEFAULT.batch_window_s, "--batch-window-s", help="With several clients connected: how long a batch waits for their requests."),
    max_batch: int = typer.Option(_DEFAULT.max_batch, "--max-batch", help="Most requests stacked into one inference."),
    mkldnn: bool = typer.Option(_DEFAULT.mkldnn, "--mkldnn/--no-mkldnn", help="oneDNN convolutions on the CPU (slower for small policies)."),
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
