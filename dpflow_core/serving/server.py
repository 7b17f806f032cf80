"""``dpflow serve``: one checkpoint behind openpi's websocket policy protocol.

The protocol (:mod:`dpflow_core.serving.protocol`): metadata on connect, then per
client frame an observation answered by one action chunk. Requests come in two kinds:

- *streams* (a robot): per key ``{"timestamp": (N,) s, "value": (N, ...)}``, aligned
  by :func:`~dpflow_core.serving.timing.align_observation` as training aligned samples;
- *aligned* (a rollout that already holds the ``n_obs_steps`` history, as
  :class:`~dpflow_core.serving.client.RemotePolicy` sends it): per key the
  ``(To, ...)`` arrays :meth:`~dpflow_core.inference.Policy.predict_action` takes,
  optionally ``timestamp`` ``(To,)``.

Optional request fields: ``now_s`` (the client's clock when it sent the request;
streams without it are judged at the server's ``time.time()``, aligned requests are
then not age-checked), ``noise_seed`` (int: the initial noise of a
``torch.Generator`` seeded so, as in-process), ``frame`` (``"tcp"``, the default, or
``"dataset"``). The answer is the dict ``predict_action`` returns (absolute poses,
gripper widths, ``action`` and ``timestamp``, the actions' target times) plus
``n_action_steps``, ``frame`` and ``server_timing`` (milliseconds: ``decode``,
``preprocess``, ``queue``, ``inference``, ``postprocess``, ``total``; the client
adds the network time as the round trip less ``total``).

Concurrency: the event loop only reads, decodes and sends; alignment runs in the
default thread pool, and inference on one worker thread, in batches. Requests that
arrive while an inference runs wait for it and then go into the next batch together:
single-observation requests with the same keys, shapes and frame are stacked into one
``predict_action`` call (each keeps its own noise seed, so each answer is what it would
be alone) and answered one by one, each with its own timing split and ``batch_size``.
When more clients are connected than requests are waiting, the server waits up to
``batch_window_s`` for the others before it starts (a lone client never waits). A
client therefore waits for at most one inference ahead of its own; the others' network
and decoding never block it (openpi's own server runs inference on its event loop, so a
second client waits for the first, openpi #717). A batch that fails, in inference or
around it, answers each of its requests with the error on its socket and the next
batch runs; should the batching task itself end, the server stops instead of leaving
requests unanswered.
"""

from __future__ import annotations

import asyncio
import http
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.dataset import dataset_task
from dpflow_core.serving.protocol import pack, unpack
from dpflow_core.serving.settings import ServeSettings
from dpflow_core.serving.timing import MAX_AGE_S, ObservationError, StaleObservationError, align_observation, stream_keys
from dpflow_core.train.data import GRIPPER_KEY, POS_KEY, ROT_KEY, ROT_WRT_START_KEY, START_POSE_KEY

log = logging.getLogger(__name__)

PROTOCOL = "openpi-websocket"


#: What a request may hold besides the policy's observation keys (module doc).
REQUEST_FIELDS = ("timestamp", "now_s", "noise_seed", "frame")


def policy_metadata(policy, checkpoint_sha256: str, image_shapes: Mapping[str, Any], max_age_s: float) -> dict[str, Any]:
    """What the server sends on connect: shapes, steps, rates, latencies and identities (plain values).

    Keys: ``server``, ``protocol``, ``checkpoint`` (path), ``checkpoint_sha256``,
    ``dataset_sha256``, ``dataset_path``, ``task`` (the dataset's task when its ``dataset.json`` is on this
    machine, else None), ``observation`` (per key ``{"shape": per
    sample, "dtype", "kind": "stream" | "constant"}``), ``n_obs_steps``,
    ``horizon``, ``n_action_steps``, ``obs_down_sample_steps``,
    ``action_down_sample_steps``, ``frequency_hz``, ``obs_dt_s``, ``action_dt_s``,
    ``latency_s`` (the trained camera/robot/gripper observation latencies),
    ``obs_latency_shift_s`` (per low-dimensional key, seconds it is read after the
    frame), ``action_keys``, ``frames`` (``["tcp", "dataset"]``), ``tx_cam_tcp``,
    ``max_age_s``.
    """
    from dpflow_core import __version__

    spec = policy.spec
    rgb_keys, lowdim_keys = stream_keys(spec)
    obs: dict[str, Any] = {k: {"shape": [int(v) for v in image_shapes[k]], "dtype": "uint8", "kind": "stream"}
                           for k in rgb_keys}
    widths = {POS_KEY: 3, ROT_KEY: 3, GRIPPER_KEY: 1}
    for key in lowdim_keys:
        obs[key] = {"shape": [widths.get(key, -1)], "dtype": "float64", "kind": "stream"}
    if ROT_WRT_START_KEY in spec.lowdim_keys:
        obs[START_POSE_KEY] = {"shape": [6], "dtype": "float64", "kind": "constant"}
    task = policy.cfg.get("task", {}) if hasattr(policy.cfg, "get") else {}
    latency = {name: float(task.get(f"{name}_obs_latency", 0.0) or 0.0) for name in ("camera", "robot", "gripper")}
    freq = float(policy.frequency_hz)
    return {
        "server": f"dpflow {__version__}",
        "protocol": PROTOCOL,
        "checkpoint": str(Path(policy.path).resolve()),
        "checkpoint_sha256": checkpoint_sha256,
        "dataset_sha256": str(policy.dataset.get("sha256") or ""),
        "dataset_path": str(policy.dataset.get("path") or ""),
        "task": dataset_task(policy.dataset.get("path")),
        "observation": obs,
        "n_obs_steps": int(spec.n_obs_steps),
        "horizon": int(spec.horizon),
        "n_action_steps": int(policy.network.n_action_steps),
        "obs_down_sample_steps": int(spec.obs_down_sample_steps),
        "action_down_sample_steps": int(spec.action_down_sample_steps),
        "frequency_hz": freq,
        "obs_dt_s": spec.obs_down_sample_steps / freq,
        "action_dt_s": float(policy.action_dt_s),
        "latency_s": latency,
        "obs_latency_shift_s": {k: spec.latency(k) / freq for k in lowdim_keys},
        "action_keys": [POS_KEY, ROT_KEY, GRIPPER_KEY],
        "frames": ["tcp", "dataset"],
        "tx_cam_tcp": [list(map(float, r)) for r in spec.tx_cam_tcp],
        "max_age_s": float(max_age_s),
    }


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check, ready for inference.

    Attributes:
        obs: the aligned observation ``predict_action`` takes (``(To, ...)`` per key, or ``(B, To, ...)``).
        arrays: :meth:`~dpflow_core.inference.Policy.check_obs`'s ``(B, To, ...)`` arrays of it.
        batched: whether the client sent a batch itself (then it is inferred on its own).
        frame: ``"tcp"`` or ``"dataset"``.
        noise_seed: the request's noise seed, or None (torch's global generator).
    """

    obs: dict[str, np.ndarray]
    arrays: dict[str, np.ndarray]
    batched: bool
    frame: str
    noise_seed: int | None

    def stack_key(self) -> tuple | None:
        """Requests with equal keys stack into one batch; None: never stacked."""
        if self.batched:
            return None
        shapes = tuple((k, a.shape, a.dtype.str) for k, a in sorted(self.arrays.items()))
        return self.frame, "timestamp" in self.obs, shapes


@dataclass
class _Waiting:
    request: CheckedRequest
    answer: asyncio.Future
    timing: dict[str, float] = field(default_factory=dict)


class PolicyServer:
    """Serves one :class:`~dpflow_core.inference.Policy` over the protocol (see the module docstring).

    Args:
        policy: the loaded policy.
        metadata: from :func:`policy_metadata`.
        image_shapes: per image key ``(H, W, 3)`` trained on.
        max_age_s: oldest anchor frame accepted, seconds before ``now_s``.
        clock: the server's time in seconds (``time.time``) for stream requests without ``now_s``.
        batch_window_s: how long a batch waits for the other connected clients' requests.
        max_batch: most requests in one batch.
    """

    def __init__(self, policy, metadata: Mapping[str, Any], image_shapes: Mapping[str, Any],
                 max_age_s: float = MAX_AGE_S, clock: Callable[[], float] = time.time,
                 batch_window_s: float = ServeSettings.batch_window_s, max_batch: int = ServeSettings.max_batch):
        self.policy = policy
        self.metadata = dict(metadata)
        self.image_shapes = {k: tuple(int(n) for n in v) for k, v in image_shapes.items()}
        self.max_age_s = float(max_age_s)
        self.clock = clock
        self.batch_window_s = float(batch_window_s)
        self.max_batch = int(max_batch)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpflow-inference")
        self._waiting: deque[_Waiting] = deque()
        self._arrived = asyncio.Event()
        self._clients = 0
        self._requests = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ request handling
    def preprocess(self, request: Any) -> CheckedRequest:
        """The :class:`CheckedRequest` of a decoded request (streams aligned, every array checked).

        Raises:
            ObservationError: malformed; StaleObservationError: too old for its ``now_s``.
        """
        if not isinstance(request, Mapping):
            raise ObservationError(f"a request must be a map of observation keys, got {type(request).__name__}")
        known = {*self.metadata["observation"], *REQUEST_FIELDS}
        unknown = sorted(map(str, set(request) - known))
        if unknown:  # a misspelt "now" would otherwise be ignored and the request judged on the server's clock
            raise ObservationError(f"unknown request key{'s' if len(unknown) > 1 else ''} {unknown}: a request holds "
                                   f"the observation keys {sorted(self.metadata['observation'])} and {list(REQUEST_FIELDS)}")
        frame, seed = request.get("frame", "tcp"), request.get("noise_seed")
        if frame not in ("tcp", "dataset"):
            raise ObservationError(f"frame must be 'tcp' or 'dataset', got {frame!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ObservationError(f"noise_seed must be a non-negative integer, got {seed!r}")
        obs = self._observation(request)
        try:
            arrays, batched = self.policy.check_obs(obs)
        except ValueError as exc:  # predict_action's shape, dtype and key checks
            raise ObservationError(str(exc)) from exc
        return CheckedRequest(obs, arrays, batched, frame, None if seed is None else int(seed))

    def _observation(self, request: Mapping[str, Any]) -> dict[str, np.ndarray]:
        now = request.get("now_s")
        if now is not None and (not isinstance(now, (int, float, np.number)) or not math.isfinite(float(now))):
            raise ObservationError(f"now_s must be a finite number of seconds, got {now!r}")
        rgb_keys, lowdim_keys = stream_keys(self.policy.spec)
        kinds = {k: isinstance(request.get(k), Mapping) for k in rgb_keys + lowdim_keys if k in request}
        if any(kinds.values()):
            if not all(kinds.values()):
                raise ObservationError(
                    "a request sends either streams ({'timestamp', 'value'} per key) or aligned (To, ...) arrays, "
                    f"not both: streams {sorted(k for k, s in kinds.items() if s)}, "
                    f"arrays {sorted(k for k, s in kinds.items() if not s)}"
                )
            when = self.clock() if now is None else float(now)
            return align_observation(request, self.policy, when, self.max_age_s, self.image_shapes)
        obs = {k: request[k] for k in [*rgb_keys, *lowdim_keys, START_POSE_KEY, "timestamp"] if k in request}
        for key in rgb_keys:
            a = obs.get(key)
            if isinstance(a, np.ndarray) and a.ndim >= 3 and tuple(a.shape[-3:]) != self.image_shapes[key]:
                raise ObservationError(f"{key} frames are {tuple(a.shape[-3:])}, the policy was trained on {self.image_shapes[key]}")
        for key in lowdim_keys:
            want = self.metadata["observation"][key]["shape"][0]
            a = obs.get(key)
            if isinstance(a, np.ndarray) and want > 0 and (a.ndim not in (2, 3) or a.shape[-1] != want):
                raise ObservationError(f"{key} must be (To, {want}) or (B, To, {want}), got {a.shape}")
        if now is not None and "timestamp" in obs:
            anchor = float(np.max(np.asarray(obs["timestamp"], dtype=np.float64)[..., -1]))
            if float(now) - anchor > self.max_age_s:
                raise StaleObservationError(
                    f"the newest frame was captured at {anchor:.6f} s, {float(now) - anchor:.3f} s before now_s: "
                    f"older than the {self.max_age_s:g} s accepted"
                )
        return obs

    def infer(self, requests: Sequence[CheckedRequest]) -> list[dict[str, Any]]:
        """One ``predict_action`` call for ``requests`` of one :meth:`~CheckedRequest.stack_key`; answers in order.

        Several requests are stacked along a batch dimension, each with its own noise
        generator (:meth:`~dpflow_core.inference.Policy.predict_action`), so each answer
        equals the request's own in-process ``predict_action`` to float precision.
        """
        import torch

        device = next(self.policy.network.parameters()).device
        generators = [None if r.noise_seed is None else torch.Generator(device=device).manual_seed(r.noise_seed)
                      for r in requests]
        if len(requests) == 1:
            obs, generator = requests[0].obs, generators[0]
        else:
            obs = {k: np.concatenate([r.arrays[k] for r in requests]) for k in requests[0].arrays}
            if "timestamp" in requests[0].obs:
                obs["timestamp"] = np.stack([np.asarray(r.obs["timestamp"], dtype=np.float64) for r in requests])
            generator = generators
        try:
            with torch.no_grad():
                out = self.policy.predict_action(obs, generator=generator, frame=requests[0].frame)
        except ValueError as exc:
            raise ObservationError(str(exc)) from exc
        if len(requests) == 1:
            return [out]
        return [{k: v[i] for k, v in out.items()} for i in range(len(requests))]

    def _timed_infer(self, requests: Sequence[CheckedRequest]) -> tuple[list[dict[str, Any]], float, float]:
        start = time.perf_counter()
        answers = self.infer(requests)
        return answers, start, time.perf_counter()

    async def _serve_batches(self) -> None:
        """Forever: collect the waiting requests into a batch, infer it group by group, hand out the answers."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            deadline = loop.time() + self.batch_window_s
            while len(self._waiting) < min(self._clients, self.max_batch) and deadline > loop.time():
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
                except TimeoutError:
                    break
            batch = [self._waiting.popleft() for _ in range(min(len(self._waiting), self.max_batch))]
            try:
                await self._answer_batch(batch)
            except Exception as exc:  # a fault outside inference: this batch's requests get it, the next batch runs
                log.exception("a batch of %d requests failed", len(batch))
                for w in batch:
                    if not w.answer.done():
                        w.answer.set_exception(exc)

    async def _answer_batch(self, batch: Sequence[_Waiting]) -> None:
        """Infer ``batch`` group by group (one group per stack key) and hand each request its answer or error."""
        loop = asyncio.get_running_loop()
        groups: dict[Any, list[_Waiting]] = {}
        for i, w in enumerate(batch):
            if not w.answer.done():  # its client left
                groups.setdefault(w.request.stack_key() or ("alone", i), []).append(w)
        for group in groups.values():
            try:
                answers, start, end = await loop.run_in_executor(
                    self._worker, self._timed_infer, [w.request for w in group])
            except Exception as exc:  # handed to each request's handler, which answers it on its socket
                for w in group:
                    if not w.answer.done():
                        w.answer.set_exception(exc)
                continue
            if len(answers) != len(group):
                raise RuntimeError(f"inference gave {len(answers)} answers for a batch of {len(group)} requests")
            for w, answer in zip(group, answers):
                w.timing |= {"start": start, "end": end, "batch_size": len(group)}
                if not w.answer.done():
                    w.answer.set_result(answer)

    async def handle(self, websocket) -> None:
        """One connection: metadata, then request -> answer until the client leaves."""
        import websockets

        peer = websocket.remote_address
        log.info("client %s connected", peer)
        loop = asyncio.get_running_loop()
        self._clients += 1
        try:
            await websocket.send(pack(self.metadata))
            async for message in websocket:
                t0 = time.perf_counter()
                try:
                    request = unpack(message)
                    t1 = time.perf_counter()
                    checked = await asyncio.to_thread(self.preprocess, request)
                    t2 = time.perf_counter()
                    waiting = _Waiting(checked, loop.create_future())
                    self._waiting.append(waiting)
                    self._arrived.set()
                    answer = await waiting.answer
                    t3 = time.perf_counter()
                    timing = waiting.timing
                    answer = dict(answer) | {"n_action_steps": int(self.metadata["n_action_steps"]), "frame": checked.frame}
                    answer["server_timing"] = {
                        "decode_ms": (t1 - t0) * 1e3,
                        "preprocess_ms": (t2 - t1) * 1e3,
                        "queue_ms": (timing["start"] - t2) * 1e3,
                        "inference_ms": (timing["end"] - timing["start"]) * 1e3,
                        "batch_size": int(timing["batch_size"]),
                    }
                    t4 = time.perf_counter()
                    answer["server_timing"] |= {"postprocess_ms": (t4 - t3) * 1e3, "total_ms": (t4 - t0) * 1e3}
                    payload = pack(answer)  # its few microseconds fall in the client's network share
                except ObservationError as exc:
                    log.info("client %s: %s", peer, exc)
                    await websocket.send(f"error ({exc.code}): {exc}")
                    continue
                except Exception as exc:  # the server must outlive any one request
                    log.exception("client %s: request failed", peer)
                    await websocket.send(f"error (internal): {type(exc).__name__}: {exc}")
                    continue
                await websocket.send(payload)
                with self._lock:
                    self._requests += 1
        except websockets.ConnectionClosed:
            pass
        finally:
            self._clients -= 1
        log.info("client %s left", peer)

    @property
    def requests_served(self) -> int:
        """Answers sent so far (errors not counted)."""
        with self._lock:
            return self._requests

    async def run(self, host: str, port: int, ready: Callable[[str, int], None] | None = None,
                  stop: asyncio.Event | None = None) -> None:
        """Listen on ``host:port`` until ``stop`` is set (forever when None); ``ready(host, port)`` once bound.

        ``GET /healthz`` answers 200 (as openpi's server) without opening a websocket.
        """
        import websockets.asyncio.server as ws_server

        def health(connection, request):
            if request.path == "/healthz":
                return connection.respond(http.HTTPStatus.OK, "OK\n")
            return None

        async with ws_server.serve(self.handle, host, port, compression=None, max_size=None,
                                   process_request=health) as server:
            bound = server.sockets[0].getsockname()
            if ready is not None:
                ready(bound[0], int(bound[1]))
            batches = asyncio.create_task(self._serve_batches())
            stopped = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Future())
            try:
                await asyncio.wait({batches, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if batches.done():  # a server that can no longer infer must stop, not leave requests waiting
                    batches.result()
            finally:
                batches.cancel()
                stopped.cancel()
        self._worker.shutdown(wait=True)


def load_server(checkpoint: str | Path, settings: ServeSettings = ServeSettings()) -> PolicyServer:
    """Load ``checkpoint`` (:func:`~dpflow_core.inference.load_policy`) on ``settings.device``, hash it,
    and build its server with the settings' age limit and batching.

    Raises:
        RunError: the checkpoint is missing, unreadable or incomplete (see ``load_policy``).
    """
    from dpflow_core.files import sha256_file
    from dpflow_core.inference import load_policy
    from dpflow_core.train.checkpoint import load_checkpoint

    policy = load_policy(checkpoint, device=settings.device)
    shape_meta = load_checkpoint(checkpoint, require_complete=False)["shape_meta"]
    image_shapes = {k: tuple(v) for k, v in shape_meta["rgb"].items()}
    metadata = policy_metadata(policy, sha256_file(checkpoint), image_shapes, settings.max_age_s)
    return PolicyServer(policy, metadata, image_shapes, max_age_s=settings.max_age_s,
                        batch_window_s=settings.batch_window_s, max_batch=settings.max_batch)


def check_bindable(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go, so that a port in use is reported before the checkpoint loads.

    Raises:
        OSError: the address cannot be bound, naming ``host:port`` (errno as the system gave it).
    """
    import socket

    if not port:
        return  # the system picks a free one
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket
        try:
            probe.bind(address)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None


def serve(checkpoint: str | Path, settings: ServeSettings = ServeSettings(),
          ready: Callable[[str, int], None] | None = None) -> None:
    """Serve ``checkpoint`` with ``settings`` until interrupted (what ``dpflow serve`` runs).

    ``ready(host, port)`` is called once the socket is bound. A host other than
    loopback exposes the policy to the network without authentication: logged as a warning.

    Raises:
        RunError: the checkpoint cannot be loaded (see :func:`load_server`).
        OSError: the address cannot be bound (in use, not this machine's).
    """
    if not settings.loopback:
        log.warning("serving on %s: reachable from other machines, with no authentication", settings.host)
    import torch

    torch.set_num_threads(int(settings.threads))
    torch.backends.mkldnn.enabled = bool(settings.mkldnn)
    check_bindable(settings.host, settings.port)  # an address in use fails now, not after a long load
    # loading and hashing take tens of seconds on a busy CPU: say so before the silence
    log.info("loading %s on %s (the policy, then its SHA-256)", checkpoint, settings.device)
    server = load_server(checkpoint, settings)
    asyncio.run(server.run(settings.host, settings.port, ready=ready))
