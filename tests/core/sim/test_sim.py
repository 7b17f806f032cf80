"""The simulated gripper world: the grasp rule, the oracle, held-out seeds, recordings through pairing and
conversion, and the closed-loop machinery (rollouts through predict_action, the closed_loop_success verdict)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.pairing import pair_recordings, save_manifest
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.sim.demonstrator import plan
from dpflow_core.sim.evaluate import ClosedLoopSettings, evaluate_closed_loop, verdict
from dpflow_core.sim.tasks import SUCCESS_TARGET
from dpflow_core.sim.record import (
    SimRecordingSpec,
    camera_poses,
    demonstrate,
    read_sim_task,
    record_task,
    set_state,
    vio_origin,
)
from dpflow_core.sim.rollout import (
    RolloutSummary,
    check_held_out,
    eval_seeds,
    rollout_baseline,
    rollout_policy,
    wilson_interval,
)
from dpflow_core.sim.tasks import (
    EVAL_SEED_BASE,
    check_disjoint,
    initial_state,
    new_world,
    reset_world,
    success,
)
from dpflow_core.sim.world import BLOCK_HALF, CONTROL_HZ, Block, grasp_holds

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_grasp_rule_geometry():
    block = Block(np.array([0.1, -0.05, BLOCK_HALF[2]]), yaw=0.4)
    c, s = math.cos(0.4), math.sin(0.4)
    along, across = np.array([c, s]), np.array([-s, c])
    centre = np.array([0.1, -0.05, BLOCK_HALF[2]])
    assert grasp_holds(centre, 0.4, block) == (True, "")
    assert grasp_holds(centre, 0.4 + math.pi, block) == (True, "")  # a half turn grasps the same block
    assert grasp_holds(centre + [*(0.022 * along), 0], 0.4, block) == (True, "")
    assert grasp_holds(centre + [*(0.02 * across), 0], 0.4 + math.radians(25), block) == (True, "")
    assert grasp_holds(centre + [*(0.03 * along), 0], 0.4, block) == (False, "off_centre")
    assert grasp_holds(centre + [*(0.025 * across), 0], 0.4, block) == (False, "off_axis")
    assert grasp_holds(centre, 0.4 + math.radians(35), block) == (False, "misrotated")
    assert grasp_holds(centre, 0.4 + math.radians(90), block) == (False, "misrotated")
    assert grasp_holds(centre + [0, 0, 0.012], 0.4, block) == (False, "too_high")


@pytest.mark.parametrize("turn_deg,across_m,along_m", [(20.0, 0.015, 0.01), (-25.0, -0.014, -0.015), (160.0, 0.01, 0.0)])
def test_closing_fingers_square_the_block_and_centre_it_between_them(turn_deg, across_m, along_m):
    """A grasp the rule lets through, misaligned and off the fingers' mid-plane, leaves the block with its long
    axis on the gripper's x axis (a half turn kept a half turn) and its centre between the fingers, the offset
    along them kept; carried off and let go, it rests with the gripper's heading."""
    world = new_world("pick_place", 16, 16)
    g_yaw = 0.3
    block_yaw = g_yaw + math.radians(turn_deg)
    c, s = math.cos(g_yaw), math.sin(g_yaw)
    x_axis, y_axis = np.array([c, s]), np.array([-s, c])  # the gripper's forward and closing directions
    tcp = np.array([0.02, -0.01, BLOCK_HALF[2]])
    block_xy = tcp[:2] + along_m * x_axis + across_m * y_axis
    reset_world(world, replace(initial_state("pick_place", 0), gripper_pos=tuple(tcp), gripper_yaw=g_yaw,
                               blocks=(((float(block_xy[0]), float(block_xy[1])), block_yaw),)))
    rot = Rotation.from_euler("z", g_yaw).as_rotvec()
    for _ in range(60):
        world.step(tcp, rot, 0.0, 1 / CONTROL_HZ)
    held = world.holding
    assert held is not None, world.grasp_attempts
    d = held.pos[:2] - world.gripper.pos[:2]
    assert d @ y_axis == pytest.approx(0.0, abs=1e-9)  # centred between the fingers
    assert d @ x_axis == pytest.approx(along_m, abs=1e-9)  # nothing pushed it along them
    half_turns = 1 if abs(turn_deg) > 90 else 0
    assert math.remainder(held.yaw - g_yaw - half_turns * math.pi, 2 * math.pi) == pytest.approx(0.0, abs=1e-9)
    place = np.array([-0.05, 0.06, BLOCK_HALF[2] + 0.004])
    for target, opening in ((place + [0, 0, 0.05], 0.0), (place, 0.0), (place, 0.08)):
        for _ in range(150):
            world.step(target, rot, opening, 1 / CONTROL_HZ)
    assert world.holding is None
    assert math.remainder(world.blocks[0].yaw - g_yaw - half_turns * math.pi, 2 * math.pi) == pytest.approx(0, abs=1e-9)
    assert world.blocks[0].pos[:2] == pytest.approx(place[:2] + along_m * x_axis, abs=1e-6)


def test_stack_needs_no_turn_near_a_quarter_turn():
    """Over training and held-out seeds the base lies within MAX_YAW_TO_TURN_RAD of the block, modulo a half
    turn, and the demonstrator's place heading lines the block up with the base by that turn."""
    from dpflow_core.sim.tasks import MAX_YAW_TO_TURN_RAD
    from dpflow_core.sim.world import wrap_half_turn

    turns = []
    for seed in [*range(200), *range(EVAL_SEED_BASE, EVAL_SEED_BASE + 200)]:
        state = initial_state("stack", seed)
        (_, block_yaw), (_, base_yaw) = state.blocks
        turns.append(abs(wrap_half_turn(base_yaw - block_yaw)))
    assert max(turns) <= MAX_YAW_TO_TURN_RAD + 1e-12
    assert max(turns) > MAX_YAW_TO_TURN_RAD - math.radians(5)  # the range is used, not collapsed
    state = initial_state("stack", 11)
    world = new_world("stack", 16, 16)
    reset_world(world, state)
    _execute(world, plan(state))
    assert success(world, "stack")
    assert abs(wrap_half_turn(world.blocks[0].yaw - world.blocks[1].yaw)) < math.radians(3)


def _base_pixels(img: np.ndarray) -> int:
    """Pixels of the blue base (rgba 0.15 0.3 0.85 under the headlight) in a wrist image."""
    r, b = img[..., 0].astype(int), img[..., 2].astype(int)
    return int(((b > 120) & (r < 90)).sum())


def test_stack_base_stays_in_view_while_aligning_and_holds_what_lands_on_it():
    """The base shows around the held block in every 64 x 64 frame of the last second before release (a base
    the held block's size showed 0 pixels there in each of these demonstrations), and a block let go over the
    base's footprint rests on it, off it on the table."""
    world = new_world("stack", 64, 64)
    for seed in (0, 1, 2, 3):
        state = initial_state("stack", seed)
        reset_world(world, state)
        p = plan(state)
        release = int(np.flatnonzero((p.opening[1:] > 1e-4) & (p.opening[:-1] <= 1e-4))[-1]) + 1
        seen = []
        for i in range(release):
            world.step(p.pos[i], p.rotvec[i], p.opening[i], 1 / CONTROL_HZ)
            if i >= release - CONTROL_HZ and i % 5 == 0:
                seen.append(_base_pixels(world.render()))
        assert world.holding is not None and min(seen) >= 5, (seed, seen)
    base = world.blocks[1]
    c, s = math.cos(base.yaw), math.sin(base.yaw)
    for along, across, on_top in ((0.045, 0.0, True), (0.0, 0.027, True), (0.06, 0.0, False), (0.0, 0.035, False)):
        block = Block(np.array([base.pos[0] + along * c - across * s, base.pos[1] + along * s + across * c, 0.05]), 0.0)
        world.blocks[0] = block
        rest = world._rest_height(block)
        assert rest == pytest.approx(3 * BLOCK_HALF[2] if on_top else BLOCK_HALF[2]), (along, across)


def _execute(world, p) -> bool:
    for i in range(len(p.t_s)):
        world.step(p.pos[i], p.rotvec[i], p.opening[i], 1 / CONTROL_HZ)
    return any(a == "held" for a in world.grasp_attempts)


@pytest.mark.parametrize("shift_m,turn_deg,reason", [((0.0, 0.03), 0, "off"), ((0.035, 0.0), 0, "off"), ((0, 0), 40, "misrotated")])
def test_a_badly_aimed_grasp_fails(shift_m, turn_deg, reason):
    """The demonstrator's own track, aimed at a block moved or turned from where it really is, grasps nothing."""
    state = initial_state("pick_place", 7)
    (xy, yaw), = state.blocks
    yaw_off = math.radians(turn_deg)
    c, s = math.cos(yaw), math.sin(yaw)
    dx = shift_m[0] * np.array([c, s]) + shift_m[1] * np.array([-s, c])  # along / across the block
    aimed = replace(state, blocks=(((xy[0] + dx[0], xy[1] + dx[1]), yaw + yaw_off),))
    world = new_world("pick_place", 16, 16)
    reset_world(world, state)
    assert not _execute(world, plan(aimed, seed=7))
    assert world.grasp_attempts and world.grasp_attempts[0].startswith(reason)
    reset_world(world, state)
    assert _execute(world, plan(state))  # aimed right, the same track holds


def test_oracle_succeeds_and_trivial_baselines_fail_on_held_out_states():
    for task in ("pick_place", "stack"):
        seeds = eval_seeds(10, seed=3)
        oracle = RolloutSummary.of("oracle", rollout_baseline("oracle", task, seeds))
        assert oracle.successes == 10, (task, oracle)
        for name in ("hold", "replay"):
            s = RolloutSummary.of(name, rollout_baseline(name, task, seeds))
            assert s.success_rate <= 0.3, (task, s)


def test_rollout_seeds_never_meet_training_seeds(tmp_path):
    task_dir = record_task(tmp_path, "stack", 2, seed=999, spec=SimRecordingSpec(fps=10, width=32, height=32))
    train = [e["seed"] for e in read_sim_task(task_dir)["episodes"]]
    assert train == [999_000, 999_001] and max(train) < EVAL_SEED_BASE
    held_out = eval_seeds(500, seed=7)
    check_held_out(held_out)
    check_disjoint(train, held_out)
    assert min(held_out) == EVAL_SEED_BASE + 70_000
    with pytest.raises(ValueError, match="training range"):
        check_held_out([*held_out, train[0]])
    with pytest.raises(ValueError, match="also training seeds"):
        check_disjoint(train, [train[1]])
    with pytest.raises(ValueError, match="seed must be"):
        record_task(tmp_path / "b", "stack", 2, seed=1000)


def test_wilson_interval_gives_the_score_interval():
    # (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.96, worked by hand
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(160, 200) == pytest.approx((0.7391, 0.8495), abs=1e-4)
    assert wilson_interval(0, 50) == pytest.approx((0.0, 0.0713), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


@pytest.fixture(scope="module")
def stack_dataset(tmp_path_factory):
    """Two stack demonstrations recorded with a camera 0.1 s late against the pose clock, paired and converted."""
    root = tmp_path_factory.mktemp("simrec")
    spec = SimRecordingSpec(fps=30, width=64, height=64, camera_latency_s=0.1)
    task_dir = record_task(root, "stack", 2, seed=5, spec=spec)
    manifest = pair_recordings(task_dir)
    assert len(manifest.accepted) == 2 and not manifest.rejected
    path, _ = save_manifest(manifest, root / "manifests")
    out = root / "dataset.npz"
    convert(path, out, ConversionSettings(image_size=(64, 64)))
    return task_dir, ReplayBuffer(out), spec


def test_recordings_carry_the_world_through_conversion(stack_dataset):
    """Poses, gripper widths and frames of the converted dataset equal the world's own state at those times,
    and the camera's lag is in the data: row t's frame shows the world 0.1 s before t."""
    task_dir, buf, spec = stack_dataset
    world = new_world("stack", spec.width, spec.height)
    for episode, entry in enumerate(read_sim_task(task_dir)["episodes"]):
        hist = demonstrate(world, initial_state("stack", entry["seed"]))
        rows = buf.episode_slice(episode)
        p0, r0, *_ = hist.at(np.array([hist.t_s[0]]))
        cp, cr = camera_poses(p0, r0)
        origin = np.linalg.inv(vio_origin(cp[0], cr[0]))
        ts = np.asarray(buf["timestamp"][rows])
        # the dataset's clock starts at its first kept frame; find that offset from the pose track itself
        t_first = _first_frame_time(hist, origin, np.asarray(buf["robot0_eef_pos"][rows])[0])
        t = ts - ts[0] + t_first
        pos, rot, opening, bpos, byaw = hist.at(t)
        cam_pos, cam_rot = camera_poses(pos, rot)
        truth = cam_pos @ origin[:3, :3].T + origin[:3, 3]
        assert np.abs(np.asarray(buf["robot0_eef_pos"][rows]) - truth).max() < 1.5e-3
        rot_err = (Rotation.from_rotvec(np.asarray(buf["robot0_eef_rot_axis_angle"][rows])).inv()
                   * Rotation.from_matrix(origin[:3, :3]) * cam_rot).magnitude()
        assert rot_err.max() < 0.01
        assert np.abs(np.asarray(buf["robot0_gripper_width"][rows])[:, 0] - opening).max() < 2e-3
        frames = np.asarray(buf["camera0_rgb"][rows])
        for k in (len(t) // 3, len(t) // 2):
            errs = {}
            for lag in (0.0, 0.1):
                s = hist.at(np.array([t[k] - lag]))
                set_state(world, s[0][0], s[1][0], s[2][0], s[3][0], s[4][0])
                errs[lag] = np.abs(world.render().astype(int) - frames[k].astype(int)).mean()
            assert errs[0.1] < 6 and errs[0.1] < errs[0.0] / 1.5, errs
    world.close()


def _first_frame_time(hist, origin, first_pos) -> float:
    grid = np.arange(0.0, 0.5, 0.001)
    pos, rot, *_ = hist.at(grid)
    cp, _ = camera_poses(pos, rot)
    vio = cp @ origin[:3, :3].T + origin[:3, 3]
    return float(grid[np.argmin(np.linalg.norm(vio - first_pos, axis=1))])


class _ProbePolicy:
    """A predictor with the Policy interface that holds the observed pose and records what it was given (the
    network is what this test does not need: it checks the loop's timing contract)."""

    n_obs_steps, horizon, frequency_hz = 2, 16, 30.0
    action_dt_s = 0.1

    class spec:  # noqa: N801 - the attribute set Policy.spec has
        rgb_keys = ("camera0_rgb",)
        lowdim_keys = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")
        obs_down_sample_steps = 3

    class cfg:  # noqa: N801
        n_action_steps = 8

        class task:  # noqa: N801
            camera_obs_latency, robot_obs_latency, gripper_obs_latency = 0.1, 0.0, 0.0

    image_hw = (48, 48)

    def __init__(self):
        self.calls = []

    def predict_action(self, obs, generator=None, frame="tcp"):
        """Batched as the rollout calls it: every key ``(B, To, ...)``; returns ``(B, H, ...)``."""
        assert frame == "dataset" and obs["robot0_eef_pos"].ndim == 3
        self.calls.extend({k: np.array(v[b]) for k, v in obs.items()} for b in range(len(obs["timestamp"])))
        t = obs["timestamp"][:, -1:] + np.arange(self.horizon) * self.action_dt_s
        hold = lambda k: np.repeat(obs[k][:, -1:], self.horizon, 1)  # noqa: E731
        return {"robot0_eef_pos": hold("robot0_eef_pos"), "robot0_eef_rot_axis_angle": hold("robot0_eef_rot_axis_angle"),
                "robot0_gripper_width": hold("robot0_gripper_width"), "timestamp": t}


def test_rollouts_feed_predict_action_as_a_robot_would(tmp_path):
    probe = _ProbePolicy()
    records = rollout_policy(probe, "pick_place", eval_seeds(2), batch=1)
    assert [r.failure_mode for r in records] == ["never_grasped", "never_grasped"]
    first = probe.calls[0]
    assert first["camera0_rgb"].shape == (2, 48, 48, 3) and first["camera0_rgb"].dtype == np.uint8
    assert np.allclose(first["robot0_eef_pos"], 0, atol=1e-12)  # the VIO origin is the camera's first pose
    for call in probe.calls:
        if call["timestamp"][0] > 0:  # past the episode start, where the window is edge-padded
            assert call["timestamp"][1] - call["timestamp"][0] == pytest.approx(0.1, abs=1e-9)  # 3 camera ticks
    # the chunk is timed from the newest frame, 0.1 s old: its first action is past and dropped, the next 8
    # (0.1 s apart) run, so decisions come 0.7 s apart
    starts = [c["timestamp"][-1] for c in probe.calls[1:5]]
    assert np.allclose(np.diff(starts), 0.7, atol=1 / 30 + 1e-9)
    assert records[0].decisions == len(probe.calls) // 2 and records[0].latency["camera_obs_s"] == 0.1
    # in lockstep, two episodes in one batch see the same decision times and their own worlds
    both = _ProbePolicy()
    assert [r.__dict__ | {"predict_s": 0} for r in rollout_policy(both, "pick_place", eval_seeds(2), batch=2)] == [
        r.__dict__ | {"predict_s": 0} for r in records]
    assert [c["timestamp"][-1] for c in both.calls[::2]] == [c["timestamp"][-1] for c in probe.calls[:len(both.calls) // 2]]
    assert not np.array_equal(both.calls[2]["camera0_rgb"], both.calls[3]["camera0_rgb"])
    demonstrator = _DemonstratorPolicy("pick_place", eval_seeds(2))
    res = evaluate_closed_loop(_ProbePolicy(), "pick_place", tmp_path / "r",
                               ClosedLoopSettings(episodes=2, baselines=("oracle", "hold"), video_episodes=1),
                               baseline_policies={"no_camera": demonstrator})
    assert not res.passed and res.reason.startswith("policy success 0.0 % < target 80 %")
    # a further policy is a baseline on the same states, in its own file
    assert res.baselines["no_camera"]["successes"] == 2 and len(demonstrator.calls) > 0
    assert [r["seed"] for r in json.loads((tmp_path / "r" / "rollouts_no_camera.json").read_text())] == eval_seeds(2)
    for bad in ("hold", "policy", "No Camera"):
        with pytest.raises(ValueError, match="baseline policy name"):
            evaluate_closed_loop(_ProbePolicy(), "pick_place", tmp_path / "bad", ClosedLoopSettings(episodes=1),
                                 baseline_policies={bad: _ProbePolicy()})
    written = json.loads((tmp_path / "r" / "rollouts.json").read_text())
    assert [r["seed"] for r in written] == eval_seeds(2) and written[0]["success"] is False
    assert json.loads((tmp_path / "r" / "rollouts_oracle.json").read_text())[1]["success"] is True
    assert res.video.stat().st_size > 1000 and res.contact_sheet.stat().st_size > 1000


def test_each_task_is_judged_against_its_own_target_unless_one_is_given(tmp_path):
    assert SUCCESS_TARGET == {"pick_place": 0.8, "stack": 0.6}
    quick = dict(episodes=1, baselines=("hold",), video_episodes=0)
    res = evaluate_closed_loop(_ProbePolicy(), "stack", tmp_path / "own", ClosedLoopSettings(**quick))
    assert res.target == 0.6 and res.reason == "policy success 0.0 % < target 60 %"
    res = evaluate_closed_loop(_ProbePolicy(), "stack", tmp_path / "given", ClosedLoopSettings(**quick, target=0.0))
    assert res.target == 0.0 and "beat" in res.reason  # reaches 0 %, but not above hold by the margin


def test_verdict_needs_the_target_and_the_margin_and_a_working_world():
    s = lambda name, k, n=100: RolloutSummary.of(name, [_r(i < k) for i in range(n)])  # noqa: E731
    assert verdict(s("policy", 85), [s("oracle", 100), s("replay", 20)], 0.8, 0.2) == (True, "")
    assert not verdict(s("policy", 85), [s("oracle", 100), s("replay", 70)], 0.8, 0.2)[0]
    assert not verdict(s("policy", 75), [s("oracle", 100), s("replay", 0)], 0.8, 0.2)[0]
    ok, why = verdict(s("policy", 90), [s("oracle", 90)], 0.8, 0.2)
    assert not ok and "world is broken" in why


def _r(ok: bool):
    from dpflow_core.sim.rollout import RolloutRecord

    return RolloutRecord(0, ok, None if ok else "timeout", 1.0 if ok else None, 1.0, 1, [], {})


def test_the_world_says_where_success_is():
    world = new_world("pick_place", 16, 16)
    state = initial_state("pick_place", EVAL_SEED_BASE + 5)
    reset_world(world, state)
    p = plan(state)
    _execute(world, p)
    assert success(world, "pick_place")
    block = world.blocks[0]
    assert np.all(np.abs(block.pos[:2] - np.array(state.pad_xy)) <= 0.035) and world.holding is None
    from dpflow_core.sim.tasks import placement

    got = placement(world, "pick_place")
    assert got["on_target"] is True and got["xy_m"] == pytest.approx(np.linalg.norm(block.pos[:2] - state.pad_xy), abs=1e-4)


@pytest.mark.parametrize("dx,dy,turn_deg,on_base", [(0.008, 0.0, 25.0, True), (0.0, -0.02, 190.0, True), (0.0, 0.05, 0.0, False)])
def test_placement_says_how_far_a_stacked_block_is_from_its_base(dx, dy, turn_deg, on_base):
    """The figures behind a wrong place, against a block put down by hand at a known offset and turn."""
    from dpflow_core.sim.tasks import placement

    world = new_world("stack", 16, 16)
    reset_world(world, initial_state("stack", EVAL_SEED_BASE + 3))
    base = world.blocks[1]
    block = Block(np.array([base.pos[0] + dx, base.pos[1] + dy, 0.08]), base.yaw + math.radians(turn_deg))
    world.blocks[0] = block
    block.pos[2] = world._rest_height(block)
    got = placement(world, "stack")
    assert got["xy_m"] == pytest.approx(math.hypot(dx, dy), abs=1e-4)
    assert got["yaw_rad"] == pytest.approx(math.radians(abs(math.remainder(turn_deg, 180.0))), abs=1e-3)
    assert got["on_target"] is on_base


class _DemonstratorPolicy(_ProbePolicy):
    """Answers each decision with the scripted demonstrator's own future camera poses and widths (VIO frame)
    at the chunk's times: what a perfect policy would predict. It knows its episodes' seeds, nothing else."""

    def __init__(self, task, seeds):
        super().__init__()
        self.plans = [plan(initial_state(task, s)) for s in seeds]
        self.first, self.size = 0, 0

    def predict_action(self, obs, generator=None, frame="tcp"):
        self.calls.append(obs)
        if obs["timestamp"][0, -1] == 0:  # a new lockstep batch of episodes starts at time 0
            self.first, self.size = self.first + self.size, len(obs["timestamp"])
        t = obs["timestamp"][0, -1] + np.arange(self.horizon) * self.action_dt_s
        rows = [self._chunk(self.plans[self.first + b], t) for b in range(len(obs["timestamp"]))]
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def _chunk(self, p, t):
        idx = np.clip(np.searchsorted(p.t_s, t), 0, len(p.t_s) - 1)
        cam_pos, cam_rot = camera_poses(p.pos[idx], Rotation.from_rotvec(p.rotvec[idx]))
        c0, r0 = camera_poses(p.pos[:1], Rotation.from_rotvec(p.rotvec[:1]))
        inv = np.linalg.inv(vio_origin(c0[0], r0[0]))
        return {"robot0_eef_pos": cam_pos @ inv[:3, :3].T + inv[:3, 3],
                "robot0_eef_rot_axis_angle": (Rotation.from_matrix(inv[:3, :3]) * cam_rot).as_rotvec(),
                "robot0_gripper_width": p.opening[idx][:, None], "timestamp": t}


@pytest.mark.parametrize("task", ["pick_place", "stack"])
def test_the_demonstrators_own_chunks_through_the_loop_succeed(task):
    """The action path of a rollout (VIO frame -> world TCP targets, chunk timing, the latency drop, the
    controller): the demonstrator's future poses fed back as a policy's chunks do the task."""
    seeds = eval_seeds(6, seed=9)
    records = rollout_policy(_DemonstratorPolicy(task, seeds), task, seeds, batch=1)
    assert [r.success for r in records] == [True] * 6, [r.grasp_attempts for r in records]


def test_rollout_refuses_a_task_its_recordings_or_checkpoint_do_not_hold(stack_dataset, tmp_path):
    from typer.testing import CliRunner

    from dpflow_core.cli import app

    task_dir, _, _ = stack_dataset
    r = CliRunner().invoke(app, ["rollout", str(tmp_path / "x.ckpt"), "--task", "pick_place", "--recordings",
                                 str(task_dir), "-o", str(tmp_path / "r")])
    said = lambda res: " ".join(res.output.replace("│", " ").split())  # noqa: E731 - rich's box, unwrapped
    assert r.exit_code == 2 and "holds 'stack' demonstrations, not --task 'pick_place'" in said(r)
    r = CliRunner().invoke(app, ["rollout", str(tmp_path / "x.ckpt"), "--task", "stack", "--recordings",
                                 str(tmp_path / "nowhere"), "-o", str(tmp_path / "r")])
    assert r.exit_code == 2 and "no such folder" in said(r)
    r = CliRunner().invoke(app, ["rollout", str(tmp_path / "x.ckpt"), "--task", "stack", "--baseline-checkpoint",
                                 f"no_camera={tmp_path / 'missing.ckpt'}", "-o", str(tmp_path / "r")])
    assert r.exit_code == 2 and "expected NAME=PATH of an existing checkpoint file" in said(r)
    twice = tmp_path / "some.ckpt"
    twice.write_bytes(b"x")
    r = CliRunner().invoke(app, ["rollout", str(tmp_path / "x.ckpt"), "--task", "stack", "--baseline-checkpoint",
                                 f"a={twice}", "--baseline-checkpoint", f"a={twice}", "-o", str(tmp_path / "r")])
    assert r.exit_code == 2 and "the name 'a' is given twice" in said(r)
    assert not (tmp_path / "r").exists()


def test_a_rollout_executes_the_n_action_steps_it_is_given(tmp_path):
    """``n_action_steps`` is the robot's choice at deploy time: executing 4 of each chunk instead of the
    checkpoint's 8 decides every 0.3 s instead of every 0.7 s (the first action is past, as above), for the
    policy and for every baseline checkpoint, and is written into each record."""
    probe = _ProbePolicy()
    seeds = eval_seeds(1)
    [rec] = rollout_policy(probe, "pick_place", seeds, batch=1, n_action_steps=4)
    starts = [c["timestamp"][-1] for c in probe.calls[1:6]]
    assert np.allclose(np.diff(starts), 0.3, atol=1 / 30 + 1e-9)
    assert rec.n_action_steps == 4 and rec.decisions == len(probe.calls)
    default = _ProbePolicy()
    assert rollout_policy(default, "pick_place", seeds, batch=1)[0].n_action_steps == 8
    assert len(probe.calls) > 2 * len(default.calls) - 2  # 0.3 s apart against 0.7 s over the same 16 s
    other = _ProbePolicy()
    res = evaluate_closed_loop(_ProbePolicy(), "pick_place", tmp_path / "r",
                               ClosedLoopSettings(episodes=1, baselines=(), video_episodes=0, n_action_steps=4),
                               baseline_policies={"other": other})
    assert len(other.calls) == len(probe.calls) and res.n_action_steps == 4
    assert json.loads((tmp_path / "r" / "closed_loop.json").read_text())["n_action_steps"] == 4
    for name in ("rollouts.json", "rollouts_other.json"):
        assert json.loads((tmp_path / "r" / name).read_text())[0]["n_action_steps"] == 4
    with pytest.raises(ValueError, match="exceeds the 16 actions"):
        rollout_policy(_ProbePolicy(), "pick_place", seeds, n_action_steps=17)
    # the first of 16 actions is past (the frame is 0.1 s old): 15 lie ahead, and 16 would be recorded but not run
    with pytest.raises(ValueError, match="only 15 of the 16 predicted actions lie ahead"):
        rollout_policy(_ProbePolicy(), "pick_place", seeds, n_action_steps=16)
    assert rollout_policy(_ProbePolicy(), "pick_place", seeds, n_action_steps=15)[0].n_action_steps == 15
    # unset, every policy of a run executes the judged policy's own number, a baseline checkpoint's own aside
    own4 = _ProbePolicy()
    own4.cfg = type("cfg", (), {"n_action_steps": 4, "task": _ProbePolicy.cfg.task})
    res = evaluate_closed_loop(_ProbePolicy(), "pick_place", tmp_path / "d",
                               ClosedLoopSettings(episodes=1, baselines=(), video_episodes=0),
                               baseline_policies={"own4": own4})
    assert res.n_action_steps == 8
    assert json.loads((tmp_path / "d" / "rollouts_own4.json").read_text())[0]["n_action_steps"] == 8
    # past a horizon: refused before the results folder is made
    with pytest.raises(ValueError, match="exceeds the 16 actions policy predicts"):
        evaluate_closed_loop(_ProbePolicy(), "pick_place", tmp_path / "e", ClosedLoopSettings(episodes=1, n_action_steps=17))
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match="n_action_steps must be >= 1"):
        rollout_policy(_ProbePolicy(), "pick_place", seeds, n_action_steps=0)
