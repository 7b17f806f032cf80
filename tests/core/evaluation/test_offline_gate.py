"""The offline gate: trivial predictors fed in as the policy fail it, its numbers do not depend on the
dataset's world frame, and the decoding bugs of issue 25 (rot6d transposed, the relative pose composed
on the wrong side, the latency sign flipped) each make it see a non-zero error where the truth gives 0, on
synthetic curves and on the simulated world's recordings converted (issue 32).

The "policy" here is a real :class:`dpflow_core.inference.Policy` whose network returns the true
relative actions, computed in this file from the recorded poses with its own formulas; what is under
test is everything between that network output and the gate (decoding, latency, executed steps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation
from synthetic_dataset import synthetic_arrays

from dpflow_core.evaluation import EvaluationSettings, constant_velocity_baseline, hold_baseline, score_held_out
from dpflow_core.inference import Policy
from dpflow_core.train import data as D

FREQ = 10.0
# camera 0.2 s behind the moment the policy acts, the pose fresh: the pose is read 2 steps after the frame
CAMERA, ROBOT, GRIPPER = 0.2, 0.0, 0.2
SHIFT = 2
TX = np.array([[0.0, -1.0, 0.0, 0.02], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.12], [0.0, 0.0, 0.0, 1.0]])
N_ACTION_STEPS, HORIZON = 3, 8
TRAIN = np.array([True, True, False, True, False, True])


class Buffer(dict):
    """An in-memory replay buffer in float64 (so that a change of world frame is exact to 1e-15)."""

    def __init__(self, arrays: dict[str, np.ndarray], episode_ends: np.ndarray):
        super().__init__(arrays)
        self.episode_ends = np.asarray(episode_ends, dtype=np.int64)


def _buffer() -> Buffer:
    arr = synthetic_arrays(n_episodes=6, episode_length=40, image_size=(8, 8), frequency_hz=FREQ, seed=3)
    keys = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width", "robot0_demo_start_pose",
            "robot0_demo_end_pose")
    return Buffer({k: np.asarray(arr[f"data__{k}"], np.float64) for k in keys}, arr["meta__episode_ends"])


def _spec() -> D.ObsActionSpec:
    # through the module attribute, so that a mutated latency_steps reaches the spec
    lat = D.latency_steps(D.DEFAULT_LOWDIM_KEYS, CAMERA, ROBOT, GRIPPER, FREQ)
    return D.ObsActionSpec(rgb_keys=(), horizon=HORIZON, obs_latency_steps=lat, tx_cam_tcp=tuple(map(tuple, TX)))


def _mat(pos, rotvec) -> np.ndarray:
    m = np.zeros(pos.shape[:-1] + (4, 4))
    m[..., :3, :3] = Rotation.from_rotvec(rotvec.reshape(-1, 3)).as_matrix().reshape(pos.shape[:-1] + (3, 3))
    m[..., :3, 3], m[..., 3, 3] = pos, 1.0
    return m


def true_relative_actions(buffer: Buffer, rows: np.ndarray) -> np.ndarray:
    """``(N, H, 10)``: each recorded TCP action in the frame of the TCP pose the policy acts from
    (the pose SHIFT steps after the anchor frame), rot6d = the first two columns of R."""
    pos, rot, grip = (buffer[k] for k in ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width"))
    out = []
    for anchor, start, end in rows:
        now = min(anchor + SHIFT, end - 1)
        base = _mat(pos[now], rot[now]) @ TX
        idx = np.minimum(anchor + np.arange(HORIZON), end - 1)
        rel = np.linalg.inv(base) @ (_mat(pos[idx], rot[idx]) @ TX)
        out.append(np.concatenate([rel[:, :3, 3], rel[:, :3, 0], rel[:, :3, 1], grip[idx]], axis=1))
    return np.stack(out)


class ReplayNetwork(torch.nn.Module):
    """Returns, call after call, the next rows of fixed network actions (what ``predict_samples`` asks in order)."""

    n_action_steps = N_ACTION_STEPS

    def __init__(self, actions: np.ndarray):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.actions, self.served = actions, 0

    def predict_action(self, obs, generator=None):
        n = len(next(iter(obs.values())))
        chunk = self.actions[self.served : self.served + n]
        self.served += n
        return {"action_pred": torch.from_numpy(chunk)}


def oracle_predict(buffer: Buffer, spec: D.ObsActionSpec, perturb: np.ndarray | None = None):
    """A predictor through a real Policy whose network answers the true relative actions (optionally
    composed with a fixed relative perturbation ``(4, 4)``: an imperfect policy that is still equivariant)."""

    def predict(rows):
        net = true_relative_actions(buffer, rows)
        if perturb is not None:
            m = np.zeros(net.shape[:-1] + (4, 4))
            m[..., :3, 0], m[..., :3, 1] = net[..., 3:6], net[..., 6:9]
            m[..., :3, 2] = np.cross(net[..., 3:6], net[..., 6:9])
            m[..., :3, 3], m[..., 3, 3] = net[..., :3], 1.0
            m = m @ perturb
            net = np.concatenate([m[..., :3, 3], m[..., :3, 0], m[..., :3, 1], net[..., 9:] + 0.004], axis=-1)
        policy = Policy(ReplayNetwork(net), spec, {}, FREQ, {}, None)
        return policy.predict_samples(buffer, rows, batch_size=7)

    return predict


def _score(buffer, spec, predict, **kw):
    return score_held_out(predict, buffer, spec, TRAIN, ~TRAIN, frequency_hz=FREQ, n_action_steps=N_ACTION_STEPS,
                          latency_s=CAMERA, resamples=400,
                          settings=EvaluationSettings(max_samples_per_episode=None, **kw))


def test_hold_and_constant_velocity_fed_in_as_the_policy_fail_the_gate_and_the_truth_passes():
    buffer, spec = _buffer(), _spec()
    truth = _score(buffer, spec, oracle_predict(buffer, spec))
    assert truth.steps.tolist() == [3, 4, 5]  # 0.2 s latency at 0.1 s per action: steps 0-2 are past
    assert all(c["passed"] for c in truth.gate.values()), truth.gate
    for name, baseline in (("hold", hold_baseline), ("constant_velocity", constant_velocity_baseline)):
        for margin in (0.2, 0.0):
            s = _score(buffer, spec, lambda rows: baseline(buffer, spec, rows), margin=margin)
            gate = s.gate
            assert not all(c["passed"] for c in gate.values()), (name, margin, gate)
            for crit in ("position_error_m", "rotation_error_rad"):  # equal to itself is no improvement
                assert gate[crit]["policy"] == pytest.approx(gate[crit]["baselines"][name], rel=1e-12)
                assert gate[crit]["improvement"] <= 1e-12 and not gate[crit]["passed"]
    # on this smooth synthetic arc constant velocity is far better than holding: the bar it sets is high
    cv = truth.gate["position_error_m"]
    assert cv["best_baseline"] == "constant_velocity" and cv["baseline"] < 0.2 * cv["baselines"]["hold"]


def _moved_world(buffer: Buffer) -> Buffer:
    """Every pose of the buffer (poses, start and end poses) re-expressed in another world frame."""
    w = _mat(np.array([0.7, -1.3, 0.4]), np.array([0.3, -2.1, 1.2]))
    out = Buffer(dict(buffer), buffer.episode_ends)

    def move(pos, rot):
        m = w @ _mat(pos, rot)
        return m[:, :3, 3], Rotation.from_matrix(m[:, :3, :3]).as_rotvec()

    out["robot0_eef_pos"], out["robot0_eef_rot_axis_angle"] = move(buffer["robot0_eef_pos"], buffer["robot0_eef_rot_axis_angle"])
    for key in ("robot0_demo_start_pose", "robot0_demo_end_pose"):
        p, r = move(buffer[key][:, :3], buffer[key][:, 3:])
        out[key] = np.concatenate([p, r], axis=1)
    return out


def test_every_gated_number_is_invariant_to_the_world_frame():
    buffer, spec = _buffer(), _spec()
    moved = _moved_world(buffer)
    assert np.abs(moved["robot0_eef_pos"] - buffer["robot0_eef_pos"]).max() > 0.5
    perturb = _mat(np.array([0.003, -0.002, 0.004]), np.array([0.02, -0.01, 0.015]))
    predictors = {
        "imperfect oracle": lambda b: oracle_predict(b, spec, perturb),
        "hold": lambda b: (lambda rows: hold_baseline(b, spec, rows)),
        "constant velocity": lambda b: (lambda rows: constant_velocity_baseline(b, spec, rows)),
    }
    for label, make in predictors.items():
        a, b = _score(buffer, spec, make(buffer)), _score(moved, spec, make(moved))
        assert a.gate.keys() == b.gate.keys() == {"position_error_m", "rotation_error_rad", "gripper_events"}
        for crit, ca in a.gate.items():
            cb = b.gate[crit]
            assert ca["best_baseline"] == cb["best_baseline"] and ca["passed"] == cb["passed"], (label, crit)
            figures = [ca["policy"], ca["baseline"], ca["required"], ca["improvement"], *ca["policy_ci95"],
                       *ca["improvement_ci95"], *ca["baselines"].values()]
            moved_figures = [cb["policy"], cb["baseline"], cb["required"], cb["improvement"], *cb["policy_ci95"],
                             *cb["improvement_ci95"], *cb["baselines"].values()]
            assert np.allclose(figures, moved_figures, rtol=0, atol=1e-9, equal_nan=True), (label, crit)
        assert a.gate["position_error_m"]["policy"] > 5e-4  # the imperfect oracle and the baselines err visibly
        # the 7-D MSE is not invariant, which is why it is not gated
        assert abs(a.metrics["policy"].mse_per_key["rotation"] - b.metrics["policy"].mse_per_key["rotation"]) > 1e-7


def _transposed_rot6d(decode):
    def mutated(net, base, spec, frame="dataset"):
        a = np.array(net, dtype=np.float64)
        r = D.P.rot6d_to_mat3(a[..., 3:9])
        a[..., 3:9] = D.P.mat3_to_rot6d(np.swapaxes(r, -1, -2))  # rows read as columns
        return decode(a, base, spec, frame)
    return mutated


def _wrong_side(decode):
    def mutated(net, base, spec, frame="dataset"):
        a = np.asarray(net, dtype=np.float64)
        rel = np.zeros(a.shape[:-1] + (4, 4))
        rel[..., :3, :3], rel[..., :3, 3], rel[..., 3, 3] = D.P.rot6d_to_mat3(a[..., 3:9]), a[..., :3], 1.0
        mat = rel @ np.asarray(base)[:, None]  # rel @ base instead of base @ rel
        mat = D.P.apply_tx(mat, np.linalg.inv(spec.tx))
        return np.concatenate([D.P.mat_to_pose(mat), a[..., 9:10]], axis=-1)
    return mutated


def _flipped_latency(latency_steps):
    def mutated(*args, **kwargs):
        return {k: -v for k, v in latency_steps(*args, **kwargs).items()}
    return mutated


def assert_decodes_the_truth(scores) -> None:
    """What the evaluation must see for a network that outputs the true relative actions: no error."""
    assert scores.gate["position_error_m"]["policy"] < 1e-9
    assert scores.gate["rotation_error_rad"]["policy"] < 1e-7
    assert scores.metrics["policy"].gripper_events_false == 0


MUTATIONS = [None, "rot6d transposed", "relative pose on the wrong side", "latency sign flipped"]


def mutate(monkeypatch, mutation: str | None) -> None:
    """Put one decoding bug of :data:`MUTATIONS` into the training module (None: none)."""
    if mutation == "rot6d transposed":
        monkeypatch.setattr(D, "decode_action", _transposed_rot6d(D.decode_action))
    elif mutation == "relative pose on the wrong side":
        monkeypatch.setattr(D, "decode_action", _wrong_side(D.decode_action))
    elif mutation == "latency sign flipped":
        monkeypatch.setattr(D, "latency_steps", _flipped_latency(D.latency_steps))


def assert_sees(scores, mutation: str | None) -> None:
    """No error for the truth; for a mutation, an error that is clearly wrong, not rounding: millimetres
    or milliradians at least."""
    if mutation is None:
        assert_decodes_the_truth(scores)
        return
    with pytest.raises(AssertionError):
        assert_decodes_the_truth(scores)
    assert max(scores.gate["position_error_m"]["policy"], scores.gate["rotation_error_rad"]["policy"]) > 1e-3, mutation


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_decoding_mutation_makes_the_evaluation_see_an_error(monkeypatch, mutation):
    mutate(monkeypatch, mutation)
    buffer, spec = _buffer(), _spec()
    scores = _score(buffer, spec, oracle_predict(buffer, spec))
    assert_sees(scores, mutation)
    if mutation is None:
        assert all(c["passed"] for c in scores.gate.values())


@pytest.fixture(scope="module")
def world_buffer(tmp_path_factory) -> Buffer:
    """Six pick_place demonstrations of the simulated world, paired and converted at 30 Hz (64 x 64 camera,
    32 x 32 frames), every third row read back in float64 (10 Hz, this file's rate): real grasps, turns and
    carries instead of synthetic curves. (A 32-pixel camera, or one at 10 Hz, moves too coarsely for
    conversion's camera-pose check; eight are recorded for the six, as conversion may refuse one.)"""
    from dpflow_core.conversion import ConversionSettings, convert
    from dpflow_core.pairing import pair_recordings, save_manifest
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.sim.record import SimRecordingSpec, record_task

    root = tmp_path_factory.mktemp("world")
    step = 3
    task_dir = record_task(root / "rec", "pick_place", len(TRAIN) + 2, seed=11,
                           spec=SimRecordingSpec(fps=FREQ * step, width=64, height=64))
    manifest, _ = save_manifest(pair_recordings(task_dir), root)
    out = convert(manifest, root / "dataset.npz", ConversionSettings(image_size=(32, 32)))
    assert out.frequency_hz == pytest.approx(FREQ * step, rel=1e-2) and out.n_episodes >= len(TRAIN)
    rb = ReplayBuffer(out.path)
    starts = np.concatenate([[0], rb.episode_ends[:-1]])
    rows = [np.arange(a, b, step) for a, b in zip(starts, rb.episode_ends)][: len(TRAIN)]
    keys = ("robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width")
    return Buffer({k: np.asarray(rb[k], np.float64)[np.concatenate(rows)] for k in keys},
                  np.cumsum([len(r) for r in rows]))


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_decoding_mutation_makes_the_evaluation_see_an_error_on_the_worlds_recordings(
        monkeypatch, world_buffer, mutation):
    mutate(monkeypatch, mutation)
    spec = _spec()
    assert_sees(_score(world_buffer, spec, oracle_predict(world_buffer, spec)), mutation)
