"""`dpflow scale` commands: smoke and training runs on the machines a lab.yaml names.

``dpflow scale train --lab lab.yaml DATASET.npz`` reads the lab.yaml's ``server:`` section
(:func:`dpflow_core.server.lab.lab_servers`) and:

* one server (``mode single``): as ``dpflow train`` on that server (after uploading the dataset there);
* ``scheduler: slurm``: uploads the dataset through the login node (or locally) to the cluster's
  shared file system, verifies it, runs the Slurm preflight (partition, GPUs, the dataset's SHA-256
  from a compute node), submits the run with ``sbatch``, follows it, and checks natural exit and
  release (:mod:`dpflow_core.runs.slurm`);
* ``hosts:``: uploads and verifies the dataset on every host, launches one multi-machine run and
  follows it (:mod:`dpflow_core.runs.multihost`).

``dpflow scale smoke`` runs the smoke run (one node, one GPU or CPU; the first host for ``hosts``).
Each prints the verdict of its checks, or JSON with ``--json``; exit 1 when a check fails. The options
map onto :class:`~dpflow_core.runs.settings.SmokeSettings` / :class:`~dpflow_core.runs.settings.TrainSettings`;
the work is done by :mod:`dpflow_core.runs.recipe`, which ``dpflow smoke|train`` and the Dagster assets call too.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import List, Optional

import typer

from dpflow_core import server as _server  # its names load on first use (dpflow_core._lazy)
from dpflow_core.cli import app
from dpflow_core.server.lab import LabServers, lab_servers

scale_app = typer.Typer(help="Smoke and training runs on a Slurm cluster or several servers (from a lab.yaml).",
                        no_args_is_help=True)
app.add_typer(scale_app, name="scale")


def _verdict(name: str, passed: bool, detail: str = "") -> None:
    typer.secho(f"[{'PASS' if passed else 'FAIL'}] {name}" + (f": {detail}" if detail else ""),
                fg=typer.colors.GREEN if passed else typer.colors.RED)


def load_lab(path: Path) -> LabServers:
    """The machines of a lab.yaml file (see :func:`lab_servers`).

    Raises:
        typer.BadParameter: the file is missing, not YAML, or not a mapping; RemoteError from :func:`lab_servers`.
    """
    if not path.is_file():
        raise typer.BadParameter(f"{path} does not exist", param_hint="--lab")
    import yaml

    try:
        settings = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path}: not valid YAML: {exc}", param_hint="--lab") from None
    if not isinstance(settings, dict):
        raise typer.BadParameter(f"{path}: expected a mapping with a 'server' key", param_hint="--lab")
    return lab_servers(settings.get("server"), path)


def _run(kind: str, lab_path: Path, dataset: Path, settings, as_json: bool) -> None:
    """Upload ``dataset`` to the lab's machines, then the ``kind`` recipe (:mod:`dpflow_core.runs.recipe`) there."""
    from dpflow_core.dataset import recorded_sha256
    from dpflow_core.runs import dataset_frequency
    from dpflow_core.runs.recipe import smoke_on_lab, smoke_value, train_on_lab
    from dpflow_core.runs.scale import upload_to_lab

    if not dataset.is_file():
        raise typer.BadParameter(f"{dataset} does not exist", param_hint="DATASET")
    lab = load_lab(lab_path)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_server.GpuServer(c)) for c in lab.servers]
        upload = upload_to_lab(servers, dataset, expected_sha256=recorded_sha256(dataset),
                               on_event=lambda line: _verdict(line, True))
        remote = upload.remote_dataset(dataset_frequency(servers[0], upload.paths[0]))
        recipe = smoke_on_lab if kind == "smoke" else train_on_lab
        run = recipe(servers, lab, remote, settings, on_event=typer.echo)
    result = run.result
    value = None
    if result.launch_index is not None:  # what the smoke_run / train_run asset hands on for this run
        value = (smoke_value(run, settings, remote) if kind == "smoke" else
                 result.train_result(run.spec, host=remote.host, dataset_sha256=remote.sha256,
                                     dataset_local_path=remote.local_path, hosts=[c.host for c in lab.servers]))
    for name, passed, detail in result.checks:
        _verdict(name, passed, detail)
    for step in result.oom_advice:
        typer.echo(f"  {step}")
    out = {**result.to_dict(), "dataset": upload.paths[0], "sha256": upload.sha256,
           f"{kind}_run": value.to_dict() if value is not None else None}
    if as_json:
        typer.echo("DPFLOW_JSON " + json.dumps(out, default=str))
    if not result.passed:
        raise typer.Exit(1)


_LAB = typer.Option(..., "--lab", help="lab.yaml whose server: section names the cluster or the servers.")
_TRAIN_COMMAND = typer.Option(None, "--train-command", help=(
    "Train command template, as for `dpflow train` (default: the built-in trainer; 'upstream': a Diffusion Policy / "
    "UMI checkout's train.py as repo_path, with --config-name)."))


@scale_app.command("smoke")
def smoke_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name (default: smoke-<sha256[:12]>-<UTC time>)."),
    config_name: str = typer.Option("auto", "--config-name", help="Trainer config ('auto': by slurm.gpus_per_node on a cluster, else by the first server's nvidia-smi)."),
    epochs: int = typer.Option(1, "--epochs", min=1, help="training.num_epochs."),
    max_train_steps: int = typer.Option(3, "--max-train-steps", min=1, help="training.max_train_steps."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="dataloader.batch_size."),
    num_workers: int = typer.Option(0, "--num-workers", min=0, help="dataloader.num_workers."),
    train_command: Optional[str] = _TRAIN_COMMAND,
    override: List[str] = typer.Option([], "--override", help="Extra Hydra override (repeatable)."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds before the run is ended."),
    resume_check_epochs: int = typer.Option(2, "--resume-check-epochs", min=2, help="Epochs of the resume-continuity check's runs (recorded with the run)."),
    resume_check_steps: int = typer.Option(2, "--resume-check-steps", min=1, help="Batches per epoch of the resume-continuity check's runs."),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
) -> None:
    """Smoke run on the one server, the cluster (one node) or the first host; then the release check."""
    from dpflow_core.runs import SmokeSettings

    _run("smoke", lab, dataset, SmokeSettings.from_options(locals()), as_json)


@scale_app.command("train")
def train_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name (default: train-<sha256[:12]>-<UTC time>)."),
    config_name: str = typer.Option("auto", "--config-name", help="Trainer config ('auto': by slurm.gpus_per_node on a cluster, else by the first server's nvidia-smi)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="training.num_epochs."),
    max_train_steps: Optional[int] = typer.Option(None, "--max-train-steps", min=1, help="training.max_train_steps."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="dataloader.batch_size (per process)."),
    num_workers: Optional[int] = typer.Option(None, "--num-workers", min=0, help="dataloader.num_workers."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run (--run-name) from its verified latest.ckpt."),
    train_command: Optional[str] = _TRAIN_COMMAND,
    override: List[str] = typer.Option([], "--override", help="Extra Hydra override (repeatable)."),
    logging_mode: str = typer.Option("offline", "--logging-mode", help="logging.mode: offline | online | disabled."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds before the run is ended (default: 86400 on a cluster or hosts; one server: follow until it ends)."),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
) -> None:
    """Training on the one server, the cluster (sbatch + srun + accelerate) or every host (accelerate multi-machine)."""
    from dpflow_core.runs import TrainSettings

    if resume and not run_name:
        raise typer.BadParameter("--resume needs the --run-name of the run to continue", param_hint="--resume")
    _run("train", lab, dataset, TrainSettings.from_options(locals()), as_json)
