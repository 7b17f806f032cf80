"""Dagster resources, chosen by configuration (never by ``if`` inside assets).

``gpu_server``: :class:`GpuServerResource`, the machine that trains. With no
host it is the local machine (the embedded default, data under
``outputs/server`` or ``$DPFLOW_SERVER_ROOT``); with ``DPFLOW_SERVER_HOST``
set, :func:`default_resources` configures SSH from environment variables
through :class:`dagster.EnvVar`, so the key file, passphrase and host never
appear in run config, logs or metadata (Dagster shows the variable's name).

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
(``true``/``false``; unset: true over SSH, false locally).
"""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any, Iterator, Optional

import dagster as dg
from pydantic import Field
from upath import UPath

from dpflow_core.server import GpuServer, ServerConfig


class GpuServerResource(dg.ConfigurableResource):
    """The GPU server: SSH (Fabric) when ``host`` is set, else the local machine."""

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

    def server_config(self) -> ServerConfig:
        """The :class:`ServerConfig` this resource describes (local defaults when no host)."""
        common = dict(
            repo_path=self.repo_path, python=self.python, activate=self.activate, data_root=self.data_root,
            nvidia_smi=self.nvidia_smi, tmux_socket=self.tmux_socket, expect_gpu=self.expect_gpu,
        )
        if not self.host:
            return ServerConfig.local(**common)
        values = dict(
            host=self.host, port=self.port, user=self.user, key_filename=self.key_file,
            key_passphrase=self.key_passphrase, known_hosts=self.known_hosts,
            trust_on_first_use=self.trust_on_first_use, **common,
        )
        return ServerConfig(**{k: v for k, v in values.items() if v is not None})

    @contextlib.contextmanager
    def connect(self) -> Iterator[GpuServer]:
        """A connected :class:`GpuServer`, closed on exit."""
        with GpuServer(self.server_config()) as server:
            yield server


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


def gpu_server_from_env() -> GpuServerResource:
    """``GpuServerResource`` from the ``DPFLOW_SERVER_*`` variables (local when no host is set)."""
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
