"""`dpflow scale` commands: smoke and training runs on the machines a lab.yaml names.

``dpflow scale train --lab lab.yaml DATASET.npz`` reads the lab.yaml's ``server:`` section
(:func:`dpflow_core.server.lab.lab_servers`) and:

* one server (``mode single``): as ``dpflow train`` on that server;
* ``scheduler: slurm``: uploads the dataset through the login node (or locally) to the cluster's
  shared file system, verifies it, runs the Slurm preflight (partition, GPUs, the dataset's SHA-256
  from a compute node), submits the run with ``sbatch``, follows it, and checks natural exit and
  release (:mod:`dpflow_core.runs.slurm`);
* ``hosts:``: uploads and verifies the dataset on every host, launches one multi-machine run and
  follows it (:mod:`dpflow_core.runs.multihost`).

``dpflow scale smoke`` runs the smoke run (one node, one GPU or CPU; the first host for ``hosts``).
Each prints the verdict of its checks, or JSON with ``--json``; exit 1 when a check fails.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from dpflow_core import server as _server  # its names load on first use (dpflow_core._lazy)
from dpflow_core.cli import app
from dpflow_core.server.lab import LabServers, lab_servers

if TYPE_CHECKING:
    from dpflow_core.server import GpuServer

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


def _upload(servers, dataset: Path) -> tuple[list[str], str, float]:
    """Upload to every server, verified there; (remote path on each, SHA-256, frequency)."""
    from dpflow_core.dataset import recorded_sha256
    from dpflow_core.errors import RemoteError
    from dpflow_core.runs import dataset_frequency
    from dpflow_core.server.upload import upload_dataset

    paths, sha = [], None
    for server in servers:
        result = upload_dataset(server, dataset, expected_sha256=recorded_sha256(dataset))
        if not result.verified:
            raise RemoteError(f"SHA-256 mismatch after upload to {server.config.describe()}: "
                              f"{result.verification.describe()}", code="sha256_mismatch")
        _verdict(f"dataset on {server.config.describe()}", True, f"{result.remote_path} sha256 {result.sha256}")
        paths.append(result.remote_path)
        sha = result.sha256
    return paths, sha, dataset_frequency(servers[0], paths[0])


def _spec(kind, name, path, sha, freq, config_name, epochs, max_train_steps, batch_size, resume, override, logging_mode):
    from dpflow_core.runs import RunSpec, default_run_name, smoke_spec

    name = name or default_run_name(sha, kind)
    if kind == "smoke":
        return smoke_spec(name, path, freq, dataset_sha256=sha, config_name=config_name, epochs=epochs or 1,
                          max_train_steps=max_train_steps or 3, batch_size=batch_size or 4, extra_overrides=override)
    return RunSpec(name=name, kind="train", dataset_path=path, frequency_hz=freq, dataset_sha256=sha, config_name=config_name,
                   epochs=epochs, max_train_steps=max_train_steps, batch_size=batch_size, resume=resume,
                   logging_mode=logging_mode, extra_overrides=tuple(override))


def _slurm(server: GpuServer, spec, timeout: float) -> dict:
    from dpflow_core.runs.slurm import submit_run, wait_job
    from dpflow_core.runs.slurm_checks import check_slurm_exit, check_slurm_released, run_slurm_smoke, slurm_preflight

    pre = slurm_preflight(server, spec.dataset_path, spec.dataset_sha256)
    for name, ok, detail in pre.checks:
        _verdict(f"preflight {name}", ok, detail)
    if not pre.passed:
        return {"passed": False, "preflight": [list(c) for c in pre.checks]}
    if spec.kind == "smoke":
        smoke = run_slurm_smoke(server, spec, timeout_s=timeout)
        _verdict(f"smoke run (job {smoke.job.job_id})", smoke.passed, "; ".join(smoke.problems) or
                 f"{smoke.state.describe()}, {smoke.finite_losses} finite train_loss, no checkpoint")
        _verdict("released", smoke.release.passed, smoke.release.message)
        return {"passed": smoke.passed and smoke.release.passed, "job_id": smoke.job.job_id, "run_dir": smoke.job.run_dir,
                "state": smoke.state.state if smoke.state else None, "problems": list(smoke.problems),
                "release": smoke.release.message}
    job = submit_run(server, spec)
    typer.echo(f"submitted {spec.name} as job {job.job_id} ({job.nodes} node(s)); output {job.output_path}")
    wait_job(server, job, timeout_s=timeout)
    report = check_slurm_exit(server, job)
    if report.state is not None and not report.state.finished:
        from dpflow_core.runs.slurm import cancel_job

        cancel_job(server, job)
    release = check_slurm_released(server, job)
    _verdict("natural exit", report.passed, "; ".join(report.problems) or
             f"{report.state.describe()}, epoch {report.trainer.last_epoch}, global_step {report.trainer.last_global_step}")
    _verdict("released", release.passed, release.message)
    for step in report.oom_advice:
        typer.echo(f"  {step}")
    return {"passed": report.passed and release.passed, "job_id": job.job_id, "run_dir": job.run_dir,
            "state": report.state.state if report.state else None, "exit_code": report.state.exit_code if report.state else None,
            "problems": list(report.problems), "release": release.message}


def _hosts(servers, lab: LabServers, spec, paths: list[str], timeout: float) -> dict:
    from dpflow_core.runs import run_smoke
    from dpflow_core.runs.multihost import follow_multihost, launch_multihost

    if spec.kind == "smoke":
        smoke = run_smoke(servers[0], spec, timeout_s=timeout)
        _verdict(f"smoke run on {servers[0].config.describe()}", smoke.passed, "; ".join(smoke.problems))
        return {"passed": smoke.passed and smoke.release.passed, "run_dir": smoke.handle.run_dir, "problems": list(smoke.problems)}
    run = launch_multihost(servers, spec, main_address=lab.main_address, network_interface=lab.network_interface,
                           dataset_paths=paths)
    typer.echo(f"launched {spec.name} on {len(servers)} machines ({', '.join(run.hosts)}); "
               f"rendezvous {run.main_address}:{run.port}")
    for server, handle in zip(servers, run.handles):
        typer.echo(f"  {server.config.describe()}: {handle.run_dir} (tmux {handle.detached.tmux_session}, pid {handle.detached.pid})")
    result = follow_multihost(servers, run, timeout_s=timeout)
    _verdict("multi-machine run", result.passed, "; ".join(result.problems) or f"every rank exited 0 ({list(result.exit_codes)})")
    for rank, report in enumerate(result.releases):
        _verdict(f"released rank {rank}", report.passed, report.message)
    return {"passed": result.passed, "run_dirs": [h.run_dir for h in run.handles], "exit_codes": list(result.exit_codes),
            "failed_ranks": list(result.failed_ranks), "stopped_ranks": sorted(result.stopped),
            "tokens": [h.token for h in run.handles], "problems": list(result.problems),
            "released": [r.passed for r in result.releases]}


def _run(kind, lab_path, dataset, run_name, config_name, epochs, max_train_steps, batch_size, resume, override, timeout, as_json,
         logging_mode="offline"):
    if not dataset.is_file():
        raise typer.BadParameter(f"{dataset} does not exist", param_hint="DATASET")
    lab = load_lab(lab_path)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_server.GpuServer(c)) for c in lab.servers]
        paths, sha, freq = _upload(servers, dataset)
        path = paths[0]
        spec = _spec(kind, run_name, path, sha, freq, config_name, epochs, max_train_steps, batch_size, resume, override,
                     logging_mode)
        typer.echo(f"{kind} run {spec.name} ({lab.mode}, {len(servers)} server(s))")
        if lab.mode == "slurm":
            out = _slurm(servers[0], spec, timeout)
        elif lab.mode == "hosts":
            out = _hosts(servers, lab, spec, paths, timeout)
        else:
            raise typer.BadParameter(f"{lab_path}: one server without a scheduler: use `dpflow smoke` / `dpflow train`",
                                     param_hint="--lab")
    out = {"mode": lab.mode, "run_name": spec.name, "dataset": path, "sha256": sha, **out}
    if as_json:
        typer.echo("DPFLOW_JSON " + json.dumps(out))
    if not out["passed"]:
        raise typer.Exit(1)


_LAB = typer.Option(..., "--lab", help="lab.yaml whose server: section names the cluster or the servers.")


@scale_app.command("smoke")
def smoke_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name (default: smoke-<sha256[:12]>-<UTC time>)."),
    config_name: str = typer.Option("train_diffusion_unet_image", "--config-name", help="Trainer config."),
    max_train_steps: int = typer.Option(3, "--max-train-steps", min=1, help="training.max_train_steps."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="dataloader.batch_size."),
    override: List[str] = typer.Option([], "--override", help="Extra Hydra override (repeatable)."),
    timeout: float = typer.Option(900.0, "--timeout", help="Seconds before the run is ended."),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
) -> None:
    """Smoke run on the cluster (one node) or on the first host; then the release check."""
    _run("smoke", lab, dataset, run_name, config_name, 1, max_train_steps, batch_size, False, override, timeout, as_json)


@scale_app.command("train")
def train_cmd(
    dataset: Path = typer.Argument(..., help="The local dataset.npz (uploaded and verified by SHA-256 first)."),
    lab: Path = _LAB,
    run_name: Optional[str] = typer.Option(None, "--run-name", help="Run name (default: train-<sha256[:12]>-<UTC time>)."),
    config_name: str = typer.Option("train_diffusion_unet_image", "--config-name", help="Trainer config."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="training.num_epochs."),
    max_train_steps: Optional[int] = typer.Option(None, "--max-train-steps", min=1, help="training.max_train_steps."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", min=1, help="dataloader.batch_size (per process)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run (--run-name) from its verified latest.ckpt."),
    override: List[str] = typer.Option([], "--override", help="Extra Hydra override (repeatable)."),
    logging_mode: str = typer.Option("offline", "--logging-mode", help="logging.mode: offline | online | disabled."),
    timeout: float = typer.Option(86400.0, "--timeout", help="Seconds before the run is ended."),
    as_json: bool = typer.Option(False, "--json", help="Also print the result as one JSON line (prefix DPFLOW_JSON)."),
) -> None:
    """Training on the cluster (sbatch + srun + accelerate) or on every host (accelerate multi-machine)."""
    if resume and not run_name:
        raise typer.BadParameter("--resume needs the --run-name of the run to continue", param_hint="--resume")
    _run("train", lab, dataset, run_name, config_name, epochs, max_train_steps, batch_size, resume, override, timeout, as_json,
         logging_mode)
