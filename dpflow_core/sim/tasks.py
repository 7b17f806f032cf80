"""The world's tasks: initial states drawn from a seed, and each task's success rule.

Two tasks of different structure:

- ``pick_place``: one block (red, a dark band across one end) at a random
  position and yaw on the table, and a green pad elsewhere. Pick the block up,
  put it down on the pad, open, retreat. Success: the block rests on the table
  with its centre inside the pad, the gripper no longer holds it and the TCP is
  at least :data:`RETREAT_Z_M` above the table.
- ``stack``: a red block to pick and a wider blue base to put it on
  (:data:`~dpflow_core.sim.world.BASE_HALF`: its edges stay in the wrist camera's
  view around the held block while aligning; it is not picked up). Success: the red
  block rests on the blue one, centres within :data:`STACK_XY_TOL_M` and long
  axes within :data:`STACK_YAW_TOL_RAD` (a half turn is the same block), the
  gripper open and retreated.

Object positions are random per episode and relative to where the gripper
starts, so that nothing in the gripper's own pose track tells where they are:
only the wrist camera does. The block's yaw is drawn within
:data:`MAX_YAW_TO_TURN_RAD` of the gripper's starting heading, so the rotation
a demonstrator needs is never ambiguous (a half-turn-symmetric block seen at
90 degrees could be turned either way, and a regression policy would average
the two). For the same reason ``stack``'s base is drawn within
:data:`MAX_YAW_TO_TURN_RAD` of the block's yaw: the turn that lines the held
block up with the base is then at most that, never near a quarter turn. (Drawn
each within that of the gripper's heading instead, the two differed by up to
140 degrees; a policy trained on such demonstrations left 15 of 28 wrong places
turned 0.5-1.6 rad from the base, the averaged turn.)

Seeds: an initial state is a pure function of ``(task, seed)``. Recordings use
seeds from :data:`TRAIN_SEED_BASE` up, rollouts from :data:`EVAL_SEED_BASE` up,
and :func:`check_disjoint` asserts the two never meet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpflow_core.sim.world import BLOCK_HALF, PAD_HALF, GripperWorld, wrap_half_turn

TASKS = ("pick_place", "stack")
RETREAT_Z_M = 0.06
STACK_XY_TOL_M = 0.012
STACK_YAW_TOL_RAD = np.radians(20.0)
MAX_YAW_TO_TURN_RAD = np.radians(70.0)
#: Seeds of recorded (training) episodes start here; rollouts' held-out initial states at EVAL_SEED_BASE.
TRAIN_SEED_BASE = 0
EVAL_SEED_BASE = 1_000_000
#: How long a rollout may run (s).
TIMEOUT_S = {"pick_place": 16.0, "stack": 16.0}
#: The closed-loop success a task's policy must reach when nothing else is asked (fraction): the targets
#: the world's issue set, 80 % on pick_place (the README main job) and 60 % on the harder stack.
SUCCESS_TARGET = {"pick_place": 0.8, "stack": 0.6}

#: A block let go from higher than this above where it comes to rest was dropped, not placed (m).
DROP_M = 0.03
FAILURE_MODES = ("never_grasped", "dropped", "wrong_place", "timeout")


@dataclass(frozen=True)
class InitialState:
    """Where everything starts: TCP ``gripper_pos`` (3,) m and ``gripper_yaw`` rad; ``blocks`` as
    ``((x, y) m, yaw rad)``, the first the one to pick; ``pad_xy`` (x, y) m (``pick_place``)."""

    task: str
    seed: int
    gripper_pos: tuple[float, float, float]
    gripper_yaw: float
    blocks: tuple[tuple[tuple[float, float], float], ...]
    pad_xy: tuple[float, float]


def check_task(task: str) -> str:
    """``task`` when it is one of :data:`TASKS`; ValueError naming the valid ones otherwise."""
    if task not in TASKS:
        raise ValueError(f"unknown simulated task {task!r}: the world has {list(TASKS)}")
    return task


def initial_state(task: str, seed: int) -> InitialState:
    """The initial state of ``task`` for ``seed`` (deterministic)."""
    check_task(task)
    rng = np.random.default_rng([0xD9F1, TASKS.index(task), int(seed)])
    start = np.array([*rng.uniform(-0.08, 0.08, 2), rng.uniform(0.17, 0.22)])
    yaw0 = float(rng.uniform(-0.6, 0.6))

    def spot(taken: list[np.ndarray], min_gap: float) -> np.ndarray:
        for _ in range(200):
            r, a = rng.uniform(0.04, 0.12), rng.uniform(-np.pi, np.pi)
            xy = start[:2] + r * np.array([np.cos(a), np.sin(a)])
            if all(np.linalg.norm(xy - t) >= min_gap for t in taken):
                return xy
        raise RuntimeError(f"no free spot for seed {seed}")  # not reached with these sizes

    block_xy = spot([], 0.0)
    yaw = wrap_half_turn(yaw0 + rng.uniform(-MAX_YAW_TO_TURN_RAD, MAX_YAW_TO_TURN_RAD))
    blocks = [((float(block_xy[0]), float(block_xy[1])), yaw)]
    pad = spot([block_xy], 0.11)
    if task == "stack":
        # the base within the same turn of the block, so the turn that lines the held block up with it is
        # never near a quarter turn, where a half-turn-symmetric base could be met turning either way
        base_yaw = wrap_half_turn(yaw + rng.uniform(-MAX_YAW_TO_TURN_RAD, MAX_YAW_TO_TURN_RAD))
        blocks.append(((float(pad[0]), float(pad[1])), base_yaw))
        pad = np.array([5.0, 5.0])  # out of sight: stacking has no pad
    return InitialState(task, int(seed), tuple(map(float, start)), yaw0, tuple(blocks), (float(pad[0]), float(pad[1])))


def new_world(task: str, width: int = 128, height: int = 128) -> GripperWorld:
    """A world with the objects ``task`` needs (not yet reset)."""
    return GripperWorld(2 if check_task(task) == "stack" else 1, width, height)


def reset_world(world: GripperWorld, state: InitialState) -> None:
    """Put ``world`` in ``state``."""
    world.reset(state.gripper_pos, state.gripper_yaw, [(np.array(xy), yaw) for xy, yaw in state.blocks], state.pad_xy)


def placement(world: GripperWorld, task: str) -> dict[str, float | bool]:
    """Where the block is against where ``task`` wants it, in the world's current state (the figures behind
    a ``wrong_place``): ``xy_m`` the distance (m) of its centre from the target's (the pad's, or the base's
    for ``stack``), ``yaw_rad`` (``stack``) its long axis against the base's, modulo a half turn, and
    ``on_target`` whether it rests on the pad (its centre inside it) or on the base's top."""
    block = world.blocks[0]
    if task == "pick_place":
        on = abs(block.pos[2] - BLOCK_HALF[2]) < 1e-6 and np.all(np.abs(block.pos[:2] - world.pad_pos[:2]) <= PAD_HALF)
        return {"xy_m": float(np.linalg.norm(block.pos[:2] - world.pad_pos[:2])), "on_target": bool(on)}
    base = world.blocks[1]
    return {"xy_m": float(np.linalg.norm(block.pos[:2] - base.pos[:2])),
            "yaw_rad": abs(wrap_half_turn(block.yaw - base.yaw)),
            "on_target": bool(abs(block.pos[2] - (base.pos[2] + 2 * BLOCK_HALF[2])) < 1e-6)}


def placed(world: GripperWorld, task: str) -> bool:
    """Whether the block rests where ``task`` wants it (held or not): on the pad, or on the base within
    :data:`STACK_XY_TOL_M` and :data:`STACK_YAW_TOL_RAD`."""
    p = placement(world, task)
    if task == "pick_place":
        return p["on_target"]
    return p["on_target"] and p["yaw_rad"] <= STACK_YAW_TOL_RAD and p["xy_m"] <= STACK_XY_TOL_M


def success(world: GripperWorld, task: str) -> bool:
    """The task's success rule (module docstring), in the world's current state."""
    return world.holding is None and placed(world, task) and world.gripper.pos[2] >= RETREAT_Z_M


def failure_mode(world: GripperWorld, task: str) -> str:
    """Why an episode that ran out of time failed: one of :data:`FAILURE_MODES`."""
    if not world.ever_held:
        return "never_grasped"
    if world.holding is not None:
        return "timeout"
    if placed(world, task):
        return "timeout"  # placed, but the gripper did not open and retreat in time
    return "dropped" if world.last_drop_m > DROP_M else "wrong_place"


def check_disjoint(train_seeds, eval_seeds) -> None:
    """Raise ValueError when a rollout's initial-state seed is also a training episode's seed."""
    both = sorted(set(int(s) for s in train_seeds) & set(int(s) for s in eval_seeds))
    if both:
        raise ValueError(f"rollout seeds {both[:10]} are also training seeds: held-out states must be unseen")
