"""Closed-loop rollouts in the world: a policy, and the baselines it must beat, on held-out initial states.

A rollout runs a policy as a robot would (DESIGN rule 14):

1. the world starts from the initial state of a held-out seed (:data:`~dpflow_core.sim.tasks.EVAL_SEED_BASE`
   and up, asserted disjoint from the recordings' seeds);
2. at each decision time ``t`` the policy receives, through ``predict_action``, the last ``n_obs_steps``
   wrist-camera frames (uint8 RGB at the size it was trained on, rendered at the recording's size and
   area-resized as conversion does), spaced ``obs_down_sample_steps`` camera ticks apart, each with its
   capture time: the newest frame is the last one captured at or before ``t - camera_obs_latency``.
   Poses (the camera's, in the episode's VIO frame) and gripper widths are read as training reads them:
   ``camera_obs_latency - robot_obs_latency`` (``- gripper_obs_latency``) seconds after each frame;
3. the predicted chunk is timed from the newest frame (action ``k`` at ``t_frame + k * action_dt_s``);
   actions whose time is already past ``t + action_latency_s`` are dropped (UMI's rule), the next
   ``n_action_steps`` are executed by the bounded-speed controller, moving its set-point linearly from one
   action to the next at their times; then the policy is asked again.

The simulated clock stands still while the network runs: latency is what the settings say, not what
this machine's CPU happens to take (that is reported separately as ``predict_s``).

Baselines, on the same initial states: ``oracle`` (the scripted demonstrator, which validates the world),
``replay`` (the motion of a training demonstration replayed open loop from the new start pose) and
``hold`` (stay at the start pose). Each writes ``rollouts_<name>.json``; the policy's is
``rollouts.json``. Success rates come with a Wilson 95 % interval (Wilson, JASA 1927).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import cv2
import numpy as np
from scipy.spatial.transform import Rotation

from dpflow_core.files import write_text_atomic
from dpflow_core.sim.demonstrator import plan
from dpflow_core.sim.record import SimRecordingSpec, camera_poses, set_state, vio_origin
from dpflow_core.sim.tasks import (
    EVAL_SEED_BASE,
    TIMEOUT_S,
    failure_mode,
    initial_state,
    new_world,
    placement,
    reset_world,
    success,
)
from dpflow_core.sim.world import CONTROL_HZ, TX_CAM_TCP, GripperWorld, mat_to_rotvec, pose_mat, rotvec_to_mat

from dpflow_core.sim.settings import BASELINES  # noqa: E402 (declared with the judge's settings)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a success rate ``successes / n`` (scipy's ``binomtest``); ``(0, 1)`` when
    ``n == 0``."""
    if n <= 0:
        return 0.0, 1.0
    from scipy.stats import binomtest

    ci = binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass(frozen=True)
class RolloutRecord:
    """One episode: its ``seed``, ``success``, ``failure_mode`` (None on success), ``time_to_success_s``
    (None on failure), ``duration_s`` simulated, ``decisions`` (policy calls), ``grasp_attempts``
    (``held`` or why a grasp failed), the ``latency`` settings applied (s), ``predict_s`` (mean wall
    time of one policy call on this machine), ``placement``, where the block ended against its target
    (:func:`~dpflow_core.sim.tasks.placement`: ``xy_m``, ``yaw_rad`` for ``stack``, ``on_target``; to 0.1 mm
    and 0.1 mrad), and ``n_action_steps``, the actions executed per decision (None for a baseline)."""

    seed: int
    success: bool
    failure_mode: str | None
    time_to_success_s: float | None
    duration_s: float
    decisions: int
    grasp_attempts: list[str]
    latency: dict[str, float]
    predict_s: float | None = None
    placement: dict[str, Any] | None = None
    n_action_steps: int | None = None


@dataclass(frozen=True)
class RolloutSummary:
    """Success of one predictor over its episodes: ``name``, ``n``, ``successes``, ``success_rate`` and
    its Wilson 95 % interval ``wilson_low`` / ``wilson_high``, ``failure_modes`` counted."""

    name: str
    n: int
    successes: int
    success_rate: float
    wilson_low: float
    wilson_high: float
    failure_modes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, records: Sequence[RolloutRecord]) -> "RolloutSummary":
        k = sum(r.success for r in records)
        lo, hi = wilson_interval(k, len(records))
        modes: dict[str, int] = {}
        for r in records:
            if r.failure_mode:
                modes[r.failure_mode] = modes.get(r.failure_mode, 0) + 1
        return cls(name, len(records), k, k / max(1, len(records)), lo, hi, modes)

    def line(self) -> str:
        return (f"{self.name}: {self.successes}/{self.n} = {100 * self.success_rate:.1f} % "
                f"(Wilson 95 % {100 * self.wilson_low:.1f}-{100 * self.wilson_high:.1f} %)")


def check_held_out(seeds: Sequence[int]) -> None:
    """Raise ValueError unless every seed lies in the held-out range (>= ``EVAL_SEED_BASE``), which no
    recording uses (:func:`~dpflow_core.sim.record.record_task` keeps its seeds below it)."""
    bad = [int(s) for s in seeds if int(s) < EVAL_SEED_BASE]
    if bad:
        raise ValueError(f"seeds {bad[:10]} lie in the training range (< {EVAL_SEED_BASE}): rollouts need held-out states")


def eval_seeds(episodes: int, seed: int = 0) -> list[int]:
    """The held-out initial-state seeds of a rollout run: ``EVAL_SEED_BASE + seed * 10_000 + k``."""
    if episodes < 1 or seed < 0:
        raise ValueError(f"episodes must be >= 1 and seed >= 0, got {episodes}, {seed}")
    return [EVAL_SEED_BASE + seed * 10_000 + k for k in range(episodes)]


class _Episode:
    """The state history of one rollout, to render past frames and read past poses."""

    def __init__(self, world: GripperWorld, task: str, seed: int):
        self.world, self.task = world, task
        reset_world(world, initial_state(task, seed))
        cam_pos, _ = world.camera_pose()
        self.origin = vio_origin(cam_pos, Rotation.from_rotvec(world.gripper.rotvec))
        self.inv_origin = np.linalg.inv(self.origin)
        self.t: list[float] = []
        self.rows: list[tuple] = []
        self.snap()

    def snap(self) -> None:
        w = self.world
        self.t.append(w.time_s)
        self.rows.append((w.gripper.pos.copy(), w.gripper.rotvec.copy(), w.gripper.opening,
                          [b.pos.copy() for b in w.blocks], [b.yaw for b in w.blocks]))

    def settled(self) -> bool:
        """Whether the gripper stands still (speed and finger motion below what the controller can resolve)."""
        if len(self.rows) < 2:
            return False
        (p1, r1, o1, *_), (p0, r0, o0, *_) = self.rows[-1], self.rows[-2]
        return (float(np.abs(p1 - p0).max()) < 1e-7 and float(np.abs(r1 - r0).max()) < 1e-7
                and abs(o1 - o0) < 1e-9 and float(np.abs(self.world.gripper.vel).max()) < 1e-6)

    def state_at(self, t: float):
        """The recorded state nearest at or before ``t`` (the controller's 10 ms grid)."""
        i = int(np.clip(np.searchsorted(self.t, t + 1e-9) - 1, 0, len(self.t) - 1))
        return self.rows[i]

    def vio_pose(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        pos, rv, *_ = self.state_at(t)
        cp, cr = camera_poses(pos[None], Rotation.from_rotvec(rv[None]))
        m = self.inv_origin @ pose_mat(cp[0], cr[0].as_rotvec())
        return m[:3, 3], Rotation.from_matrix(m[:3, :3]).as_rotvec()

    def tcp_target(self, cam_pos_vio: np.ndarray, cam_rotvec_vio: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A camera pose in the VIO frame -> the TCP target in the world."""
        m = self.origin @ pose_mat(cam_pos_vio, cam_rotvec_vio) @ TX_CAM_TCP
        return m[:3, 3], Rotation.from_matrix(m[:3, :3]).as_rotvec()


def _run_targets(ep: _Episode, times: np.ndarray, pos: np.ndarray, rotvec: np.ndarray, opening: np.ndarray,
                 until: float, timeout: float, on_step: Callable[[GripperWorld], None] | None = None) -> float | None:
    """Track the timed targets (linear set-point between them) until ``until``; the success time or None.
    ``on_step(world)`` is called after every controller step."""
    w, dt = ep.world, 1.0 / CONTROL_HZ
    rots = Rotation.from_rotvec(rotvec)
    mats = rots.as_matrix()
    rel = (rots[:-1].inv() * rots[1:]).as_rotvec() if len(times) > 1 else np.zeros((0, 3))
    while w.time_s < min(until, timeout) - 1e-9:
        t = w.time_s + dt
        k = int(np.clip(np.searchsorted(times, t) - 1, 0, len(times) - 1))
        if k + 1 < len(times) and times[k] <= t:
            a = (t - times[k]) / (times[k + 1] - times[k])
            p = pos[k] + a * (pos[k + 1] - pos[k])
            r = mat_to_rotvec(mats[k] @ rotvec_to_mat(a * rel[k]))
            o = opening[k] + a * (opening[k + 1] - opening[k])
        else:
            j = k + 1 if times[k] < t and k + 1 < len(times) else k
            p, r, o = pos[j], rotvec[j], opening[j]
        if k == len(times) - 1 and t > times[-1] and ep.settled():
            # the last target is reached and nothing moves: the world cannot change any more
            w.time_s = min(until, timeout)
            return None
        w.step(p, r, o, dt)
        ep.snap()
        if on_step is not None:
            on_step(w)
        if success(w, ep.task):
            return w.time_s
    return None


def _record(seed, ep, t_ok, decisions, latency, predict_s=None, n_action_steps=None) -> RolloutRecord:
    return RolloutRecord(
        int(seed), t_ok is not None, None if t_ok is not None else failure_mode(ep.world, ep.task),
        None if t_ok is None else round(float(t_ok), 3), round(float(ep.world.time_s), 3), decisions,
        list(ep.world.grasp_attempts), latency, predict_s,
        {k: round(v, 4) if isinstance(v, float) else v for k, v in placement(ep.world, ep.task).items()},
        n_action_steps,
    )


def rollout_baseline(name: str, task: str, seeds: Sequence[int], train_seed: int = 0) -> list[RolloutRecord]:
    """Roll out a baseline (one of :data:`BASELINES`) on ``seeds``; ``train_seed``: the demonstration
    ``replay`` replays."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}: one of {list(BASELINES)}")
    world = new_world(task, 16, 16)
    demo = plan(initial_state(task, train_seed)) if name == "replay" else None
    out = []
    for seed in seeds:
        ep = _Episode(world, task, seed)
        state = initial_state(task, seed)
        if name == "oracle":
            p = plan(state)
            times, pos, rv, op = p.t_s, p.pos, p.rotvec, p.opening
        elif name == "replay":
            # the demonstration's motion relative to its own start, from this episode's start
            start_demo = pose_mat(demo.pos[0], demo.rotvec[0])
            here = pose_mat(world.gripper.pos, world.gripper.rotvec)
            rel = np.linalg.inv(start_demo) @ np.stack([pose_mat(p, r) for p, r in zip(demo.pos, demo.rotvec)])
            m = here @ rel
            times, pos, op = demo.t_s, m[:, :3, 3], demo.opening
            rv = Rotation.from_matrix(m[:, :3, :3]).as_rotvec()
        else:
            times = np.array([0.0, 1.0])
            pos = np.repeat(world.gripper.pos[None], 2, 0)
            rv, op = np.repeat(world.gripper.rotvec[None], 2, 0), np.full(2, world.gripper.opening)
        t_ok = _run_targets(ep, times, pos, rv, op, TIMEOUT_S[task], TIMEOUT_S[task])
        out.append(_record(seed, ep, t_ok, 0, {}))
    world.close()
    return out


@dataclass(frozen=True)
class PolicyView:
    """What a rollout needs to know of a policy, read from a local checkpoint or a server's metadata:
    ``rgb_keys``, ``lowdim_keys``, ``n_obs_steps``, ``obs_dt_s`` (s between observation frames),
    ``n_action_steps``, ``image_hw`` (H, W of the frames it was trained on), the observation
    ``latency`` (s: ``camera_obs_s``, ``robot_obs_s``, ``gripper_obs_s``), and ``remote`` (served)."""

    rgb_keys: tuple[str, ...]
    lowdim_keys: tuple[str, ...]
    n_obs_steps: int
    obs_dt_s: float
    n_action_steps: int
    image_hw: tuple[int, int] | None
    latency: dict[str, float]
    remote: bool = False

    @classmethod
    def of(cls, policy) -> "PolicyView":
        meta = getattr(policy, "metadata", None)
        if isinstance(meta, dict) and "observation" in meta:  # a RemotePolicy: its server's metadata
            obs = meta["observation"]
            rgb = tuple(k for k, v in obs.items() if v.get("dtype") == "uint8")
            low = tuple(k for k, v in obs.items() if v.get("dtype") != "uint8")
            lat = meta.get("latency_s", {})
            return cls(rgb, low, int(meta["n_obs_steps"]), float(meta["obs_dt_s"]), int(meta["n_action_steps"]),
                       tuple(obs[rgb[0]]["shape"][:2]) if rgb else None,
                       {f"{k}_obs_s": float(lat.get(k, 0.0)) for k in ("camera", "robot", "gripper")}, True)
        spec, task = policy.spec, policy.cfg.task
        rgb = tuple(spec.rgb_keys)
        hw = None
        if rgb:
            hw = tuple(int(v) for v in getattr(policy, "image_hw", None)
                       or policy.network.obs_encoder.augment[rgb[0]].image_hw)
        return cls(rgb, tuple(spec.lowdim_keys), int(policy.n_obs_steps),
                   spec.obs_down_sample_steps / policy.frequency_hz, int(policy.cfg.n_action_steps), hw,
                   {"camera_obs_s": float(task.camera_obs_latency), "robot_obs_s": float(task.robot_obs_latency),
                    "gripper_obs_s": float(task.gripper_obs_latency)})


def _observe(ep: _Episode, view: PolicyView, lat: dict[str, float], tick: float,
             frames: dict[int, np.ndarray]) -> dict[str, Any]:
    """The observation of ``ep`` at its current time, as a robot's sensors give it (module docstring)."""
    world, now = ep.world, ep.world.time_s
    newest = math.floor((now - lat["camera_obs_s"]) / tick + 1e-9)
    ticks = [max(0, newest - round(k * view.obs_dt_s / tick)) for k in range(view.n_obs_steps - 1, -1, -1)]
    t_frames = np.array([j * tick for j in ticks])
    obs: dict[str, Any] = {"timestamp": t_frames}
    if view.rgb_keys:
        hw = view.image_hw
        live = (world.gripper.pos.copy(), world.gripper.rotvec.copy(), world.gripper.opening,
                [(b.pos.copy(), b.yaw, b.held, b.grasp_in_tcp) for b in world.blocks])
        for j in ticks:
            if j not in frames:  # render the past state the frame was captured in
                g_pos, g_rv, g_op, b_pos, b_yaw = ep.state_at(j * tick)
                set_state(world, g_pos, Rotation.from_rotvec(g_rv), g_op, b_pos, b_yaw)
                frames[j] = cv2.resize(world.render(), (hw[1], hw[0]), interpolation=cv2.INTER_AREA)
        obs[view.rgb_keys[0]] = np.stack([frames[j] for j in ticks])
        world.gripper.pos, world.gripper.rotvec, world.gripper.opening = live[0], live[1], live[2]
        for b, (p, y, h, g) in zip(world.blocks, live[3]):
            b.pos, b.yaw, b.held, b.grasp_in_tcp = p, y, h, g
    shift_pose = lat["camera_obs_s"] - lat["robot_obs_s"]
    shift_grip = lat["camera_obs_s"] - lat["gripper_obs_s"]
    poses = [ep.vio_pose(min(t + shift_pose, now)) for t in t_frames]
    obs["robot0_eef_pos"] = np.stack([p for p, _ in poses])
    obs["robot0_eef_rot_axis_angle"] = np.stack([r for _, r in poses])
    obs["robot0_gripper_width"] = np.array([[ep.state_at(min(t + shift_grip, now))[2]] for t in t_frames])
    if any(k.endswith("wrt_start") or k == "robot0_demo_start_pose" for k in view.lowdim_keys):
        p0, r0 = ep.vio_pose(0.0)
        obs["robot0_demo_start_pose"] = np.concatenate([p0, r0])
    return obs


def _execute(ep: _Episode, act: dict[str, np.ndarray], lat: dict[str, float], n_exec: int, timeout: float,
             hook: Callable[[GripperWorld], None] | None, strict: bool = False) -> float | None:
    """Run one predicted chunk (one episode's slice): drop the past actions, execute the next ``n_exec``.
    ``strict`` (an ``n_action_steps`` asked for): refuse a chunk with fewer than ``n_exec`` actions ahead after
    the episode's first decision (at t = 0 the frame is not yet late), rather than execute fewer than recorded."""
    world, now = ep.world, ep.world.time_s
    times = np.asarray(act["timestamp"], float)
    ahead = np.flatnonzero(times >= now + lat["action_s"] - 1e-9)
    if strict and now > 0 and len(ahead) < n_exec:
        raise ValueError(f"n_action_steps {n_exec}: only {len(ahead)} of the {len(times)} predicted actions lie ahead "
                         "once the observation and action latencies have passed; execute at most that many")
    keep = ahead[:n_exec]
    if len(keep) == 0:
        keep = np.array([len(times) - 1])
    targets = [ep.tcp_target(p, r) for p, r in zip(act["robot0_eef_pos"][keep], act["robot0_eef_rot_axis_angle"][keep])]
    tt = np.concatenate([[now], times[keep]])
    tp = np.stack([world.gripper.pos] + [p for p, _ in targets])
    tr = np.stack([world.gripper.rotvec] + [r for _, r in targets])
    to = np.concatenate([[world.gripper.opening], act["robot0_gripper_width"][keep, 0]])
    return _run_targets(ep, tt, tp, tr, to, max(tt[-1], now + 1.0 / CONTROL_HZ), timeout, hook)


def rollout_policy(policy, task: str, seeds: Sequence[int], recording: SimRecordingSpec = SimRecordingSpec(),
                   action_latency_s: float = 0.0, n_action_steps: int | None = None,
                   video: Callable[[int, GripperWorld], None] | None = None, video_episodes: int = 0,
                   rng_seed: int = 0, batch: int = 16) -> list[RolloutRecord]:
    """Closed-loop rollouts of ``policy`` (a :class:`~dpflow_core.inference.Policy`, a
    :class:`~dpflow_core.serving.client.RemotePolicy`, or anything :class:`PolicyView` can read) on the
    initial states of ``seeds`` (module docstring). ``recording``: the camera the policy's dataset was
    recorded with (rate, size). ``video(episode_index, world)`` is called after every controller step of
    the first ``video_episodes`` episodes (to film them).

    Up to ``batch`` episodes run in lockstep (they decide at the same simulated times), and their
    observations go to one batched ``predict_action`` call: each episode still sees only its own world.
    ``n_action_steps``: the actions executed of each chunk (None: the policy's own); when given, a chunk with
    fewer actions ahead once the latencies have passed is refused rather than executed short (ValueError).
    A served policy gets that batch as one request with the same noise seed, so a rollout through
    ``dpflow serve`` is the in-process rollout, chunk for chunk.
    """
    import torch

    view = PolicyView.of(policy)
    lat = view.latency | {"action_s": float(action_latency_s)}
    n_exec = int(view.n_action_steps if n_action_steps is None else n_action_steps)
    if n_exec < 1:
        raise ValueError(f"n_action_steps must be >= 1, got {n_action_steps}")
    tick = 1.0 / recording.fps
    timeout = TIMEOUT_S[task]
    size = max(1, int(batch))
    worlds = [new_world(task, recording.width, recording.height) for _ in range(min(size, len(seeds)))]
    rng = np.random.default_rng(int(rng_seed))
    out: list[RolloutRecord] = []
    for first in range(0, len(seeds), size):
        group = list(enumerate(seeds))[first:first + size]
        eps = [_Episode(worlds[k], task, seed) for k, (_, seed) in enumerate(group)]
        frames: list[dict[int, np.ndarray]] = [{} for _ in group]
        t_ok: list[float | None] = [None] * len(group)
        decisions, spent = [0] * len(group), [0.0] * len(group)
        active = [k for k in range(len(group)) if eps[k].world.time_s < timeout - 1e-9]
        while active:
            obs = [_observe(eps[k], view, lat, tick, frames[k]) for k in active]
            started = time.perf_counter()
            batched = {key: np.stack([o[key] for o in obs]) for key in obs[0]}
            noise_seed = int(rng.integers(0, 2**31 - 1))
            if view.remote:  # the server seeds torch.Generator().manual_seed(noise_seed) as below
                out_b = policy.predict_action(batched, frame="dataset", noise_seed=noise_seed)
            else:
                out_b = policy.predict_action(batched, generator=torch.Generator().manual_seed(noise_seed), frame="dataset")
            acts = [{key: v[i] for key, v in out_b.items()} for i in range(len(obs))]
            if n_exec > len(acts[0]["timestamp"]):
                raise ValueError(f"n_action_steps {n_exec} exceeds the {len(acts[0]['timestamp'])} actions the policy "
                                 "predicts per chunk (its horizon)")
            took = (time.perf_counter() - started) / len(active)
            for k, act in zip(active, acts):
                index = group[k][0]
                spent[k] += took
                decisions[k] += 1
                hook = (lambda w, i=index: video(i, w)) if video is not None and index < video_episodes else None
                t_ok[k] = _execute(eps[k], act, lat, n_exec, timeout, hook, strict=n_action_steps is not None)
            active = [k for k in active if t_ok[k] is None and eps[k].world.time_s < timeout - 1e-9]
        out.extend(_record(seed, eps[k], t_ok[k], decisions[k], lat, round(spent[k] / max(1, decisions[k]), 5), n_exec)
                   for k, (_, seed) in enumerate(group))
    for w in worlds:
        w.close()
    return out


def write_rollouts(out_dir: str | Path, name: str, records: Sequence[RolloutRecord]) -> Path:
    """``rollouts.json`` (``name == "policy"``) or ``rollouts_<name>.json``: one record per episode."""
    path = Path(out_dir) / ("rollouts.json" if name == "policy" else f"rollouts_{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps([asdict(r) for r in records], indent=1))
    return path
