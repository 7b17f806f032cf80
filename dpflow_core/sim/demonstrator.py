"""The scripted demonstrator: how a person with a handheld gripper does each task.

:func:`plan` turns an initial state into a timed TCP target track at
:data:`~dpflow_core.sim.world.CONTROL_HZ`. Waypoints (hover over the block,
descend, close, lift, carry, lower, open, retreat) are joined by minimum-jerk
segments (Flash & Hogan, J. Neurosci. 1985: the speed profile of human
reaching), and a person's habits are layered on: a speed that varies per
episode and per segment, a small tremor (two sinusoids per axis, about 1 mm and
0.5 degrees), short pauses, an approach that bends in from a varied side, and
now and then a corrective move (it lowers a little off the block, stops, and
re-centres before descending).

The strategy itself is consistent, so a policy can learn it: the gripper turns
by the smaller angle that puts its x axis along the block's long axis, it
grasps at the block's centre, and it lets go just above the surface.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.spatial.transform import Rotation

from dpflow_core.sim.tasks import InitialState
from dpflow_core.sim.world import BLOCK_HALF, CONTROL_HZ, MAX_OPENING_M, wrap_half_turn

#: Probability that an episode has a corrective move before the grasp.
CORRECTION_P = 0.15


@dataclass(frozen=True)
class Plan:
    """A TCP target track: ``t_s`` (N,) s from the start, ``pos`` (N, 3) m, ``rotvec`` (N, 3) rad and
    ``opening`` (N,) m, at :data:`~dpflow_core.sim.world.CONTROL_HZ`; ``corrective`` tells whether the
    episode has a corrective move."""

    t_s: np.ndarray
    pos: np.ndarray
    rotvec: np.ndarray
    opening: np.ndarray
    corrective: bool

    @property
    def duration_s(self) -> float:
        return float(self.t_s[-1])


def _min_jerk(tau: np.ndarray) -> np.ndarray:
    return 10 * tau**3 - 15 * tau**4 + 6 * tau**5


def plan(state: InitialState, seed: int | None = None) -> Plan:
    """The demonstrator's target track for ``state`` (deterministic for ``(state, seed)``; ``seed``
    defaults to the state's own)."""
    rng = np.random.default_rng([0x5EED, int(state.seed if seed is None else seed)])
    speed = rng.uniform(0.75, 1.3)
    (bxy, byaw) = state.blocks[0]
    bxy = np.asarray(bxy)
    yaw = state.gripper_yaw
    grasp_yaw = yaw + wrap_half_turn(byaw - yaw)
    grasp_z = BLOCK_HALF[2] + rng.uniform(-0.004, 0.003)
    hover_z = rng.uniform(0.07, 0.10)
    start = np.asarray(state.gripper_pos)
    # waypoints: (position, yaw, opening, pause after (s))
    way: list[tuple[np.ndarray, float, float, float]] = [(start, yaw, MAX_OPENING_M, rng.uniform(0.1, 0.4))]

    def pause(p: float = 0.35) -> float:
        return float(rng.uniform(0.1, 0.35)) if rng.random() < p else 0.0

    mid = (start[:2] + bxy) / 2
    side = np.array([-(bxy - start[:2])[1], (bxy - start[:2])[0]])
    side = side / (np.linalg.norm(side) + 1e-9) * rng.uniform(-0.04, 0.04)
    way.append((np.array([*(mid + side), (start[2] + hover_z) / 2]), (yaw + grasp_yaw) / 2, MAX_OPENING_M, 0.0))
    way.append((np.array([*bxy, hover_z]), grasp_yaw, MAX_OPENING_M, pause()))
    corrective = rng.random() < CORRECTION_P
    if corrective:
        off = rng.uniform(0.02, 0.03) * np.array([np.cos(a := rng.uniform(-np.pi, np.pi)), np.sin(a)])
        way.append((np.array([*(bxy + off), 0.04]), grasp_yaw, MAX_OPENING_M, rng.uniform(0.2, 0.4)))
    way.append((np.array([*bxy, 0.04]), grasp_yaw, MAX_OPENING_M, pause(0.5)))
    way.append((np.array([*bxy, grasp_z]), grasp_yaw, MAX_OPENING_M, rng.uniform(0.15, 0.3)))
    way.append((np.array([*bxy, grasp_z]), grasp_yaw, 0.0, rng.uniform(0.35, 0.5)))  # close and settle
    lift_z = rng.uniform(0.08, 0.11)
    way.append((np.array([*bxy, lift_z]), grasp_yaw, 0.0, pause()))
    if state.task == "stack":
        (txy, tyaw) = state.blocks[1]
        place_yaw = grasp_yaw + wrap_half_turn(tyaw - byaw)
        surface = 2 * BLOCK_HALF[2]
    else:
        txy = state.pad_xy
        place_yaw = grasp_yaw
        surface = 0.0
    txy = np.asarray(txy)
    place_z = surface + (grasp_z - BLOCK_HALF[2]) + BLOCK_HALF[2] + rng.uniform(0.002, 0.006)
    way.append((np.array([*txy, max(lift_z, surface + 0.07)]), place_yaw, 0.0, pause()))
    way.append((np.array([*txy, place_z + 0.03]), place_yaw, 0.0, 0.0))
    way.append((np.array([*txy, place_z]), place_yaw, 0.0, rng.uniform(0.1, 0.25)))
    way.append((np.array([*txy, place_z]), place_yaw, MAX_OPENING_M, rng.uniform(0.2, 0.35)))  # open
    way.append((np.array([*txy, rng.uniform(0.12, 0.16)]), place_yaw, MAX_OPENING_M, rng.uniform(0.3, 0.5)))

    ts, pos, yaws, opening = [np.zeros(1)], [way[0][0][None]], [np.array([way[0][1]])], [np.array([way[0][2]])]
    t = 0.0
    dt = 1.0 / CONTROL_HZ
    segments = [(way[0], way[0], way[0][3])] + [
        (a, b, 0.0) for a, b in zip(way[:-1], way[1:])
    ]
    for a, b, hold in segments:
        if a is not b:
            dist = float(np.linalg.norm(b[0] - a[0]))
            turn = abs(b[1] - a[1])
            dur = max(0.3, dist / (0.13 * speed * rng.uniform(0.85, 1.15)) + turn / (1.4 * speed))
            if b[2] != a[2]:
                dur = max(dur, 0.3)
            n = max(1, int(round(dur / dt)))
            s = _min_jerk(np.arange(1, n + 1) / n)
            ts.append(t + np.arange(1, n + 1) * dt)
            pos.append(a[0] + s[:, None] * (b[0] - a[0]))
            yaws.append(a[1] + s * (b[1] - a[1]))
            opening.append(a[2] + s * (b[2] - a[2]))
            t += n * dt
            hold = b[3]
        n_hold = int(round(hold / dt))
        if n_hold:
            last = b
            ts.append(t + np.arange(1, n_hold + 1) * dt)
            pos.append(np.repeat(last[0][None], n_hold, 0))
            yaws.append(np.full(n_hold, last[1]))
            opening.append(np.full(n_hold, last[2]))
            t += n_hold * dt
    t_s = np.concatenate(ts)
    p = np.concatenate(pos)
    y = np.concatenate(yaws)
    freq = rng.uniform(1.5, 4.0, (2, 5))
    phase = rng.uniform(0, 2 * np.pi, (2, 5))
    amp = np.array([0.0008, 0.0008, 0.0006, np.radians(0.5), np.radians(0.5)])
    tremor = sum(amp * np.sin(2 * np.pi * freq[k] * t_s[:, None] + phase[k]) for k in range(2)) / 2
    p = p + tremor[:, :3]
    rot = Rotation.from_euler("z", y[:, None]) * Rotation.from_euler("xy", tremor[:, 3:5])
    return Plan(t_s, p, rot.as_rotvec(), np.clip(np.concatenate(opening), 0.0, MAX_OPENING_M), corrective)
