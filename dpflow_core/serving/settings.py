"""The settings of ``dpflow serve``, declared once (DESIGN rule 16).

Each field's metadata names its ``dpflow serve`` option and help (:func:`cli_option`): the
CLI declares its options from them and :func:`serve_command` prints them, so the printed
command rebuilds the same :class:`ServeSettings`. A test parses that command with the CLI.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeSettings:
    """Where and how a checkpoint is served.

    Attributes:
        host: address to bind; loopback by default. Anything else exposes the policy,
            unauthenticated, to the network (warned about).
        port: TCP port; 0 lets the system choose (the bound port is reported).
        device: torch device for inference (``cpu``, ``cuda``, ``cuda:1``).
        max_age_s: oldest accepted anchor frame, seconds before the request's ``now_s``.
        threads: torch intra-op threads for inference on the CPU. One by default: on a
            loaded 2-core machine the tiny demo policy took 300-550 ms per request with
            torch's default of one thread per core (OpenMP threads spin-waiting on the
            event loop's and the other clients' threads) and 12-15 ms with one.
        batch_window_s: when other clients are connected, how long a batch waits for
            their requests before inference starts (a lone client never waits); 0: stack
            only the requests that arrived during the previous inference. Measured with two
            clients sending back to back (docs/benchmarks.md, "Serving latency"): with 0 they
            fall into turns and never share a batch (p95 1.85-2.1x one client's); 2-10 ms
            batched every request (1.1-1.6x); 5 ms is the default.
        max_batch: most requests stacked into one inference.
        mkldnn: let torch use oneDNN convolutions on the CPU. Off by default: torch picks
            them for batches above one, and on the demo and sim policies (1 thread) a batch
            of 2 then took 29-46 ms against 14-31 ms without them (a batch of 1: 13 and 22 ms
            either way; bench/serve_latency.py's section of docs/benchmarks.md). A large
            image encoder on the CPU may gain from them.

    Raises:
        ValueError: a port outside 0..65535, a max_age_s that is not a positive number, a
            negative or non-finite batch_window_s, threads or max_batch below 1.
    """

    host: str = field(default="127.0.0.1", metadata={
        "option": "--host", "help": "Address to bind; anything but loopback is warned about."})
    port: int = field(default=8000, metadata={
        "option": "--port", "help": "TCP port (0: any free port, printed when bound)."})
    device: str = field(default="cpu", metadata={
        "option": "--device", "help": "torch device for inference (cpu, cuda, cuda:1, ...)."})
    max_age_s: float = field(default=1.0, metadata={
        "option": "--max-age-s",
        "help": "Refuse observations whose newest frame is older than this (seconds) at the request's now_s."})
    threads: int = field(default=1, metadata={
        "option": "--threads", "help": "torch intra-op threads for CPU inference."})
    batch_window_s: float = field(default=0.005, metadata={
        "option": "--batch-window-s",
        "help": "With several clients connected: how long (seconds) a batch waits for their requests."})
    max_batch: int = field(default=16, metadata={
        "option": "--max-batch", "help": "Most requests stacked into one inference."})
    mkldnn: bool = field(default=False, metadata={
        "option": "--mkldnn/--no-mkldnn", "help": "oneDNN convolutions on the CPU (slower for small policies)."})

    def __post_init__(self):
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not math.isfinite(float(self.max_age_s)) or float(self.max_age_s) <= 0:
            raise ValueError(f"max_age_s must be a positive number of seconds, got {self.max_age_s}")
        if int(self.threads) < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not math.isfinite(float(self.batch_window_s)) or float(self.batch_window_s) < 0:
            raise ValueError(f"batch_window_s must be a non-negative number of seconds, got {self.batch_window_s}")
        if int(self.max_batch) < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def cli_option(name: str) -> tuple[Any, str, str]:
    """``(default, flag, help)`` of the :class:`ServeSettings` field ``name``, as ``dpflow serve`` declares it.

    Raises:
        KeyError: no such field, or a field whose metadata lacks its ``option`` or ``help``.
    """
    spec = {f.name: f for f in dataclasses.fields(ServeSettings)}[name]
    return spec.default, spec.metadata["option"], spec.metadata["help"]


def _words(flag: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        on, _, off = flag.partition("/")
        return [on if value else off]
    if isinstance(value, float):
        return [flag, repr(value)]  # repr: the shortest text that parses back to the same float
    return [flag, shlex.quote(str(value))]


def serve_command(checkpoint: str | Path, settings: ServeSettings = ServeSettings()) -> str:
    """The shell command that serves ``checkpoint`` with ``settings`` (the Dagster ``checkpoint`` asset shows it).

    Host and port always appear; every other field only where it differs from its default.

    Raises:
        KeyError: a field without its option in the metadata (a settings field the CLI would not know).
    """
    default = ServeSettings()
    words = ["dpflow", "serve", shlex.quote(str(checkpoint))]
    for spec in dataclasses.fields(ServeSettings):
        value = getattr(settings, spec.name)
        if spec.name in ("host", "port") or value != getattr(default, spec.name):
            words += _words(cli_option(spec.name)[1], value)
    return " ".join(words)
