"""`dpflow view`: episodes, datasets, predictions and rollouts as Rerun recordings (:mod:`dpflow_core.view`)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer

from dpflow_core.cli import app
from dpflow_core.cli.options import settings_options
from dpflow_core.view.settings import DatasetWindow


@app.command("view")
@settings_options(DatasetWindow)
def view_cmd(
    source: Path = typer.Argument(None, help="A <STEM>_vio.mcap, a task folder, a dataset.npz, or an .rrd to serve."),
    out: Path = typer.Option(None, "-o", "--out", help="The .rrd to write, or a folder (default: the current folder)."),
    predict: Path = typer.Option(None, "--predict", help="A checkpoint: show its predicted chunks against the recorded ones."),
    rollouts: Path = typer.Option(None, "--rollouts", help="A rollout folder (rollouts.json, trace_<seed>.npz) to show."),
    camera: str = typer.Option("jpeg", "--camera", help="Episodes: jpeg (decode frames) or video (H.264 as recorded)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing .rrd."),
    serve: bool = typer.Option(False, "--serve", help="Serve the recording with Rerun's web viewer on 127.0.0.1 until interrupted."),
    web_port: int = typer.Option(0, "--web-port", help="--serve: the viewer's HTTP port (0: a free one)."),
    grpc_port: int = typer.Option(0, "--grpc-port", help="--serve: the recording's gRPC port (0: a free one)."),
    settings: DatasetWindow = None,
) -> None:
    """Write a Rerun recording (.rrd) of SOURCE, print its path, and optionally serve it on loopback."""
    from dpflow_core.view.rrd import ViewError

    if source is None and rollouts is None:
        raise typer.BadParameter("nothing to view: give SOURCE (with --predict, the dataset.npz to predict on), "
                                 "or --rollouts DIR")
    if source is not None and rollouts is not None:
        raise typer.BadParameter("give SOURCE or --rollouts DIR, not both")
    if source is not None and source.suffix == ".rrd":
        paths = [source]
        if not source.is_file():
            raise ViewError("not found", source, code="missing_file")
    elif rollouts is not None:
        from dpflow_core.view.rollouts import view_rollouts

        paths = [view_rollouts(rollouts, out, overwrite=overwrite).path]
    elif source.suffix == ".npz":
        spec_args = settings.window()
        episode, every, anchor, max_samples = settings.episode, settings.every, settings.anchor, settings.max_samples
        if predict is not None:
            if spec_args:
                raise typer.BadParameter("--predict uses the checkpoint's own horizon and strides")
            from dpflow_core.view.dataset import view_predictions

            paths = [view_predictions(predict, source, out, episode=episode, every=every, max_samples=max_samples,
                                      overwrite=overwrite).path]
        else:
            from dpflow_core.train.data import ObsActionSpec
            from dpflow_core.view.dataset import view_dataset

            try:
                spec = ObsActionSpec(**spec_args)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from exc
            paths = [view_dataset(source, out, episode=episode, every=every, anchor=anchor, spec=spec,
                                  overwrite=overwrite).path]
    else:
        from dpflow_core.view.episode import view_episodes

        paths = [v.path for v in view_episodes(source, out, camera=camera, overwrite=overwrite)]
    for p in paths:
        typer.echo(str(p))
    if serve:
        _serve(paths, web_port, grpc_port)


def _serve(paths: list[Path], web_port: int, grpc_port: int) -> None:
    """Serve until Ctrl-C or TERM; the viewer process is stopped by its PID either way."""
    from dpflow_core.view.serve import serve_rrd

    server = serve_rrd(paths, web_port=web_port, grpc_port=grpc_port)

    def _stop(_signum, _frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        typer.echo(f"viewer: {server.url}  (pid {server.pid}; Ctrl-C stops it)")
        while server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.stop()
    typer.echo("stopped")
