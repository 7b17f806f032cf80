"""The settings of ``dpflow serve``, declared once (the CLI's options are mapped onto them)."""

from __future__ import annotations

import ipaddress
import math
import shlex
from dataclasses import dataclass
from pathlib import Path


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

    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    max_age_s: float = 1.0
    threads: int = 1
    batch_window_s: float = 0.005
    max_batch: int = 16
    mkldnn: bool = False

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


def serve_command(checkpoint: str | Path, settings: ServeSettings = ServeSettings()) -> str:
    """The shell command that serves ``checkpoint`` with ``settings`` (the Dagster ``checkpoint`` asset shows it)."""
    return f"dpflow serve {shlex.quote(str(checkpoint))} --host {settings.host} --port {int(settings.port)}"
