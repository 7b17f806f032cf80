"""`dpflow` commands of the runs stage: ``smoke``, ``train``, ``checkpoint``, ``evaluate``, ``predict``.

``smoke``, ``train`` and ``checkpoint`` take the GPU-server connection flags of
``dpflow upload`` (local transport without ``--host``). Each prints the verdict
of its checks and exits with status 1 when a blocking check fails (2 for an
error, as every dpflow command).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from dpflow_core.cli import app
from dpflow_core.cli.options import settings_options
from dpflow_core.cli.remote import connection_options
from dpflow_core import server as _server  # its names load on first use (dpflow_core._lazy)
from dpflow_core.evaluation.settings import EvaluationSettings
from dpflow_core.runs.settings import SmokeSettings, TrainSettings
from dpflow_core.server.config import ServerConfig

if TYPE_CHECKING:
    from dpflow_core.server import GpuServer



def _verdict(name: str, passed: bool, detail: str = "", *, blocking: bool = True) -> None:
    label = "PASS" if passed else ("FAIL" if blocking else "WARN")
    colour = typer.colors.GREEN if passed else (typer.colors.RED if blocking else typer.colors.YELLOW)
    typer.secho(f"[{label}] {name}" + (f": {detail}" if detail else ""), fg=colour)


def _print_identity(handle, action: str) -> None:
    """The names a run shares (rule 1): run name, directory, tmux session, W&B directory."""
    session = handle.detached.tmux_session or f"none ({handle.detached.method}, pid {handle.detached.pid})"
    typer.echo(f"{action} {handle.name}")
    typer.echo(f"  run directory:  {handle.run_dir}")
    typer.echo(f"  tmux session:   {session}")
    typer.echo(f"  W&B directory:  {handle.wandb_dir}")
    typer.echo(f"  GPUs:           {','.join(map(str, handle.gpu_ids)) or 'none (CPU run)'}")


def _release_verdict(release) -> None:
    _verdict("released", release.verdict == "pass", release.message, blocking=release.verdict == "fail")


def _remote_dataset(server: GpuServer, dataset: str, frequency: float | None):
    """The dataset already on the server, as the recipes take it (``frequency``: Hz, default its metadata)."""
    from dpflow_core.runs import dataset_frequency
    from dpflow_core.server.upload import RemoteDataset

    path = server.abspath(dataset)
    return RemoteDataset(remote_path=path, sha256=server.sha256(path), size_bytes=server.size(path) or 0,
                         host=server.config.host, local_path="",
                         frequency_hz=frequency if frequency is not None else dataset_frequency(server, path))


def _single(server_config: ServerConfig):
    from dpflow_core.server.lab import LabServers

    return LabServers(mode="single", servers=(server_config,))


@app.command("smoke")
@connection_options
@settings_options(SmokeSettings)
def smoke_cmd(
    dataset: str = typer.Argument(..., help="The dataset.npz on the GPU server (as `dpflow upload` printed it)."),
    frequency: Optional[float] = typer.Option(None, "--frequency", help="Dataset frequency in Hz (default: the dataset's metadata)."),
    resume_check: bool = typer.Option(False, "--resume-check", help="Also run the resume-continuity check (two short runs)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    server_config: ServerConfig = None,
    settings: SmokeSettings = None,
) -> None:
    """Smoke run: one GPU (or CPU), few steps, offline, no checkpoints; then the release check."""
    from dpflow_core.runs import check_resume_continuity
    from dpflow_core.runs.recipe import smoke_on_lab, smoke_value

    with _server.GpuServer(server_config) as server:
        remote = _remote_dataset(server, dataset, frequency)
        run = smoke_on_lab([server], _single(server_config), remote, settings)
        spec, result = run.spec, run.result.smoke
        continuity = (check_resume_continuity(server, spec, epochs=settings.resume_check_epochs,
                                              steps_per_epoch=settings.resume_check_steps)
                      if resume_check and result.passed else None)
    if as_json:
        out = {"smoke": result.metadata(), "release": result.release.to_dict(), "oom_advice": list(result.oom_advice),
               # what the smoke_run asset hands on (None for a failed run)
               "smoke_run": smoke_value(run, settings, remote).to_dict() if result.passed else None}
        if continuity is not None:
            out["resume_continuity"] = continuity.metadata() | {"passed": continuity.passed}
        typer.echo(json.dumps(out, indent=2, default=str))
    else:
        _print_identity(result.handle, f"smoke run ({spec.config_name}, {result.seconds:.1f} s)")
        _verdict("smoke run", result.passed, "; ".join(result.problems) or
                 f"exit 0, {result.finite_losses} finite train_loss, no checkpoint")
        _release_verdict(result.release)
        if result.release.cleanup is not None:
            typer.echo(f"  cleanup: terminated {list(result.release.cleanup.terminated)}, killed {list(result.release.cleanup.killed)}")
        for step in result.oom_advice:
            typer.echo(f"  {step}")
        if continuity is not None:
            detail = "; ".join(continuity.problems + continuity.mismatches) or (
                f"{continuity.compared} records from step {continuity.resume_step} match "
                f"(max loss rel diff {continuity.max_loss_rel_diff:.2e})"
            )
            _verdict("resume continuity", continuity.passed, detail, blocking=False)
    if not (result.passed and result.release.passed):
        raise typer.Exit(1)


@app.command("train")
@connection_options
@settings_options(TrainSettings)
def train_cmd(
    dataset: str = typer.Argument(..., help="The dataset.npz on the GPU server."),
    frequency: Optional[float] = typer.Option(None, "--frequency", help="Dataset frequency in Hz (default: the dataset's metadata)."),
    detach: bool = typer.Option(False, "--detach", help="Launch (or find) the run and return without waiting."),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON): the train_run value and the natural-exit check."),
    server_config: ServerConfig = None,
    settings: TrainSettings = None,
) -> None:
    """Training in a detached tmux session named after the run; follows it, then the natural-exit check."""
    from dpflow_core.runs import CPU_RUN_NOTE
    from dpflow_core.runs.recipe import train_on_lab
    from dpflow_core.runs.scale import RunHooks


    printed = set()

    def progress(p, new):
        if (p.epoch, p.global_step) in printed:  # an epoch summary after the step's line: nothing new to say
            return
        printed.add((p.epoch, p.global_step))
        typer.echo(f"  epoch {p.epoch} step {p.global_step} loss {p.train_loss} lr {p.lr}"
                   + (f" {p.steps_per_s:.2f} steps/s" if p.steps_per_s else ""))

    hooks = RunHooks(on_launch=lambda handle, attached: _print_identity(handle, "attached to" if attached else "launched"),
                     on_progress=progress)
    with _server.GpuServer(server_config) as server:
        remote = _remote_dataset(server, dataset, frequency)
        run = train_on_lab([server], _single(server_config), remote, settings, detach=detach,
                           hooks=hooks)
        if detach:
            return
    handle, monitored, report = run.result.handle, run.result.monitor, run.result.natural_exit
    typer.echo(f"monitor: {monitored.status}: {monitored.message}")
    trained = run.result.train_result(run.spec, host=server_config.host, dataset_sha256=remote.sha256,
                                      dataset_local_path=None)
    _verdict("natural exit", report.passed, "; ".join(report.problems) or
             f"exit 0, last logged epoch {report.last_epoch}, global_step {report.last_global_step}; "
             f"{report.checkpoint.describe()}")
    if not handle.gpu_ids:
        _verdict("GPU release", False, CPU_RUN_NOTE, blocking=False)
    for step in report.oom_advice:
        typer.echo(f"  {step}")
    if as_json:
        out = {"train_run": trained.to_dict(), "natural_exit": report.metadata() | {"passed": report.passed}}
        typer.echo("DPFLOW_JSON " + json.dumps(out, default=str))
    if not report.passed:
        raise typer.Exit(1)


@app.command("checkpoint")
@connection_options
def checkpoint_cmd(
    run_name: str = typer.Argument(..., help="The run whose checkpoint to download."),
    choose: str = typer.Option("latest", "--choose", help="latest | best (lowest train_loss among the top-k files)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Checkpoint root (default: $DPFLOW_WORKDIR/checkpoints or outputs/checkpoints)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    server_config: ServerConfig = None,
) -> None:
    """Download a run's checkpoint with its config, log, normaliser and reproducibility record; verify SHA-256."""
    from dpflow_core.checkpoints import download_checkpoint, verify_checkpoint

    if choose not in ("latest", "best"):
        raise typer.BadParameter(f"unknown choice {choose!r}", param_hint="--choose")
    with _server.GpuServer(server_config) as server:
        result = download_checkpoint(server, run_name, choose=choose, dest_root=output)
        check = verify_checkpoint(result.local_path, result.remote_sha256, result.size_bytes)
    if as_json:
        typer.echo(json.dumps({"checkpoint": result.to_dict(), "check": check.metadata() | {"passed": check.passed}}, indent=2))
    else:
        typer.echo(f"{result.local_path} ({result.size_bytes} bytes){' (already present)' if result.already_present else ''}")
        _verdict("checkpoint sha256", check.passed, "; ".join(check.problems) or f"{check.local_sha256} on both ends")
    if not check.passed:
        raise typer.Exit(1)


@app.command("evaluate")
@settings_options(EvaluationSettings)
def evaluate_cmd(
    checkpoint: Path = typer.Argument(..., help="A downloaded checkpoint (dpflow checkpoint prints its path)."),
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="The dataset.npz it was trained on (default: the path in its run record, when it exists here)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results folder (default: <checkpoint folder>/evaluation)."),
    log: Optional[Path] = typer.Option(None, "--log", help="logs.json.txt for the loss curve (default: next to the checkpoint)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace earlier results in the output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    settings: EvaluationSettings = None,
) -> None:
    """Held-out errors of the checkpoint's EMA policy on the executed steps vs the hold, constant-velocity and
    mean-relative-action baselines, with plots; exit status 1 unless each gated error beats the best baseline's by the margin."""
    from dpflow_core.evaluation import evaluate_checkpoint

    folder = checkpoint.resolve().parent
    if dataset is None:
        dataset = _dataset_from_record(folder)
    result = evaluate_checkpoint(checkpoint, dataset, output or folder / "evaluation", settings,
                                 log_path=log or folder / "logs.json.txt", overwrite=overwrite)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(result.markdown_table())
        typer.echo(f"plots: {result.trajectory_plot}, {result.error_plot}" + (f", {result.loss_plot}" if result.loss_plot else ""))
        _verdict("beats baselines", result.beats_baseline, result.verdict())
    if not result.beats_baseline:
        raise typer.Exit(1)


def _dataset_from_record(folder: Path) -> Path:
    from dpflow_core.checkpoints import RECORD_FILE

    record = folder / RECORD_FILE
    if record.is_file():
        path = (json.loads(record.read_text()).get("dataset") or {}).get("path")
        if path and Path(path).is_file():
            return Path(path)
    raise typer.BadParameter("no local dataset found in the run record; pass --dataset", param_hint="--dataset")


@app.command("predict")
def predict_cmd(
    checkpoint: Path = typer.Argument(..., help="A trainer checkpoint (latest.ckpt or a top-k file)."),
    dataset: Path = typer.Argument(..., help="A dataset.npz recorded the same way (usually the one trained on)."),
    episode: int = typer.Option(..., "--episode", help="The episode to replay (0-based)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="The PNG (default: <checkpoint folder>/predict_episode_<N>.png)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing plot."),
) -> None:
    """Replay a recorded episode through the policy as a robot would run it; plot predicted vs recorded."""
    from dpflow_core.inference import load_policy, replay_episode
    from dpflow_core.replay_buffer import ReplayBuffer

    out = output or checkpoint.resolve().parent / f"predict_episode_{episode}.png"
    result = replay_episode(load_policy(checkpoint), ReplayBuffer(dataset), episode, out, overwrite=overwrite)
    typer.echo(
        f"episode {result.episode}: {result.samples} anchors, MSE {result.mse:.4g}, position error "
        f"{result.position_error_m:.4f} m, rotation error {result.rotation_error_rad:.4f} rad"
    )
    typer.echo(f"plot: {result.plot}")
