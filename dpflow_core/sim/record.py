"""Scripted demonstrations written as Matrix Studio recordings.

Each episode: the world is reset to the task's initial state for the episode's
seed, the demonstrator's track is executed by the controller at
:data:`~dpflow_core.sim.world.CONTROL_HZ`, and every stream is sampled from that
state history at its own rate and capture times (with jitter), as the device
would record it:

- the wrist camera (H.264, one access unit per message) at ``fps``, rendered
  with MuJoCo at the state of each frame's capture time;
- the VIO pose of the camera's optical centre at the camera's times, in a VIO
  frame whose origin is the camera's starting position, ``Z`` up and ``X`` its
  starting heading (so the pose track says nothing about where the objects are);
- the gripper encoder (finger opening, m) at ``gripper_hz``;
- the IMU (gyro rad/s and specific force m/s^2, in the camera frame) at ``imu_hz``.

``camera_latency_s`` stamps every camera frame that much later than its
capture (a camera whose pipeline is late against the pose clock), so that
conversion pairs each frame with a pose that many seconds newer; 0 writes true
capture times.

The task folder also holds ``sim_task.json``: the task, the world's version and
the seed of every episode. dpflow reads it to know that the task comes from
the world (its evaluation then rolls the policy out) and to keep rollout seeds
disjoint from the training seeds.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
from scipy.spatial.transform import Rotation, Slerp

from dpflow_core.files import write_text_atomic
from dpflow_core.recordings.samples import EpisodeStreams, SampleSpec, encode_h264, write_recording
from dpflow_core.recordings.topics import DAS_DEFAULT
from dpflow_core.sim.demonstrator import Plan, plan
from dpflow_core.sim.faults import FaultSpec, inject_faults, write_truth
from dpflow_core.sim.tasks import TASKS, InitialState, check_task, initial_state, new_world, reset_world
from dpflow_core.sim.world import CONTROL_HZ, TX_CAM_TCP, GripperWorld, pose_mat

#: The world's version, recorded in ``sim_task.json`` and in each rollout record.
WORLD_VERSION = "dpflow-sim-1"
SIM_TASK_FILE = "sim_task.json"
_EPOCH_NS = 1_780_000_000_000_000_000
GRAVITY = np.array([0.0, 0.0, 9.81])


@dataclass(frozen=True)
class SimRecordingSpec:
    """How the world records: ``fps`` camera and VIO rate (Hz), ``width`` x ``height`` camera pixels,
    ``gripper_hz``, ``imu_hz`` (Hz), ``gop_size`` frames between key frames, ``camera_latency_s`` the
    camera stamp's lag behind capture (s)."""

    fps: float = 30.0
    width: int = 128
    height: int = 128
    gripper_hz: float = 50.0
    imu_hz: float = 200.0
    gop_size: int = 30
    camera_latency_s: float = 0.0


@dataclass(frozen=True)
class History:
    """The world's state at the controller's rate: ``t_s`` (K,), TCP ``pos`` (K, 3) m, ``rotvec`` (K, 3)
    rad, ``opening`` (K,) m, ``block_pos`` (K, B, 3) m and ``block_yaw`` (K, B) rad (unwrapped)."""

    t_s: np.ndarray
    pos: np.ndarray
    rotvec: np.ndarray
    opening: np.ndarray
    block_pos: np.ndarray
    block_yaw: np.ndarray

    def at(self, t: np.ndarray) -> tuple[np.ndarray, Rotation, np.ndarray, np.ndarray, np.ndarray]:
        """State at times ``t`` (s), interpolated (positions linearly, the rotation by slerp)."""
        t = np.clip(np.asarray(t, float), self.t_s[0], self.t_s[-1])
        lerp = lambda a: np.stack([np.interp(t, self.t_s, c) for c in a.reshape(len(a), -1).T], -1)  # noqa: E731
        rot = Slerp(self.t_s, Rotation.from_rotvec(self.rotvec))(t)
        nb = self.block_pos.shape[1]
        return lerp(self.pos), rot, lerp(self.opening[:, None])[:, 0], lerp(self.block_pos).reshape(-1, nb, 3), lerp(self.block_yaw)


def demonstrate(world: GripperWorld, state: InitialState, tail_s: float = 0.5, track: Plan | None = None) -> History:
    """Execute the demonstrator's track for ``state`` (or ``track``) in ``world``; the state history
    (``tail_s`` of holding still appended)."""
    reset_world(world, state)
    p = plan(state) if track is None else track
    n_tail = int(round(tail_s * CONTROL_HZ))
    rows = []

    def snap():
        g = world.gripper
        rows.append((world.time_s, g.pos.copy(), g.rotvec.copy(), g.opening,
                     np.array([b.pos for b in world.blocks]), np.array([b.yaw for b in world.blocks])))

    snap()
    dt = 1.0 / CONTROL_HZ
    for i in range(len(p.t_s) + n_tail):
        k = min(i, len(p.t_s) - 1)
        world.step(p.pos[k], p.rotvec[k], p.opening[k], dt)
        snap()
    t, pos, rv, op, bp, by = (np.array(c) for c in zip(*rows))
    return History(t, pos, rv, op, bp, np.unwrap(by, axis=0))


def set_state(world: GripperWorld, pos, rot: Rotation, opening: float, block_pos, block_yaw) -> None:
    """Pose every body of ``world`` (for rendering a past state)."""
    world.gripper.pos, world.gripper.rotvec, world.gripper.opening = np.asarray(pos), rot.as_rotvec(), float(opening)
    for b, bp, by in zip(world.blocks, block_pos, block_yaw):
        b.pos, b.yaw = np.asarray(bp), float(by)


def vio_origin(world_cam_pos: np.ndarray, world_cam_rot: Rotation) -> np.ndarray:
    """(4, 4) the VIO frame in the world: at the camera's starting position, ``Z`` up, ``X`` its heading."""
    x = world_cam_rot.apply([1.0, 0.0, 0.0])
    return pose_mat(world_cam_pos, [0.0, 0.0, float(np.arctan2(x[1], x[0]))])


def camera_poses(pos: np.ndarray, rot: Rotation) -> tuple[np.ndarray, Rotation]:
    """World poses of the camera for TCP poses ``pos`` (N, 3) m, ``rot`` (N rotations)."""
    m = np.zeros((len(pos), 4, 4))
    m[:, :3, :3] = rot.as_matrix()
    m[:, :3, 3] = pos
    m[:, 3, 3] = 1
    cam = m @ np.linalg.inv(TX_CAM_TCP)
    return cam[:, :3, 3], Rotation.from_matrix(cam[:, :3, :3])


def imu_readings(history: History, t: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Gyro (N, 3) rad/s and specific force (N, 3) m/s^2 in the camera frame at times ``t`` (central
    differences of the state history, plus sensor noise)."""
    h = 1.0 / CONTROL_HZ
    p0, r0, *_ = history.at(t - h)
    p1, r1, *_ = history.at(t)
    p2, r2, *_ = history.at(t + h)
    c0, _ = camera_poses(p0, r0)
    c1, rc = camera_poses(p1, r1)
    c2, _ = camera_poses(p2, r2)
    gyro = (r0.inv() * r2).as_rotvec() / (2 * h)  # body rates: the camera shares the gripper's axes
    acc = (c2 - 2 * c1 + c0) / h**2
    force = rc.inv().apply(acc + GRAVITY)
    return gyro + rng.normal(0, 0.003, gyro.shape), force + rng.normal(0, 0.03, force.shape)


def record_episode(task_dir: Path, stem: str, state: InitialState, spec: SimRecordingSpec,
                   world: GripperWorld | None = None, track: Plan | None = None) -> dict:
    """Record the demonstration of ``state`` as ``<STEM>.mcap``, ``<STEM>_vio.mcap`` and
    ``<STEM>_vio.json`` in ``task_dir``; returns the episode's entry of ``sim_task.json``."""
    world = world or new_world(state.task, spec.width, spec.height)
    rng = np.random.default_rng([0xCA11, state.seed])
    hist = demonstrate(world, state, track=track)
    end = float(hist.t_s[-1])
    n = int(end * spec.fps)
    t_cam = np.maximum.accumulate(np.arange(n) / spec.fps + rng.normal(0, 3e-4, n)).clip(0, end)
    pos, rot, opening, bpos, byaw = hist.at(t_cam)
    frames = []
    for i in range(n):
        set_state(world, pos[i], rot[i], opening[i], bpos[i], byaw[i])
        frames.append(cv2.cvtColor(world.render(), cv2.COLOR_RGB2BGR))
    units = [u for u, _key in encode_h264(frames, spec.fps, spec.gop_size)]
    cam_pos, cam_rot = camera_poses(pos, rot)
    origin = np.linalg.inv(vio_origin(cam_pos[0], cam_rot[0]))
    vio_pos = cam_pos @ origin[:3, :3].T + origin[:3, 3]
    vio_rot = Rotation.from_matrix(origin[:3, :3]) * cam_rot

    t0 = _EPOCH_NS + state.seed * 60_000_000_000
    ns = lambda t: (t0 + np.round(np.asarray(t) * 1e9)).astype(np.int64)  # noqa: E731
    t_grip = np.maximum.accumulate(np.arange(int(end * spec.gripper_hz)) / spec.gripper_hz
                                   + rng.normal(0, 2e-4, int(end * spec.gripper_hz))).clip(0, end)
    grip = hist.at(t_grip)[2] + rng.normal(0, 2e-4, len(t_grip))
    t_imu = np.arange(int(end * spec.imu_hz)) / spec.imu_hz
    sample = SampleSpec(seconds=end, fps=spec.fps, width=spec.width, height=spec.height, gop_size=spec.gop_size,
                        gripper_hz=spec.gripper_hz, imu_hz=spec.imu_hz)
    write_recording(task_dir, stem, rng, sample, DAS_DEFAULT, EpisodeStreams(
        camera_ts_ns=ns(t_cam + spec.camera_latency_s), access_units=units,
        gripper_ts_ns=ns(t_grip), gripper_width_m=grip, imu_ts_ns=ns(t_imu), imu=imu_readings(hist, t_imu, rng),
        pose_ts_ns=ns(t_cam), position_m=vio_pos, quat_xyzw=vio_rot.as_quat(), pose_valid=np.ones(n, bool),
    ))
    return {"stem": stem, "seed": state.seed, "seconds": round(end, 3), "frames": n}


def record_task(out_dir: str | Path, task: str, episodes: int, seed: int = 0,
                spec: SimRecordingSpec = SimRecordingSpec(),
                progress: Callable[[int, int], None] | None = None, faults: FaultSpec | None = None) -> Path:
    """Write a Matrix Studio task folder ``out_dir/<task>/`` of ``episodes`` demonstrations of ``task``.

    Episode ``k`` starts from the initial state of seed ``seed * 1000 + k`` (so ``seed`` < 1000 and
    ``episodes`` <= 1000 keep every training seed below the rollouts' ``EVAL_SEED_BASE``). Also writes
    ``vio_result.json`` and ``sim_task.json``. ``faults``: make that share of the demonstrations bad
    (:mod:`~dpflow_core.sim.faults`; their ground truth in ``curation_truth.json``). Returns the task folder.

    Raises:
        FileExistsError: the folder already holds recordings.
        ValueError: an unknown task, or seeds that would reach the held-out range.
    """
    check_task(task)
    if not 0 <= seed < 1000 or not 1 <= episodes <= 1000:
        raise ValueError(f"seed must be in [0, 1000) and episodes in [1, 1000], got seed {seed}, episodes {episodes}")
    task_dir = Path(out_dir) / task
    if task_dir.exists() and any(task_dir.glob("*.mcap")):
        raise FileExistsError(f"{task_dir}: already holds recordings; choose an empty folder")
    task_dir.mkdir(parents=True, exist_ok=True)
    world = new_world(task, spec.width, spec.height)
    entries = []
    try:
        jobs = [(f"{task}_{k:04d}", initial_state(task, seed * 1000 + k), None) for k in range(episodes)]
        jobs, truth = inject_faults(jobs, faults) if faults is not None else (jobs, None)
        for k, (stem, state, track) in enumerate(jobs):
            entries.append(record_episode(task_dir, stem, state, spec, world, track))
            if progress is not None:
                progress(k + 1, episodes)
    finally:
        world.close()
    summary = {"task_name": task, "success_mcap_files": [f"{e['stem']}_vio.mcap" for e in entries], "failed_mcap_files": []}
    write_text_atomic(task_dir / "vio_result.json", json.dumps(summary, indent=2))
    meta = {"world": WORLD_VERSION, "task": task, "recording": asdict(spec), "episodes": entries}
    write_text_atomic(task_dir / SIM_TASK_FILE, json.dumps(meta, indent=2))
    if truth is not None:
        write_truth(task_dir, truth)
    return task_dir


def read_sim_task(task_dir: str | Path) -> dict | None:
    """``sim_task.json`` of a task folder (None when the task does not come from the world).

    Raises:
        ValueError: the file exists but is not the world's (names the file and the reason).
    """
    path = Path(task_dir) / SIM_TASK_FILE
    if not path.exists():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("task") not in TASKS or not isinstance(meta.get("episodes"), list):
        raise ValueError(f"{path}: not a dpflow world task file (needs 'task' in {list(TASKS)} and 'episodes')")
    return meta
