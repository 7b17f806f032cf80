"""A served policy used like an in-process one: :class:`RemotePolicy`.

``RemotePolicy("ws://127.0.0.1:8000")`` connects to ``dpflow serve``, reads its
metadata and offers what a closed-loop rollout uses of
:class:`dpflow_core.inference.Policy`: ``n_obs_steps``, ``horizon``,
``action_dt_s``, ``frequency_hz`` and ``predict_action(obs, frame=...)``, which
sends the aligned ``(To, ...)`` observation and returns the same dict. Example::

    with RemotePolicy("ws://127.0.0.1:8000") as policy:
        out = policy.predict_action(obs, noise_seed=0)
        out["action"].shape == (policy.horizon, 7)

The network time of the last request is in ``last_timing["network_ms"]``
(round trip less the server's ``total_ms``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpflow_core.errors import DpflowError
from dpflow_core.serving.protocol import pack, unpack


class ServingError(DpflowError):
    """The policy server answered with an error, or could not be reached."""

    code = "serving_error"


class RemotePolicy:
    """A policy served by ``dpflow serve`` (see the module docstring).

    Args:
        url: ``ws://host:port``.
        open_timeout_s: how long to wait for the connection and the metadata.
        timeout_s: how long to wait for each answer (None: forever).

    Attributes:
        metadata: the server's metadata (:func:`dpflow_core.serving.server.policy_metadata`).
        last_timing: ``server_timing`` of the last answer plus ``round_trip_ms`` and ``network_ms``.

    Raises:
        ServingError: the server cannot be reached or sent no metadata.
    """

    def __init__(self, url: str, open_timeout_s: float = 10.0, timeout_s: float | None = 60.0):
        import websockets.sync.client

        self.url, self.timeout_s = url, timeout_s
        try:
            self._ws = websockets.sync.client.connect(url, compression=None, max_size=None, open_timeout=open_timeout_s)
            self.metadata: dict[str, Any] = unpack(self._ws.recv(timeout=open_timeout_s))
        except (OSError, TimeoutError, DpflowError) as exc:
            raise ServingError(f"no policy server at {url}: {exc}") from exc
        except Exception as exc:  # websockets' handshake errors share no base class with OSError
            raise ServingError(f"no policy server at {url}: {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self.last_timing: dict[str, float] = {}

    @property
    def n_obs_steps(self) -> int:
        return int(self.metadata["n_obs_steps"])

    @property
    def horizon(self) -> int:
        return int(self.metadata["horizon"])

    @property
    def n_action_steps(self) -> int:
        return int(self.metadata["n_action_steps"])

    @property
    def action_dt_s(self) -> float:
        """Seconds between consecutive predicted actions."""
        return float(self.metadata["action_dt_s"])

    @property
    def frequency_hz(self) -> float:
        """The training dataset's frequency."""
        return float(self.metadata["frequency_hz"])

    def predict_action(self, obs: Mapping[str, Any], generator=None, frame: str = "tcp",
                       noise_seed: int | None = None, now_s: float | None = None) -> dict[str, np.ndarray]:
        """What :meth:`dpflow_core.inference.Policy.predict_action` returns, computed by the server.

        Args:
            obs: the aligned observation ``Policy.predict_action`` takes (``(To, ...)`` per
                key, optionally ``timestamp`` ``(To,)`` s); or streams
                (``{"timestamp", "value"}`` per key) for the server to align.
            generator: a ``torch.Generator``: the request's noise seed is drawn from it
                (so a seeded rollout stays reproducible; the noise differs from
                in-process use of the same generator).
            frame: ``"tcp"`` or ``"dataset"``.
            noise_seed: the noise in-process ``torch.Generator().manual_seed(noise_seed)``
                gives: the same answer as in-process to float precision. Wins over ``generator``.
            now_s: the time now on the observation's clock; the server then refuses a
                stale observation.

        Returns:
            ``{"robot0_eef_pos": (H, 3), "robot0_eef_rot_axis_angle": (H, 3),
            "robot0_gripper_width": (H, 1), "action": (H, 7), "timestamp": (H,)}`` float64
            (a leading B for a batched observation).

        Raises:
            ServingError: the server refused the request (its message says why), sent no
                answer within ``timeout_s``, or the connection broke.
        """
        request: dict[str, Any] = {k: _wire(v) for k, v in obs.items()}
        request["frame"] = frame
        if noise_seed is None and generator is not None:
            import torch

            noise_seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
        if noise_seed is not None:
            request["noise_seed"] = int(noise_seed)
        if now_s is not None:
            request["now_s"] = float(now_s)
        with self._lock:
            start = time.perf_counter()
            try:
                self._ws.send(pack(request))
                reply = self._ws.recv(timeout=self.timeout_s)
            except TimeoutError:
                self._ws.close()  # a late answer would be read as the next request's
                raise ServingError(f"server {self.url} sent no answer within {self.timeout_s:g} s; "
                                   "connection closed") from None
            except Exception as exc:
                raise ServingError(f"connection to {self.url} broke: {type(exc).__name__}: {exc}") from exc
            round_trip_ms = (time.perf_counter() - start) * 1e3
        if isinstance(reply, str):
            raise ServingError(f"server {self.url} refused the request: {reply}")
        answer = unpack(reply)
        timing = dict(answer.pop("server_timing", {}))
        timing["round_trip_ms"] = round_trip_ms
        timing["network_ms"] = round_trip_ms - float(timing.get("total_ms", 0.0))
        self.last_timing = timing
        for key in ("n_action_steps", "frame"):
            answer.pop(key, None)
        return answer

    def close(self) -> None:
        """Close the connection."""
        self._ws.close()

    def __enter__(self) -> RemotePolicy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wire(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _wire(v) for k, v in value.items()}
    if isinstance(value, (np.ndarray, np.generic, int, float, str, bool)) or value is None:
        return value
    return np.asarray(value)
