"""The ``server:`` section of a lab.yaml: one server, a Slurm cluster, or several servers.

Takes the parsed YAML mapping (and the file's name for messages); gives a validated
:class:`LabServers`: the mode (``single``, ``slurm`` or ``hosts``), one
:class:`~dpflow_core.server.ServerConfig` per machine (rank order for ``hosts``), and the
multi-machine settings. Keys and their meaning are those of the README's "Scaling out" section:

* connection keys (``host``, ``port``, ``user``, ``key_file``, ``known_hosts``, ``data_root``,
  ``repo_path``, ``python``, ``activate``, ``nvidia_smi``, ``expect_gpu``, ``tmux_socket``);
* ``scheduler: slurm`` with a ``slurm:`` mapping (the fields of :class:`~dpflow_core.server.SlurmSettings`);
* ``hosts:`` a list of mappings of connection keys, each overriding the shared ones above it, with
  ``network_interface`` and ``main_address`` beside it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from dpflow_core.errors import RemoteError
from dpflow_core.server.config import ServerConfig, SlurmSettings


#: lab.yaml connection keys and the ServerConfig field each sets.
CONNECTION_KEYS = {
    "host": "host", "port": "port", "user": "user", "key_file": "key_filename", "known_hosts": "known_hosts",
    "data_root": "data_root", "repo_path": "repo_path", "python": "python", "activate": "activate",
    "nvidia_smi": "nvidia_smi", "expect_gpu": "expect_gpu", "tmux_socket": "tmux_socket",
}
#: Keys of ``server:`` beyond the connection keys.
SCALE_KEYS = ("scheduler", "slurm", "hosts", "network_interface", "main_address")
SLURM_KEYS = tuple(f.name for f in dataclasses.fields(SlurmSettings))


@dataclass(frozen=True)
class LabServers:
    """The machines a lab.yaml names.

    Attributes:
        mode: ``single`` (one server, or this machine), ``slurm`` (a cluster through its login node
            or this machine) or ``hosts`` (several servers, one multi-machine run).
        servers: one ServerConfig per machine (one for ``single`` and ``slurm``), rank order.
        network_interface: ``hosts`` only: the interface the ranks talk over (None: the default route).
        main_address: ``hosts`` only: how the ranks reach the first host (None: its ``host``).
    """

    mode: Literal["single", "slurm", "hosts"]
    servers: tuple[ServerConfig, ...]
    network_interface: str | None = None
    main_address: str | None = None


def _bad(source: str, message: str) -> RemoteError:
    return RemoteError(f"{source}: {message}", code="bad_config")


def _connection(values: Mapping[str, Any], source: str, where: str, extra_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in CONNECTION_KEYS:
            valid = ", ".join(sorted({*CONNECTION_KEYS, *extra_keys}))
            raise _bad(source, f"unknown key {key!r} {where}; valid keys: {valid}")
        out[CONNECTION_KEYS[key]] = value
    return out


def _config(values: dict[str, Any], source: str, where: str) -> ServerConfig:
    try:
        if values.get("host") is None:
            return ServerConfig.local(**values)
        return ServerConfig(**values)
    except RemoteError as exc:
        raise _bad(source, f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise _bad(source, f"{where}: {exc}") from None


def lab_servers(server: Mapping[str, Any] | None, source: str | Path = "lab.yaml") -> LabServers:
    """Validate a lab.yaml's ``server:`` mapping (None: this machine) and build its ServerConfigs.

    Raises:
        RemoteError: ``bad_config``, naming the file and the key: an unknown key, ``slurm`` without
            ``scheduler: slurm``, ``hosts`` together with Slurm or with fewer than two entries, a
            value ServerConfig or SlurmSettings refuses.
    """
    source = str(source)
    server = dict(server or {})
    if not isinstance(server, dict):
        raise _bad(source, f"'server' must be a mapping, got {server!r}")
    shared = {k: v for k, v in server.items() if k not in SCALE_KEYS}
    base = _connection(shared, source, "under 'server'", SCALE_KEYS)
    scheduler = server.get("scheduler", "none")
    if scheduler not in ("none", "slurm"):
        raise _bad(source, f"server.scheduler must be 'none' or 'slurm', got {scheduler!r}")
    hosts = server.get("hosts")
    if scheduler == "slurm":
        if hosts is not None:
            raise _bad(source, "server.hosts and scheduler: slurm exclude each other (Slurm chooses the nodes)")
        slurm = server.get("slurm") or {}
        if not isinstance(slurm, dict):
            raise _bad(source, f"server.slurm must be a mapping, got {slurm!r}")
        unknown = sorted(set(slurm) - set(SLURM_KEYS))
        if unknown:
            raise _bad(source, f"unknown key {unknown[0]!r} under 'server: slurm'; valid keys: {', '.join(SLURM_KEYS)}")
        try:
            settings = SlurmSettings(**{**slurm, "extra_sbatch": tuple(slurm.get("extra_sbatch") or ())})
        except (RemoteError, TypeError, ValueError) as exc:
            raise _bad(source, f"server.slurm: {exc}") from None
        return LabServers("slurm", (_config({**base, "scheduler": "slurm", "slurm": settings}, source, "server"),))
    if "slurm" in server:
        raise _bad(source, "server.slurm is set but server.scheduler is not 'slurm'")
    if hosts is None:
        for key in ("network_interface", "main_address"):
            if key in server:
                raise _bad(source, f"server.{key} applies to server.hosts only")
        return LabServers("single", (_config(base, source, "server"),))
    if not isinstance(hosts, list) or len(hosts) < 2 or not all(isinstance(h, dict) for h in hosts):
        raise _bad(source, f"server.hosts must be a list of at least two mappings (one per machine), got {hosts!r}")
    configs = []
    for i, entry in enumerate(hosts):
        values = {**base, **_connection(entry, source, f"under 'server: hosts[{i}]'")}
        if values.get("host") is None:
            raise _bad(source, f"server.hosts[{i}] has no host")
        configs.append(_config(values, source, f"server.hosts[{i}]"))
    return LabServers("hosts", tuple(configs), network_interface=server.get("network_interface"),
                      main_address=server.get("main_address"))
