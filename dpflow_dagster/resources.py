"""Dagster resources, chosen by configuration (never by ``if`` inside assets).

``gpu_server``: :class:`GpuServerResource`, the machine that trains. With no
host it is the local machine (the embedded default, data under
``outputs/server`` or ``$DPFLOW_SERVER_ROOT``); with ``DPFLOW_SERVER_HOST``
set, :func:`default_resources` configures SSH from environment variables
through :class:`dagster.EnvVar`, so the key file, passphrase and host never
appear in run config, logs or metadata (Dagster shows the variable's name).

The same resource drives a Slurm cluster (``scheduler: slurm`` with ``slurm:`` settings; the
host, when set, is the login node) or several servers (``hosts:``, one entry per machine): the
``server:`` section of a lab.yaml, field for field. :meth:`GpuServerResource.lab` hands the fields
to :func:`dpflow_core.server.lab.lab_servers`, which validates them as it does a lab.yaml. With
``DPFLOW_LAB`` set to a lab.yaml, :func:`default_resources` takes the resource from its ``server:``
section (this is how ``dpflow demo --config`` passes a cluster or several servers on).

``io_manager``: :class:`ProductPathIOManager`, Dagster's pickle-on-disk storage of
the values passed between assets (the same files and layout as
``dg.FilesystemIOManager``), except that a materialization's ``path`` metadata
stays the product's own file or folder (dataset, run directory, checkpoint,
LeRobot folder, report) as the asset set it, never the pickle's path.

Environment variables read by :func:`default_resources`:
``DPFLOW_SERVER_HOST``, ``DPFLOW_SERVER_PORT``, ``DPFLOW_SERVER_USER``,
``DPFLOW_SERVER_KEY``, ``DPFLOW_SERVER_KEY_PASSPHRASE``, ``DPFLOW_KNOWN_HOSTS``,
``DPFLOW_SERVER_ROOT``, ``DPFLOW_SERVER_REPO``, ``DPFLOW_SERVER_PYTHON``,
``DPFLOW_SERVER_ACTIVATE``, ``DPFLOW_SERVER_NVIDIA_SMI`` and ``DPFLOW_SERVER_EXPECT_GPU``
(``true``/``false``; unset: true over SSH, false locally); ``DPFLOW_LAB`` (a lab.yaml) replaces them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any, Iterator, List, Optional

import dagster as dg
from pydantic import Field
from upath import UPath

from dpflow_core.server import GpuServer, ServerConfig
from dpflow_core.server.lab import CONNECTION_KEYS, LabServers, lab_servers


class SlurmConfig(dg.Config):
    """``server.slurm`` of a lab.yaml: the fields of :class:`dpflow_core.server.SlurmSettings`, which validates them."""

    partition: Optional[str] = Field(default=None, description="--partition (empty: the cluster's default).")
    account: Optional[str] = Field(default=None, description="--account (empty: the user's default).")
    nodes: int = Field(default=1, description="--nodes of a training job (a smoke run uses one).")
    gpus_per_node: int = Field(default=0, description="--gpus-per-node and processes per node; 0: one CPU process per node.")
    cpus_per_task: Optional[int] = Field(default=None, description="--cpus-per-task (empty: the cluster's default).")
    time_limit: Optional[str] = Field(default=None, description="--time: MM, HH:MM:SS or D-HH:MM:SS (empty: the partition's).")
    extra_sbatch: List[str] = Field(default_factory=list, description="Further #SBATCH options, e.g. --qos=high, --mem=64G.")
    main_process_port: Optional[int] = Field(default=None, description="Rendezvous port on the first node (empty: from the run name).")


class HostConfig(dg.Config):
    """One entry of ``server.hosts``: the connection settings of one machine, each overriding the shared one."""

    host: str = Field(description="SSH host of this machine (rank order: the first is the main machine).")
    port: Optional[int] = Field(default=None, description="SSH port (empty: the shared one).")
    user: Optional[str] = Field(default=None, description="SSH user (empty: the shared one).")
    key_file: Optional[str] = Field(default=None, description="Private key file (empty: the shared one).")
    known_hosts: Optional[str] = Field(default=None, description="known_hosts file (empty: the shared one).")
    data_root: Optional[str] = Field(default=None, description="Data root on this machine (empty: the shared one).")
    repo_path: Optional[str] = Field(default=None, description="Training repository (empty: the shared one).")
    python: Optional[str] = Field(default=None, description="Python command (empty: the shared one).")
    activate: Optional[str] = Field(default=None, description="Shell line run before Python (empty: the shared one).")
    nvidia_smi: Optional[str] = Field(default=None, description="nvidia-smi command (empty: the shared one).")
    expect_gpu: Optional[bool] = Field(default=None, description="The machine must have a working GPU (empty: the shared one).")
    tmux_socket: Optional[str] = Field(default=None, description="tmux -L socket name (empty: the shared one).")


def _set(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


class GpuServerResource(dg.ConfigurableResource):
    """The GPU server: SSH (Fabric) when ``host`` is set, else the local machine; a Slurm cluster with
    ``scheduler: slurm``; several servers with ``hosts``."""

    host: Optional[str] = Field(default=None, description="SSH host; empty for the local machine.")
    port: int = Field(default=22, description="SSH port.")
    user: Optional[str] = Field(default=None, description="SSH user (default: the local user name).")
    key_file: Optional[str] = Field(default=None, description="Private key file; set it with EnvVar.")
    key_passphrase: Optional[str] = Field(default=None, description="Passphrase of key_file; set it with EnvVar.")
    known_hosts: Optional[str] = Field(default=None, description="known_hosts file (default ~/.ssh/known_hosts).")
    trust_on_first_use: bool = Field(default=False, description="Accept and record an unknown host key once.")
    repo_path: Optional[str] = Field(default=None, description="Training repository on the server.")
    python: Optional[str] = Field(default=None, description="Python command on the server.")
    activate: Optional[str] = Field(default=None, description="Shell line run before Python (conda activation).")
    data_root: Optional[str] = Field(default=None, description="Data root on the server.")
    nvidia_smi: str = Field(default="nvidia-smi", description="nvidia-smi command on the server.")
    expect_gpu: Optional[bool] = Field(
        default=None,
        description="The server must have a working GPU (a failing nvidia-smi fails preflight and refuses runs); "
        "empty: yes over SSH, no locally.",
    )
    tmux_socket: Optional[str] = Field(default=None, description="tmux -L socket name (default server when empty).")
    upload_method: str = Field(default="auto", description="auto | rsync | stream (SFTP or local copy).")
    scheduler: str = Field(default="none", description="none: runs start in tmux on the server; slurm: sbatch through "
                           "this server (the login node, or this machine without a host).")
    slurm: Optional[SlurmConfig] = Field(default=None, description="Slurm settings (with scheduler: slurm).")
    hosts: List[HostConfig] = Field(default_factory=list, description="Several servers, one multi-machine run over them "
                                    "(rank order); the settings above are shared by every entry.")
    network_interface: Optional[str] = Field(default=None, description="hosts only: the interface the ranks talk over.")
    main_address: Optional[str] = Field(default=None, description="hosts only: how the ranks reach the first host (empty: its host).")

    def lab_section(self) -> dict[str, Any]:
        """The ``server:`` mapping of a lab.yaml that this resource's fields spell (unset fields left out)."""
        section = _set({key: getattr(self, key) for key in CONNECTION_KEYS})
        if self.scheduler != "none":
            section["scheduler"] = self.scheduler
        if self.slurm is not None:
            section["slurm"] = _set({k: getattr(self.slurm, k) for k in SlurmConfig.model_fields})
        if self.hosts:
            section["hosts"] = [_set({k: getattr(h, k) for k in HostConfig.model_fields}) for h in self.hosts]
        section.update(_set({"network_interface": self.network_interface, "main_address": self.main_address}))
        return section

    def lab(self) -> LabServers:
        """The machines this resource names, validated by :func:`dpflow_core.server.lab.lab_servers`.

        Raises:
            RemoteError: ``bad_config``, naming the field and the reason.
        """
        lab = lab_servers(self.lab_section(), "the gpu_server resource")
        servers = []
        for config in lab.servers:
            if config.host is not None:  # SSH-only settings, not lab.yaml keys; the passphrase goes with the shared key
                passphrase = self.key_passphrase if config.key_filename == self.key_file else None
                config = dataclasses.replace(config, trust_on_first_use=self.trust_on_first_use, **_set({"key_passphrase": passphrase}))
            servers.append(config)
        return dataclasses.replace(lab, servers=tuple(servers))

    def server_config(self) -> ServerConfig:
        """The :class:`ServerConfig` of the server (local defaults when no host), the login node, or the first host."""
        return self.lab().servers[0]

    @contextlib.contextmanager
    def connect(self) -> Iterator[GpuServer]:
        """A connected :class:`GpuServer` (the first host for ``hosts``: where rank 0 logs and saves), closed on exit."""
        with GpuServer(self.server_config()) as server:
            yield server

    @contextlib.contextmanager
    def connect_all(self) -> Iterator[list[GpuServer]]:
        """Every machine connected (rank order; one for a single server or a Slurm login node), closed on exit."""
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(GpuServer(c)) for c in self.lab().servers]

    @classmethod
    def from_lab(cls, server: Optional[dict], source: str | Path = "lab.yaml", **extra: Any) -> "GpuServerResource":
        """The resource of a lab.yaml's ``server:`` mapping (keys and resource fields are the same names).

        Raises:
            RemoteError: ``bad_config`` from :func:`lab_servers`, naming ``source`` and the key.
        """
        lab_servers(server, source)  # validated (and refused with the file's name) before Dagster sees it
        return cls(**dict(server or {}), **extra)


class _ProductPathPickleIOManager(dg.UPathIOManager):
    """Pickles under ``base_path/<asset key>/<partition>``; ``path`` metadata left to the asset."""

    extension = ""

    def dump_to_path(self, context: dg.OutputContext, obj: Any, path: UPath) -> None:
        with path.open("wb") as f:
            pickle.dump(obj, f, pickle.HIGHEST_PROTOCOL)

    def load_from_path(self, context: dg.InputContext, path: UPath) -> Any:
        with path.open("rb") as f:
            return pickle.load(f)

    def get_metadata(self, context: dg.OutputContext, obj: Any) -> dict[str, Any]:
        # UPathIOManager sets "path" to the pickle just before merging these; the asset's own "path" wins
        own = (context.output_metadata or {}).get("path")
        return {} if own is None else {"path": own}


class ProductPathIOManager(dg.ConfigurableIOManagerFactory):
    """Dagster's filesystem pickle IO manager whose materializations keep the asset's own ``path`` metadata.

    Values are pickled to ``<base_dir>/<asset key>/<partition key>`` (``base_dir`` default: the
    instance's storage directory, ``$DAGSTER_HOME/storage``), the layout of ``dg.FilesystemIOManager``,
    so values stored by it load unchanged.
    """

    base_dir: Optional[str] = Field(default=None, description="Folder of the pickles; default the instance's storage directory.")

    def create_io_manager(self, context: dg.InitResourceContext) -> dg.UPathIOManager:
        base = self.base_dir or context.instance.storage_directory()
        return _ProductPathPickleIOManager(base_path=UPath(base))
def _gpu_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if os.environ.get("DPFLOW_SERVER_NVIDIA_SMI"):
        fields["nvidia_smi"] = dg.EnvVar("DPFLOW_SERVER_NVIDIA_SMI")
    value = os.environ.get("DPFLOW_SERVER_EXPECT_GPU", "").strip().lower()
    if value:
        if value not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"DPFLOW_SERVER_EXPECT_GPU={value!r}: expected true or false")
        fields["expect_gpu"] = value in ("true", "1", "yes")
    return fields


def gpu_server_from_lab_file(path: str | Path) -> GpuServerResource:
    """``GpuServerResource`` from the ``server:`` section of the lab.yaml at ``path``.

    Raises:
        RemoteError: ``bad_config`` when the file is missing, not YAML, not a mapping, or its
            ``server:`` section is invalid (naming the file and the key).
    """
    import yaml

    from dpflow_core.errors import RemoteError

    path = Path(path).expanduser()
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RemoteError(f"cannot read the lab.yaml: {exc}", path=path, code="bad_config") from None
    if not isinstance(settings, dict):
        raise RemoteError("expected a mapping with a 'server' key", path=path, code="bad_config")
    return GpuServerResource.from_lab(settings.get("server"), path)


def gpu_server_from_env() -> GpuServerResource:
    """``GpuServerResource`` from ``DPFLOW_LAB`` (a lab.yaml) when set, else from the ``DPFLOW_SERVER_*``
    variables (local when no host is set)."""
    if os.environ.get("DPFLOW_LAB"):
        return gpu_server_from_lab_file(os.environ["DPFLOW_LAB"])
    if not os.environ.get("DPFLOW_SERVER_HOST"):
        return GpuServerResource(
            data_root=dg.EnvVar("DPFLOW_SERVER_ROOT") if os.environ.get("DPFLOW_SERVER_ROOT") else None,
            **_gpu_fields(),
        )
    fields: dict[str, Any] = {"host": dg.EnvVar("DPFLOW_SERVER_HOST"), **_gpu_fields()}
    if os.environ.get("DPFLOW_SERVER_PORT"):
        fields["port"] = dg.EnvVar.int("DPFLOW_SERVER_PORT")
    for name, var in (
        ("user", "DPFLOW_SERVER_USER"),
        ("key_file", "DPFLOW_SERVER_KEY"),
        ("key_passphrase", "DPFLOW_SERVER_KEY_PASSPHRASE"),
        ("known_hosts", "DPFLOW_KNOWN_HOSTS"),
        ("data_root", "DPFLOW_SERVER_ROOT"),
        ("repo_path", "DPFLOW_SERVER_REPO"),
        ("python", "DPFLOW_SERVER_PYTHON"),
        ("activate", "DPFLOW_SERVER_ACTIVATE"),
    ):
        if os.environ.get(var):
            fields[name] = dg.EnvVar(var)
    return GpuServerResource(**fields)


def default_resources() -> dict[str, Any]:
    """Resources of the embedded default: ``gpu_server`` (local unless ``DPFLOW_SERVER_HOST`` is set) and
    ``io_manager`` (:class:`ProductPathIOManager`)."""
    return {"gpu_server": gpu_server_from_env(), "io_manager": ProductPathIOManager()}
