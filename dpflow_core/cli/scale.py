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

import typer

from dpflow_core import server as _server  # its names load on first use (dpflow_core._lazy)
from dpflow_core.cli import app, posix_usage
from dpflow_core.cli.options import settings_options
from dpflow_core.runs.settings import SmokeSettings, TrainSettings
from dpflow_core.server.lab import LabServers, lab_servers

scale_app = posix_usage(typer.Typer(
    help="Smoke and training runs on a Slurm cluster or several servers (from a lab.yaml).", no_args_is_help=True))
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


@scale_app.command("smoke")
@settings_options(SmokeSettings, skip=lambda meta: not meta["scale"])
def smoke_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
    settings: SmokeSettings = None,
) -> None:
    """Smoke run on the one server, the cluster (one node) or the first host; then the release check."""
    _run("smoke", lab, dataset, settings, as_json)


@scale_app.command("train")
@settings_options(TrainSettings, skip=lambda meta: not meta["scale"])
def train_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
    settings: TrainSettings = None,
) -> None:
    """Training on the one server, the cluster (sbatch + srun + accelerate) or every host (accelerate multi-machine)."""
    _run("train", lab, dataset, settings, as_json)
