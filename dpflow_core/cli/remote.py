"""`dpflow` commands of the remote stage: ``upload`` and ``preflight``.

Both take the GPU-server connection flags added by :func:`connection_options`
(``--host --port --user --key --known-hosts --trust-on-first-use --remote-dir
--remote-repo --python --activate --nvidia-smi --expect-gpu/--no-expect-gpu``), or ``--lab lab.yaml``
for the server of a lab.yaml's ``server:`` section. Without ``--host`` or ``--lab`` they use the local
transport. Later stages (smoke, train, checkpoint) reuse the same decorator::

    @app.command("smoke")
    @connection_options
    def smoke(run: str, server_config: ServerConfig) -> None:
        with GpuServer(server_config) as server: ...
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

import typer

from dpflow_core.cli import app
from dpflow_core.errors import RemoteError
from dpflow_core import server as _server  # its names load on first use (dpflow_core._lazy)
from dpflow_core.server.config import ServerConfig

if TYPE_CHECKING:
    from dpflow_core.server import GpuServer


def _option(default, *decls: str, envvar: str | None = None, help: str):
    return typer.Option(default, *decls, envvar=envvar, help=help, show_envvar=envvar is not None)


#: (name, type, Typer option) of each connection flag, in the order ``--help`` shows them.
CONNECTION_OPTIONS: tuple[tuple[str, object, object], ...] = (
    ("host", Optional[str], _option(None, "--host", envvar="DPFLOW_SERVER_HOST",
                                    help="GPU server host; without it the local machine is used.")),
    ("port", int, _option(22, "--port", envvar="DPFLOW_SERVER_PORT", help="SSH port.")),
    ("user", Optional[str], _option(None, "--user", envvar="DPFLOW_SERVER_USER",
                                    help="SSH user (default: the local user name).")),
    ("key", Optional[Path], _option(None, "--key", envvar="DPFLOW_SERVER_KEY",
                                    help="Private key file (no agent or other key is then tried).")),
    ("known_hosts", Optional[Path], _option(None, "--known-hosts", envvar="DPFLOW_KNOWN_HOSTS",
                                            help="known_hosts file (default: ~/.ssh/known_hosts).")),
    ("trust_on_first_use", bool, _option(False, "--trust-on-first-use",
                                         help="Accept an unknown host key once and record it (a changed key is still refused).")),
    ("data_root", Optional[str], _option(None, "--remote-dir", "--data-root", envvar="DPFLOW_SERVER_ROOT",
                                         help="Data root on the server (default: ~/dpflow-data; locally outputs/server).")),
    ("remote_repo", Optional[str], _option(None, "--remote-repo", envvar="DPFLOW_SERVER_REPO",
                                           help="Training repository on the server (default locally: this checkout).")),
    ("python", Optional[str], _option(None, "--python", envvar="DPFLOW_SERVER_PYTHON",
                                      help="Python command on the server (default: python3; locally this interpreter).")),
    ("activate", Optional[str], _option(None, "--activate", envvar="DPFLOW_SERVER_ACTIVATE",
                                        help="Shell line run before Python on the server (e.g. conda activation).")),
    ("nvidia_smi", Optional[str], _option(None, "--nvidia-smi", envvar="DPFLOW_SERVER_NVIDIA_SMI",
                                          help="nvidia-smi command on the server (a path when it is not on PATH).")),
    ("expect_gpu", Optional[bool], _option(None, "--expect-gpu/--no-expect-gpu", envvar="DPFLOW_SERVER_EXPECT_GPU",
                                           help="The server must have a working GPU: a missing or failing nvidia-smi fails "
                                                "preflight and refuses smoke/train (default: on over SSH, off locally).")),
)
_CONNECTION_NAMES = tuple(name for name, _, _ in CONNECTION_OPTIONS)
#: The flag that takes the server from a lab.yaml instead of the flags above.
LAB_OPTION = ("lab", Optional[Path], _option(None, "--lab", help="lab.yaml whose server: section is the server (one "
                                                               "server; a Slurm or hosts section is `dpflow scale`'s)."))
_DEFAULTS = {"port": 22, "trust_on_first_use": False}


def _from_environment(option, value) -> bool:
    """Whether a flag's value is its environment variable's (``DPFLOW_SERVER_*``), not a flag on the command line."""
    import os

    env = os.environ.get(option.envvar) if option.envvar else None
    if env is None:
        return False
    if isinstance(value, bool):
        return env.strip().lower() in (("1", "true", "yes", "on", "t", "y") if value else ("0", "false", "no", "off", "f", "n"))
    if isinstance(value, Path):
        return Path(env) == value
    return str(value) == env.strip()


def server_config_from_lab(lab: Path, flags: dict) -> ServerConfig:
    """The one server of a lab.yaml's ``server:`` section (the same keys as ``dpflow demo --config``).

    The lab.yaml wins over the ``DPFLOW_SERVER_*`` environment variables (which the Dagster side
    reads); a connection flag given on the command line as well is refused.

    Raises:
        typer.BadParameter: a connection flag is given as well, or the file is missing or not YAML; RemoteError: a bad ``server:`` section, or a Slurm or hosts
            section (those run through ``dpflow scale``).
    """
    from dpflow_core.cli.scale import load_lab

    options = {name: option for name, _, option in CONNECTION_OPTIONS}
    given = [name for name, value in flags.items()
             if value is not None and value != _DEFAULTS.get(name) and not _from_environment(options[name], value)]
    if given:
        opts = ", ".join(f"--{n.replace('_', '-')}" for n in given)
        raise typer.BadParameter(f"--lab {lab} names the server; {opts} would change it: give one or the other",
                                 param_hint="--lab")
    servers = load_lab(lab)
    if servers.mode != "single":
        raise RemoteError(f"{lab}: its server: section is a {'Slurm cluster' if servers.mode == 'slurm' else 'set of hosts'}; "
                          f"run it with `dpflow scale smoke|train --lab {lab} DATASET`", code="bad_config")
    return servers.servers[0]


def server_config_from_options(flags: Mapping[str, Any]) -> ServerConfig:
    """The :class:`ServerConfig` the connection flags describe (local when ``host`` is None).

    ``flags``: values of :data:`CONNECTION_OPTIONS` by name (a name left out takes the flag's default).

    Raises:
        ValueError: a name that is not a connection flag.
    """
    unknown = set(flags) - set(_CONNECTION_NAMES)
    if unknown:
        raise ValueError(f"not connection flags: {sorted(unknown)}")
    get = {name: flags.get(name, _DEFAULTS.get(name)) for name in _CONNECTION_NAMES}
    host, port, user, key, known_hosts = get["host"], get["port"], get["user"], get["key"], get["known_hosts"]
    trust_on_first_use, data_root, remote_repo, python = (get["trust_on_first_use"], get["data_root"],
                                                          get["remote_repo"], get["python"])
    activate, nvidia_smi, expect_gpu = get["activate"], get["nvidia_smi"], get["expect_gpu"]
    if host is None:
        return ServerConfig.local(data_root=data_root, repo_path=remote_repo, python=python, activate=activate,
                                  nvidia_smi=nvidia_smi, expect_gpu=expect_gpu)
    values = dict(
        host=host, port=port, user=user, key_filename=str(key) if key else None,
        known_hosts=str(known_hosts) if known_hosts else None, trust_on_first_use=trust_on_first_use,
        repo_path=remote_repo, python=python, activate=activate, data_root=data_root, nvidia_smi=nvidia_smi,
        expect_gpu=expect_gpu,
    )
    return ServerConfig(**{k: v for k, v in values.items() if v is not None})


def connection_options(func):
    """Decorate a Typer command so it takes the connection flags and receives ``server_config``.

    The decorated function declares a parameter ``server_config: ServerConfig``;
    the flags of :data:`CONNECTION_OPTIONS` are added to its signature and turned
    into that config by :func:`server_config_from_options`.
    """
    signature = inspect.signature(func)
    hints = typing.get_type_hints(func)
    if "server_config" not in signature.parameters:
        raise TypeError(f"{func.__name__} must take a 'server_config' parameter")
    own = [
        p.replace(annotation=hints.get(p.name, p.annotation))
        for p in signature.parameters.values() if p.name != "server_config"
    ]
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)
        for name, annotation, option in (LAB_OPTION, *CONNECTION_OPTIONS)
    ]

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        flags = {name: kwargs.pop(name) for name in _CONNECTION_NAMES if name in kwargs}
        lab = kwargs.pop("lab", None)
        config = server_config_from_lab(lab, flags) if lab is not None else server_config_from_options(flags)
        return func(*args, server_config=config, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + added, return_annotation=None)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
    return wrapper


class _RichProgress:
    """A rich progress bar (on stderr) fed by ``progress(done, total)`` callbacks."""

    def __init__(self, description: str):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self._progress = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self._task = self._progress.add_task(description, total=None)

    def __enter__(self):
        self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        self._progress.__exit__(*exc)

    def __call__(self, done: int, total: int) -> None:
        self._progress.update(self._task, completed=done, total=total)


@app.command("upload")
@connection_options
def upload_cmd(
    dataset: Path = typer.Argument(..., help="The dataset.npz to upload."),
    task: Optional[str] = typer.Option(None, "--task", help="Task folder on the server (default: from the sidecar JSON, else the dataset's folder name)."),
    expected_sha256: Optional[str] = typer.Option(None, "--sha256", help="SHA-256 the file must have (default: the one its dataset.json sidecar recorded at conversion); the upload refuses a file that differs."),
    method: str = typer.Option("auto", "--method", help="auto | rsync | stream (SFTP, or a copy locally)."),
    bwlimit: Optional[int] = typer.Option(None, "--bwlimit", help="Bandwidth limit in KiB/s."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    server_config: ServerConfig = None,
) -> None:
    """Upload DATASET to <data_root>/<task>/<sha256[:16]>/dataset.npz (resumable) and verify its SHA-256 there."""
    from dpflow_core.dataset import recorded_sha256
    from dpflow_core.runs.scale import upload_to_lab

    if method not in ("auto", "rsync", "stream"):
        raise typer.BadParameter(f"unknown method {method!r}", param_hint="--method")
    # By default the file must still be what conversion wrote (the sidecar's SHA-256).
    expected_sha256 = expected_sha256 or recorded_sha256(dataset)
    # the upload of `dpflow scale` and the remote_dataset asset; a mismatch raises UploadMismatch (sha256_mismatch)
    with _server.GpuServer(server_config) as server, _RichProgress(f"upload {dataset.name}") as progress:
        [result] = upload_to_lab([server], dataset, task=task, expected_sha256=expected_sha256, method=method,
                                 bwlimit_kbps=bwlimit, progress=progress).results
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    where = f"{server_config.describe()}:{result.remote_path}"
    how = "already present" if result.already_present else (
        f"{result.method}, {result.bytes_sent} bytes sent"
        + (f", resumed from {result.resumed_from_bytes}" if result.resumed_from_bytes else "")
    )
    typer.echo(f"{result.summary()}  {where}  ({result.size_bytes} bytes; {how})")


def _print_report(report) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"preflight {report.server} ({report.hostname})", show_header=False)
    table.add_column("check", style="bold")
    table.add_column("value", overflow="fold")  # a long command or path folds onto the next line, never cut
    repo = report.repo
    table.add_row("repository", repo.error and f"{repo.path}: {repo.error}" or
                  f"{repo.path} {repo.branch} {repo.commit} ({len(repo.dirty_files)} dirty)")
    py = report.python
    table.add_row("python", f"{py.python_version} {py.executable or py.command}" if py.python_version else str(py.error))
    table.add_row("torch", f"{py.torch_version} CUDA {py.cuda_version} available={py.cuda_available} "
                           f"devices={py.cuda_device_count}" if py.torch_version else str(py.error))
    table.add_row("nproc", str(report.nproc))
    disk = report.disk
    need = f" / needs {disk.required_bytes} ({'fits' if disk.fits else 'DOES NOT FIT'})" if disk.required_bytes else ""
    table.add_row("disk", f"{disk.free_bytes} bytes free at {disk.path}{need}")
    if report.dataset_remote_path:
        table.add_row("dataset", f"{report.dataset_remote_path} present={report.dataset_present}")
    if report.gpus.status == "ok":
        for gpu in report.gpus.gpus:
            procs = ", ".join(f"{p.pid} {p.process_name} {p.used_memory_mib} MiB" for p in report.gpus.processes_on(gpu.uuid))
            table.add_row(f"gpu {gpu.index}", f"{gpu.name} {gpu.uuid} {gpu.memory_used_mib}/{gpu.memory_total_mib} MiB "
                                              f"util {gpu.utilization_pct}% {procs or 'idle'}")
    else:
        table.add_row("gpu", f"{report.gpus.status}: {report.gpus.message}")
    for problem in report.problems:
        table.add_row("[red]problem[/red]", problem)
    for warning in report.warnings:
        table.add_row("[yellow]warning[/yellow]", warning)
    console.print(table)


@app.command("preflight")
@connection_options
def preflight_cmd(
    dataset: Optional[Path] = typer.Option(None, "--dataset", help="dataset.npz to check free disk and presence for."),
    task: Optional[str] = typer.Option(None, "--task", help="Task folder of the dataset (default: as for upload)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    server_config: ServerConfig = None,
) -> None:
    """Report the GPU server's repository, Python/torch/CUDA, nproc, free disk and GPUs (exit 1 on a problem)."""
    from dpflow_core.server.preflight import preflight
    from dpflow_core.server import sha256_file
    from dpflow_core.server.upload import task_for_dataset

    size = digest = None
    if dataset is not None:
        if not dataset.is_file():
            raise typer.BadParameter(f"{dataset} does not exist", param_hint="--dataset")
        size, digest = dataset.stat().st_size, sha256_file(dataset)
        task = task or task_for_dataset(dataset)
    with _server.GpuServer(server_config) as server:
        report = preflight(server, dataset_size_bytes=size, dataset_sha256=digest, task=task)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        _print_report(report)
    if not report.ok:
        raise typer.Exit(1)
