"""The simulated handheld gripper: a MuJoCo scene, a kinematic controller and the grasp rule.

The scene (MJCF built in :func:`scene_xml`) is a checkered table at ``z = 0``,
one or two blocks and a flat target pad, and a parallel gripper with a wrist
camera. Every body is a mocap body or a finger slide joint: MuJoCo computes the
kinematics and renders (``mujoco.Renderer``, headless with ``MUJOCO_GL=egl``);
nothing is integrated by its contact solver. This is the documented
simplification of grasping: when the fingers close, :func:`grasp_holds` decides
from the geometry whether a real parallel gripper would hold the block (the
fingertips low enough, the block between them, its long axis across the
closing direction within :data:`GRASP_YAW_TOL_RAD`, the block's width across
the fingers at most :data:`MAX_OPENING_M`); if it holds, the fingers square it up
and centre it between them as real ones do (:func:`squared_grasp`: its long axis
onto the gripper's, its centre onto the fingers' mid-plane, the offset along the
fingers kept), and it is welded there until the fingers open again, and then
rests on whatever is below it. A badly aimed grasp closes the fingers on nothing.

Frames (all right-handed, metres, radians):

- *world*: the table's, ``z`` up, the table top at ``z = 0``;
- *gripper* / *TCP*: origin between the fingertips, ``x`` forward, ``y`` the
  closing direction, ``z`` up (the fingers point down along ``-z``);
- *camera*: the wrist camera, :data:`CAMERA_IN_TCP` above and behind the TCP,
  axes those of the gripper (what a VIO pose of the camera's optical centre
  gives: ``Z`` against gravity, ``X`` the heading); it looks straight down.
  ``tx_cam_tcp`` (the TCP in the camera frame) is :data:`TX_CAM_TCP`.

Speeds and accelerations of the controller are bounded as a hand (or an arm
driven by it) would be: :data:`MAX_SPEED_M_S`, :data:`MAX_ACCEL_M_S2`,
:data:`MAX_ANG_SPEED_RAD_S`, :data:`FINGER_SPEED_M_S`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from scipy.spatial.transform import Rotation

#: Half sizes of a block (m): 7 cm long (x), 2.5 cm wide (y), 3 cm tall (z).
BLOCK_HALF = np.array([0.035, 0.0125, 0.015])
#: Half sizes of the second block (``stack``'s base, m): 10 cm x 6 cm, as tall as the first. A base as
#: small as the held block hides behind it in the wrist camera for the last 0.5-1.5 s before release (its
#: pixels at 64 x 64 fall to 0 in every scripted demonstration measured), so the final alignment would be
#: blind; a wider base keeps its edges in view around the held block, as a lab's stacking target would be.
BASE_HALF = np.array([0.05, 0.03, 0.015])
#: Half size of the square target pad (m).
PAD_HALF = 0.035
#: Finger opening range (m).
MIN_OPENING_M, MAX_OPENING_M = 0.0, 0.08
# The grasp tolerances are what the finger opening allows, each with a margin (documented simplification):
# closing parallel fingers centre a block and square it up as long as both fingers land beside it.
#: Largest misalignment (rad) between the block's long axis and the gripper's x axis that still holds: at
#: 30 degrees the block spans 2 * (1.25 cos + 3.5 sin) = 5.7 cm across the fingers' 8 cm, and the closing
#: fingers turn it square; beyond it a corner lands under a finger.
GRASP_YAW_TOL_RAD = np.radians(30.0)
#: Largest offset (m) of the TCP from the block centre along the block's long axis (its half length less a
#: finger's half width, 3.5 - 0.8 cm, less 2 mm) / across it ((8 - 2.5) / 2 cm less 5 mm for the finger pad).
GRASP_ALONG_TOL_M, GRASP_ACROSS_TOL_M = 0.025, 0.0225
#: The TCP (the fingertips) must be at most this high above the block's centre: 5 mm of contact below its top.
GRASP_HEIGHT_TOL_M = 0.010
#: The camera's optical centre in the TCP frame (m): behind and above the fingertips.
CAMERA_IN_TCP = np.array([-0.03, 0.0, 0.13])
#: The TCP pose in the camera frame (4 x 4), what ``task.tx_cam_tcp`` takes.
TX_CAM_TCP = np.eye(4)
TX_CAM_TCP[:3, 3] = -CAMERA_IN_TCP
MAX_SPEED_M_S, MAX_ACCEL_M_S2 = 0.35, 2.5
MAX_ANG_SPEED_RAD_S = 2.5
FINGER_SPEED_M_S = 0.2
#: A held block is let go once the fingers are commanded this much wider than it (m): a command a hair
#: above the block's width (a regression's noise around the encoder's reading while holding) still grips it.
RELEASE_MARGIN_M = 0.004
#: Controller rate (Hz): every stream is sampled from the state at this rate.
CONTROL_HZ = 100.0
#: Lowest TCP height the controller allows (m): the fingertips do not enter the table.
MIN_TCP_Z_M = 0.002

BLOCK_RGBA = ("0.85 0.15 0.1 1", "0.15 0.3 0.85 1")
PAD_RGBA = "0.1 0.7 0.25 1"


def block_half(index: int) -> np.ndarray:
    """Half sizes (3,) m of block ``index``: :data:`BLOCK_HALF` for the one to pick, :data:`BASE_HALF` after it."""
    return BLOCK_HALF if index == 0 else BASE_HALF


def scene_xml(n_blocks: int, camera_fovy_deg: float = 85.0) -> str:
    """MJCF of the scene: table, ``n_blocks`` mocap blocks, the pad and the gripper with its camera."""
    blocks = "".join(
        f'<body name="block{i}" mocap="true" pos="{0.3 * i} 0.5 {bz}">'
        f'<geom type="box" size="{bx} {by} {bz}" rgba="{BLOCK_RGBA[i]}" contype="0" conaffinity="0"/>'
        # a darker band across one end: the block looks different at its two ends only by this mark,
        # so yaw is visible while the grasp itself stays symmetric under a half turn
        f'<geom type="box" size="0.006 {by + 0.0005} {bz + 0.0005}" pos="{bx - 0.008} 0 0" rgba="0.2 0.2 0.2 1" '
        'contype="0" conaffinity="0"/></body>'
        for i, (bx, by, bz) in enumerate(block_half(i) for i in range(n_blocks))
    )
    cx, cy, cz = CAMERA_IN_TCP
    return f"""
<mujoco model="dpflow_gripper_world">
  <visual><quality shadowsize="0" offsamples="0"/><global offwidth="640" offheight="480"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.5 0.5 0.5"/></visual>
  <asset>
    <texture name="grid" type="2d" builtin="checker" rgb1="0.78 0.72 0.62" rgb2="0.55 0.5 0.42"
             width="256" height="256" mark="random" random="0.03" markrgb="0.3 0.3 0.3"/>
    <material name="table" texture="grid" texrepeat="24 24"/>
  </asset>
  <worldbody>
    <geom name="table" type="plane" size="0.6 0.6 0.01" material="table" contype="0" conaffinity="0"/>
    <body name="pad" mocap="true" pos="0 0 0.0005">
      <geom type="box" size="{PAD_HALF} {PAD_HALF} 0.0005" rgba="{PAD_RGBA}" contype="0" conaffinity="0"/>
    </body>
    {blocks}
    <body name="gripper" mocap="true" pos="0 0 0.2">
      <camera name="wrist" pos="{cx} {cy} {cz}" xyaxes="0 -1 0 1 0 0" fovy="{camera_fovy_deg}"/>
      <body name="finger_l" pos="0 0.04 0">
        <joint name="finger_l" type="slide" axis="0 1 0" range="-0.04 0.0"/>
        <geom type="box" size="0.008 0.004 0.035" pos="0 0.004 0.035" rgba="0.9 0.9 0.92 1" contype="0" conaffinity="0"/>
      </body>
      <body name="finger_r" pos="0 -0.04 0">
        <joint name="finger_r" type="slide" axis="0 -1 0" range="-0.04 0.0"/>
        <geom type="box" size="0.008 0.004 0.035" pos="0 -0.004 0.035" rgba="0.9 0.9 0.92 1" contype="0" conaffinity="0"/>
      </body>
    </body>
    <camera name="scene" pos="0 -0.55 0.55" xyaxes="1 0 0 0 0.7 0.7" fovy="60"/>
  </worldbody>
</mujoco>"""


def rotvec_to_mat(v) -> np.ndarray:
    """(3, 3) rotation matrix of a rotation vector (rad), by Rodrigues' formula: the controller's hot path,
    where scipy's ``Rotation`` costs 20x more per call."""
    x, y, z = float(v[0]), float(v[1]), float(v[2])
    theta = math.sqrt(x * x + y * y + z * z)
    k = np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])
    if theta < 1e-9:
        return np.eye(3) + k
    k /= theta
    return np.eye(3) + math.sin(theta) * k + (1 - math.cos(theta)) * (k @ k)


def mat_to_rotvec(m: np.ndarray) -> np.ndarray:
    """Rotation vector (rad, norm <= pi) of a (3, 3) rotation matrix."""
    c = max(-1.0, min(1.0, (m[0, 0] + m[1, 1] + m[2, 2] - 1) / 2))
    theta = math.acos(c)
    axis = np.array([m[2, 1] - m[1, 2], m[0, 2] - m[2, 0], m[1, 0] - m[0, 1]])
    if theta < 1e-6:
        return axis / 2
    if math.pi - theta < 1e-3:  # near a half turn the antisymmetric part vanishes: let scipy resolve it
        return Rotation.from_matrix(m).as_rotvec()
    return axis * (theta / (2 * math.sin(theta)))


def yaw_of(rotvec: np.ndarray) -> float:
    """Heading (rad) of a rotation: the angle of its x axis projected on the table."""
    x = rotvec_to_mat(rotvec)[:, 0]
    return float(np.arctan2(x[1], x[0]))


def wrap_half_turn(angle: float) -> float:
    """``angle`` (rad) wrapped to ``[-pi/2, pi/2)``: a block looks the same after a half turn."""
    return float((angle + np.pi / 2) % np.pi - np.pi / 2)


@dataclass
class Block:
    """A block's pose: ``pos`` (3,) m of its centre, ``yaw`` rad; ``held`` while welded to the gripper."""

    pos: np.ndarray
    yaw: float
    held: bool = False
    grasp_in_tcp: np.ndarray | None = None  # (4, 4) the block in the TCP frame while held


def grasp_holds(tcp_pos: np.ndarray, tcp_yaw: float, block: Block) -> tuple[bool, str]:
    """Whether closing the fingers at this TCP pose holds ``block``, and why not.

    Returns ``(holds, reason)``; ``reason`` is ``""`` when it holds, else one of
    ``too_high``, ``off_axis`` (across the closing direction), ``off_centre``
    (along the block), ``misrotated``.
    """
    d = np.asarray(tcp_pos[:2]) - block.pos[:2]
    c, s = np.cos(block.yaw), np.sin(block.yaw)
    along, across = d @ np.array([c, s]), d @ np.array([-s, c])
    if tcp_pos[2] - block.pos[2] > GRASP_HEIGHT_TOL_M:
        return False, "too_high"
    misalign = abs(wrap_half_turn(tcp_yaw - block.yaw))
    # the block's extent across the fingers must fit the opening, and a large misalignment twists it out
    extent = 2 * (BLOCK_HALF[1] * np.cos(misalign) + BLOCK_HALF[0] * np.sin(misalign))
    if misalign > GRASP_YAW_TOL_RAD or extent > MAX_OPENING_M:
        return False, "misrotated"
    if abs(across) > GRASP_ACROSS_TOL_M:
        return False, "off_axis"
    if abs(along) > GRASP_ALONG_TOL_M:
        return False, "off_centre"
    return True, ""


def squared_grasp(block_in_tcp: np.ndarray) -> np.ndarray:
    """Where closing parallel fingers leave a block they hold, in the TCP frame (4 x 4 float64, m).

    ``block_in_tcp`` is the block's pose in the TCP frame when the fingers touch it. Two fingers closing
    along the TCP's ``y`` axis push the block until both faces lie flat against them: its long axis
    turns onto the TCP's ``x`` axis (by the smaller angle, so a half turn of the block stays a half
    turn) and its centre comes onto the TCP's ``x``-``z`` plane (``y = 0``). Nothing pushes along the
    fingers' faces, so the offset along ``x`` and the height stay as they were. This is what
    :func:`grasp_holds` lets through (misaligned up to :data:`GRASP_YAW_TOL_RAD`, across up to
    :data:`GRASP_ACROSS_TOL_M`): without it a block held 20 mm across would lie inside a finger.
    """
    m = np.array(block_in_tcp, dtype=np.float64)
    rel_yaw = float(np.arctan2(m[1, 0], m[0, 0]))
    turn = rel_yaw - wrap_half_turn(rel_yaw)  # 0 or a half turn
    out = np.eye(4)
    out[:3, :3] = Rotation.from_euler("z", turn).as_matrix()
    out[:3, 3] = [m[0, 3], 0.0, m[2, 3]]
    return out


def pose_mat(pos: np.ndarray, rotvec: np.ndarray) -> np.ndarray:
    """(4, 4) float64 pose from a position (m) and a rotation vector (rad)."""
    m = np.eye(4)
    m[:3, :3] = rotvec_to_mat(rotvec)
    m[:3, 3] = pos
    return m


@dataclass
class GripperState:
    """The gripper's kinematic state: TCP ``pos`` (3,) m, ``rotvec`` (3,) rad, linear ``vel`` (3,) m/s,
    finger ``opening`` m (what the encoder reads)."""

    pos: np.ndarray
    rotvec: np.ndarray
    vel: np.ndarray = field(default_factory=lambda: np.zeros(3))
    opening: float = MAX_OPENING_M


class GripperWorld:
    """The scene's state, stepped by a bounded-speed controller towards TCP targets.

    Args:
        n_blocks: 1 (``pick_place``) or 2 (``stack``).
        width, height: wrist camera image size in pixels.

    Use :meth:`reset` to place the objects, :meth:`step` to move towards a target,
    :meth:`render` for the wrist camera (uint8 RGB ``(height, width, 3)``).
    """

    def __init__(self, n_blocks: int, width: int = 128, height: int = 128):
        os.environ.setdefault("MUJOCO_GL", "egl")
        import mujoco

        self._mj = mujoco
        self.model = mujoco.MjModel.from_xml_string(scene_xml(n_blocks))
        self.data = mujoco.MjData(self.model)
        self.width, self.height = int(width), int(height)
        self._renderers: dict[tuple[int, int], object] = {}
        self.n_blocks = n_blocks
        self.blocks: list[Block] = []
        self.pad_pos = np.zeros(3)
        self.gripper = GripperState(np.array([0.0, 0.0, 0.2]), np.zeros(3))
        self.time_s = 0.0
        self.grasp_attempts: list[str] = []
        self.ever_held = False
        #: how far (m) the block fell when it was last let go
        self.last_drop_m = 0.0

    def reset(self, gripper_pos, gripper_yaw: float, blocks: list[tuple[np.ndarray, float]], pad_xy) -> None:
        """Place the gripper (TCP position m, heading rad, fingers open), the blocks ((x, y) m, yaw rad; they
        rest on the table) and the pad ((x, y) m); the clock restarts at 0."""
        self.gripper = GripperState(np.asarray(gripper_pos, float).copy(), np.array([0.0, 0.0, float(gripper_yaw)]))
        self.blocks = [Block(np.array([xy[0], xy[1], BLOCK_HALF[2]], float), float(yaw)) for xy, yaw in blocks]
        self.pad_pos = np.array([pad_xy[0], pad_xy[1], 0.0005])
        self.time_s = 0.0
        self.grasp_attempts = []
        self.ever_held = False
        self.last_drop_m = 0.0

    @property
    def holding(self) -> Block | None:
        return next((b for b in self.blocks if b.held), None)

    def step(self, target_pos: np.ndarray, target_rotvec: np.ndarray, target_opening: float, dt: float) -> None:
        """Move ``dt`` seconds towards a TCP target (position m, rotation vector rad, opening m).

        Linear motion: the velocity heads for the target at most :data:`MAX_SPEED_M_S`, changing by at
        most :data:`MAX_ACCEL_M_S2` per second; rotation: at most :data:`MAX_ANG_SPEED_RAD_S` along the
        geodesic; fingers: :data:`FINGER_SPEED_M_S`. Closing on a block applies :func:`grasp_holds`.
        """
        g = self.gripper
        target_pos = np.asarray(target_pos, float).copy()
        target_pos[2] = max(target_pos[2], MIN_TCP_Z_M)
        err = target_pos - g.pos
        dist = float(np.linalg.norm(err))
        # speed that can still stop at the target (v^2 = 2 a d), capped
        v_want = min(MAX_SPEED_M_S, np.sqrt(2 * MAX_ACCEL_M_S2 * dist), dist / dt)
        v_des = err / dist * v_want if dist > 1e-9 else np.zeros(3)
        dv = v_des - g.vel
        dv_max = MAX_ACCEL_M_S2 * dt
        n = float(np.linalg.norm(dv))
        g.vel = g.vel + (dv * (dv_max / n) if n > dv_max else dv)
        g.pos = g.pos + g.vel * dt
        g.pos[2] = max(g.pos[2], MIN_TCP_Z_M)
        r_now = rotvec_to_mat(g.rotvec)
        delta = mat_to_rotvec(rotvec_to_mat(target_rotvec) @ r_now.T)
        ang = float(np.linalg.norm(delta))
        if ang > MAX_ANG_SPEED_RAD_S * dt:
            delta *= MAX_ANG_SPEED_RAD_S * dt / ang
        g.rotvec = mat_to_rotvec(rotvec_to_mat(delta) @ r_now)
        self._move_fingers(float(np.clip(target_opening, MIN_OPENING_M, MAX_OPENING_M)), dt)
        held = self.holding
        if held is not None:
            m = pose_mat(g.pos, g.rotvec) @ held.grasp_in_tcp
            held.pos = m[:3, 3].copy()
            held.yaw = float(np.arctan2(m[1, 0], m[0, 0]))
        self.time_s += dt

    def _move_fingers(self, target: float, dt: float) -> None:
        g = self.gripper
        before = g.opening
        step = float(np.clip(target - before, -FINGER_SPEED_M_S * dt, FINGER_SPEED_M_S * dt))
        g.opening = before + step
        held = self.holding
        width = 2 * BLOCK_HALF[1]
        if held is not None:
            if target > width + RELEASE_MARGIN_M:  # opened: the block is let go and rests on what is below it
                held.held, held.grasp_in_tcp = False, None
                rest = self._rest_height(held)
                self.last_drop_m = float(held.pos[2] - rest)
                held.pos = np.array([held.pos[0], held.pos[1], rest])
            else:
                g.opening = width  # the fingers stop on the block
            return
        if before > width >= g.opening and step < 0:
            # only the first block can be picked up (documented simplification: stack's base stays put)
            candidates = [(b, *grasp_holds(g.pos, yaw_of(g.rotvec), b)) for b in self.blocks[:1]]
            holding = [b for b, ok, _ in candidates if ok]
            if holding:
                b = holding[0]
                b.held = True
                touching = np.linalg.inv(pose_mat(g.pos, g.rotvec)) @ pose_mat(b.pos, [0, 0, b.yaw])
                b.grasp_in_tcp = squared_grasp(touching)
                m = pose_mat(g.pos, g.rotvec) @ b.grasp_in_tcp
                b.pos, b.yaw = m[:3, 3].copy(), float(np.arctan2(m[1, 0], m[0, 0]))
                g.opening = width
                self.ever_held = True
                self.grasp_attempts.append("held")
            else:
                self.grasp_attempts.append(min((r for _, _, r in candidates), key=_REASON_ORDER.index))

    def _rest_height(self, block: Block) -> float:
        """Centre height (m) at which a released block rests: on the table, or on a block below it (its centre
        over that block's footprint)."""
        for i, other in enumerate(self.blocks):
            if other is block or other.pos[2] >= block.pos[2]:
                continue
            c, s = np.cos(other.yaw), np.sin(other.yaw)
            d = block.pos[:2] - other.pos[:2]
            half = block_half(i)
            if abs(d @ np.array([c, s])) <= half[0] and abs(d @ np.array([-s, c])) <= half[1]:
                return float(other.pos[2] + half[2] + BLOCK_HALF[2])
        return float(BLOCK_HALF[2])

    def camera_pose(self) -> tuple[np.ndarray, np.ndarray]:
        """The wrist camera's pose in the world: position (3,) m, rotation vector (3,) rad."""
        g = self.gripper
        m = pose_mat(g.pos, g.rotvec) @ np.linalg.inv(TX_CAM_TCP)
        return m[:3, 3].copy(), g.rotvec.copy()

    def _sync(self) -> None:
        mj, m, d = self._mj, self.model, self.data
        g = self.gripper
        gid = m.body("gripper").mocapid[0]
        d.mocap_pos[gid] = g.pos
        d.mocap_quat[gid] = np.roll(Rotation.from_rotvec(g.rotvec).as_quat(), 1)
        half = g.opening / 2 - MAX_OPENING_M / 2
        d.qpos[m.joint("finger_l").qposadr[0]] = half
        d.qpos[m.joint("finger_r").qposadr[0]] = half
        for i, b in enumerate(self.blocks):
            bid = m.body(f"block{i}").mocapid[0]
            d.mocap_pos[bid] = b.pos
            d.mocap_quat[bid] = np.roll(Rotation.from_euler("z", b.yaw).as_quat(), 1)
        d.mocap_pos[m.body("pad").mocapid[0]] = self.pad_pos
        mj.mj_kinematics(m, d)
        mj.mj_camlight(m, d)

    def render(self, camera: str = "wrist", width: int | None = None, height: int | None = None) -> np.ndarray:
        """(height, width, 3) uint8 RGB image of ``camera`` (``wrist`` or ``scene``) in the current state."""
        size = (int(height or self.height), int(width or self.width))
        renderer = self._renderers.get(size)
        if renderer is None:
            renderer = self._renderers[size] = self._mj.Renderer(self.model, *size)
        self._sync()
        renderer.update_scene(self.data, camera=camera)
        return renderer.render().copy()

    def close(self) -> None:
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()


_REASON_ORDER = ["off_centre", "off_axis", "misrotated", "too_high"]
