"""Offline evaluation on held-out episodes: baselines and metrics against closed-form ground truth,
the gate's criteria and bootstrap, untrained policies and constant velocity failing it (sample and
epsilon prediction), refusals, plots. tests/core/evaluation/test_offline_gate.py holds the world-frame and decoding tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.spatial.transform import Rotation
from conftest import train_in_process
from synthetic_dataset import synthetic_arrays, write_npz, write_synthetic_dataset

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.evaluation import (
    ABS_ACTION_KEYS,
    EvaluationSettings,
    GATE_BASELINES,
    PREDICTORS,
    SampleErrors,
    constant_velocity_baseline,
    evaluate_checkpoint,
    fit_mean_relative_action,
    gate_criteria,
    geodesic_error,
    gripper_event_errors,
    held_out_split,
    hold_baseline,
    mean_relative_baseline,
    read_loss_curve,
    score_predictions,
    threshold_crossings,
)
from dpflow_core.train.data import ObsActionSpec, action_indices, sequence_index, split_episodes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def spec_for(horizon=5, n_obs_steps=2, latency=None, obs_ds=1, action_ds=1) -> ObsActionSpec:
    return ObsActionSpec(
        rgb_keys=(), lowdim_keys=ABS_ACTION_KEYS, action_keys=ABS_ACTION_KEYS, n_obs_steps=n_obs_steps,
        horizon=horizon, obs_down_sample_steps=obs_ds, action_down_sample_steps=action_ds,
        obs_latency_steps=latency or {},
    )


def one_episode(pos, rot, grip) -> tuple[dict[str, np.ndarray], np.ndarray]:
    buffer = {
        "robot0_eef_pos": np.asarray(pos, np.float64),
        "robot0_eef_rot_axis_angle": np.asarray(rot, np.float64),
        "robot0_gripper_width": np.asarray(grip, np.float64).reshape(-1, 1),
    }
    return buffer, np.array([len(pos)], dtype=np.int64)


def recorded(buffer, spec, rows):
    idx = np.stack([action_indices(spec, *r) for r in rows])
    return np.concatenate([buffer[k][idx] for k in ABS_ACTION_KEYS], axis=-1)


# A uniform motion: linear in position and width, constant angular velocity (world frame) from a
# rotation far from the identity.
T = 30
V = np.array([0.004, -0.002, 0.001])  # m per step
OMEGA = np.array([0.0, 0.05, 0.02])  # rad per step (world frame)
R0 = Rotation.from_rotvec([1.2, -0.4, 0.9])
GV = 0.001  # m per step
steps = np.arange(T, dtype=np.float64)
UNIFORM = one_episode(
    0.3 + steps[:, None] * V,
    (Rotation.from_rotvec(steps[:, None] * OMEGA) * R0).as_rotvec(),
    0.02 + GV * steps,
)


def test_constant_velocity_is_exact_on_uniform_motion_rotations_composed_on_so3():
    buffer, ends = UNIFORM
    spec = spec_for()
    rows = sequence_index(ends, np.array([True]), spec)[1:]  # anchor 0 has no previous observation
    truth = recorded(buffer, spec, rows)
    cv = constant_velocity_baseline(buffer, spec, rows)
    assert np.abs(cv[..., :3] - truth[..., :3]).max() < 1e-12 and np.abs(cv[..., 6] - truth[..., 6]).max() < 1e-12
    assert geodesic_error(cv[..., 3:6], truth[..., 3:6]).max() < 1e-9
    # Extrapolating rotation vectors as if they were vectors is measurably wrong on the same data.
    rv = buffer["robot0_eef_rot_axis_angle"]
    a = rows[:, 0]
    k = np.arange(spec.horizon)
    naive = rv[a][:, None] + k[None, :, None] * (rv[a] - rv[a - 1])[:, None]
    assert geodesic_error(naive, truth[..., 3:6]).max() > 1e-3
    m = score_predictions(cv, truth, gripper_threshold_m=0.03, step_s=0.1)
    assert m.mse < 1e-20 and m.rotation_error_rad < 1e-9
    # At the episode start both observations are the first frame: constant velocity holds.
    first = sequence_index(ends, np.array([True]), spec)[:1]
    assert np.allclose(constant_velocity_baseline(buffer, spec, first), hold_baseline(buffer, spec, first))


def test_hold_errors_grow_linearly_with_the_horizon_step_and_follow_the_latency():
    buffer, ends = UNIFORM
    spec = spec_for(horizon=6)
    rows = sequence_index(ends, np.array([True]), spec)
    truth = recorded(buffer, spec, rows)
    hold = hold_baseline(buffer, spec, rows)
    m = score_predictions(hold, truth, gripper_threshold_m=0.5, step_s=0.1)
    k = np.arange(6)
    assert np.allclose(m.position_error_m_per_step, k * np.linalg.norm(V), atol=1e-12)
    assert np.allclose(m.rotation_error_rad_per_step, k * np.linalg.norm(OMEGA), atol=1e-9)
    assert m.gripper_error_m == pytest.approx(GV * k.mean(), abs=1e-12)
    assert m.mse_per_key["position"] == pytest.approx(np.mean(k**2) * np.sum(V**2) / 3, rel=1e-9)
    assert m.mse_per_key["gripper"] == pytest.approx(np.mean(k**2) * GV**2, rel=1e-9)

    # The position read 2 steps after the camera frame (UMI: the robot's state is fresher than the
    # image): the hold error of step k is |k - 2| steps of motion.
    late = spec_for(horizon=6, latency={"robot0_eef_pos": 2})
    rows = sequence_index(ends, np.array([True]), late)[2:]
    m = score_predictions(hold_baseline(buffer, late, rows), recorded(buffer, late, rows), gripper_threshold_m=0.5, step_s=0.1)
    assert np.allclose(m.position_error_m_per_step, np.abs(k - 2) * np.linalg.norm(V), atol=1e-12)
    assert np.allclose(m.rotation_error_rad_per_step, k * np.linalg.norm(OMEGA), atol=1e-9)


def test_constant_velocity_error_on_accelerated_motion_is_c_k_k_plus_1():
    c = np.array([1e-4, -2e-4, 5e-5])
    buffer, ends = one_episode(steps[:, None] ** 2 * c, np.tile([0.1, 0.2, 0.3], (T, 1)), np.full(T, 0.05))
    spec = spec_for(horizon=7, action_ds=2, obs_ds=2)  # strides of 2: s = 2k / 2 observation intervals
    rows = sequence_index(ends, np.array([True]), spec)
    rows = rows[rows[:, 0] >= 2]
    err = constant_velocity_baseline(buffer, spec, rows)[..., :3] - recorded(buffer, spec, rows)[..., :3]
    # action j = a + 2k, observations a and a - 2, x = c t^2: error -c((a+2k)^2 - a^2 - k(a^2 - (a-2)^2)) = -4c(k^2 + k)
    k = np.arange(7)
    assert np.allclose(err, -4 * c[None, None, :] * (k**2 + k)[None, :, None], atol=1e-15)


def test_geodesic_error_of_known_rotations_including_near_pi():
    rng = np.random.default_rng(0)
    base = Rotation.random(6, random_state=1)
    angles = np.array([0.0, 1e-4, 0.5, 2.0, np.pi - 1e-3, np.pi - 1e-7])
    axes = rng.normal(size=(6, 3))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    other = base * Rotation.from_rotvec(axes * angles[:, None])
    assert np.allclose(geodesic_error(base.as_rotvec(), other.as_rotvec()), angles, atol=1e-6)
    # (pi - e) n and -(pi - e) n are 2e apart on SO(3), though their vectors differ by about 2 pi.
    e = 1e-3
    n = np.array([0.0, 0.6, 0.8])
    assert geodesic_error((np.pi - e) * n, -(np.pi - e) * n) == pytest.approx(2 * e, abs=1e-9)


def test_gripper_events_and_their_timing_error():
    step = 0.1
    ramp = np.linspace(0.02, 0.06, 9)  # 0.005 m per step: crosses 0.0425 at step 4.5
    assert threshold_crossings(ramp, 0.0425, step) == [(pytest.approx(0.45), 1)]
    assert threshold_crossings(ramp[::-1], 0.0425, step) == [(pytest.approx(0.35), -1)]
    shifted = np.clip(ramp - 0.0075, 0.02, None)  # 1.5 steps later
    out = gripper_event_errors(shifted[None], ramp[None], 0.0425, step)
    assert out["events"] == out["matched"] == 1 and out["false"] == 0
    assert out["timing_error_s"] == pytest.approx(0.15)
    # A held width never crosses: the event is missed; the wrong direction does not match.
    held = gripper_event_errors(np.full((1, 9), 0.02), ramp[None], 0.0425, step)
    assert (held["events"], held["matched"], held["missed"], held["false"]) == (1, 0, 1, 0) and np.isnan(held["timing_error_s"])
    wrong = gripper_event_errors(ramp[::-1][None], ramp[None], 0.0425, step)
    assert (wrong["matched"], wrong["missed"], wrong["false"]) == (0, 1, 1)


def test_mean_relative_action_is_exact_on_motion_uniform_in_the_gripper_frame():
    # T_t = T_0 D^t: every sample's action k, seen from its current pose, is D^k whatever the world
    # does, so the training mean is D^k and applied to the current pose it is the truth.
    step = np.eye(4)
    step[:3, :3] = Rotation.from_rotvec([0.01, 0.04, -0.03]).as_matrix()
    step[:3, 3] = [0.003, -0.001, 0.002]
    t0 = np.eye(4)
    t0[:3, :3], t0[:3, 3] = R0.as_matrix(), [0.3, -0.2, 0.5]
    mats = [t0]
    for _ in range(T - 1):
        mats.append(mats[-1] @ step)
    mats = np.stack(mats)
    buffer, ends = one_episode(mats[:, :3, 3], Rotation.from_matrix(mats[:, :3, :3]).as_rotvec(), 0.02 + GV * steps)
    spec = spec_for(horizon=6)
    rows = sequence_index(ends, np.array([True]), spec)
    mean = fit_mean_relative_action(buffer, spec, rows)
    for k in range(6):
        dk = np.linalg.matrix_power(step, k)
        assert np.allclose(mean[k, :3], dk[:3, 3], atol=1e-12) and mean[k, 6] == pytest.approx(k * GV, abs=1e-12)
        assert geodesic_error(mean[k, 3:6], Rotation.from_matrix(dk[:3, :3]).as_rotvec()) < 1e-9
    pred = mean_relative_baseline(buffer, spec, rows, mean)
    truth = recorded(buffer, spec, rows)
    assert np.abs(pred[..., :3] - truth[..., :3]).max() < 1e-12 and np.abs(pred[..., 6] - truth[..., 6]).max() < 1e-12
    assert geodesic_error(pred[..., 3:6], truth[..., 3:6]).max() < 1e-9
    # the same motion is not uniform in the world frame: constant velocity (world frame) is not exact
    cv = constant_velocity_baseline(buffer, spec, rows[1:])
    assert np.abs(cv[..., :3] - truth[1:, :, :3]).max() > 1e-4


def _errors(pos_by_episode, rot_by_episode=None, events=None):
    """SampleErrors of one sample per episode, each with one step of the given errors."""
    pos = np.asarray(pos_by_episode, np.float64)[:, None]
    rot = pos if rot_by_episode is None else np.asarray(rot_by_episode, np.float64)[:, None]
    ev, matched, false = (np.zeros(len(pos), np.int64),) * 3 if events is None else (np.asarray(v, np.int64) for v in events)
    return SampleErrors(pos, rot, ev, matched, false)


def _gate(policy, hold, cv, mean, margin=0.2, episodes=None):
    errors = {"policy": policy, "hold": hold, "constant_velocity": cv, "mean_relative": mean}
    return gate_criteria(errors, np.arange(len(policy.events)) if episodes is None else episodes, GATE_BASELINES, margin, resamples=2000)


def test_the_gate_needs_the_margin_below_the_best_baseline_criterion_by_criterion():
    hold, cv, mean = _errors([1.0, 1.0], [0.5, 0.5]), _errors([0.1, 0.1], [2.0, 2.0]), _errors([3.0, 3.0])
    g = _gate(_errors([0.079, 0.079], [0.39, 0.39]), hold, cv, mean)
    assert g["position_error_m"]["best_baseline"] == "constant_velocity" and g["position_error_m"]["required"] == pytest.approx(0.08)
    assert g["rotation_error_rad"]["best_baseline"] == "hold" and g["rotation_error_rad"]["required"] == pytest.approx(0.4)
    assert g["position_error_m"]["passed"] and g["rotation_error_rad"]["passed"]
    assert g["position_error_m"]["improvement"] == pytest.approx(0.21)
    # 0.081 m: beats hold and the mean by far, but not constant velocity by 20 %
    g = _gate(_errors([0.081, 0.081], [0.39, 0.39]), hold, cv, mean)
    assert not g["position_error_m"]["passed"] and g["rotation_error_rad"]["passed"]
    assert not _gate(_errors([np.nan, np.nan]), hold, cv, mean)["position_error_m"]["passed"]
    assert _gate(_errors([0.099, 0.099], [0.49, 0.49]), hold, cv, mean, margin=0.0)["position_error_m"]["passed"]
    assert not _gate(_errors([0.1, 0.1], [0.5, 0.5]), hold, cv, mean, margin=0.0)["position_error_m"]["passed"]


def test_gripper_events_criterion_counts_matched_minus_false():
    zero = _errors([1.0, 1.0])
    # 4 recorded events over two episodes; hold matches none (error 4), constant velocity 2 with 1 false (error 3)
    hold = _errors([1.0, 1.0], events=([2, 2], [0, 0], [0, 0]))
    cv = _errors([1.0, 1.0], events=([2, 2], [1, 1], [1, 0]))
    mean = _errors([1.0, 1.0], events=([2, 2], [0, 0], [3, 3]))
    g = _gate(_errors([0.1, 0.1], events=([2, 2], [2, 1], [0, 0])), hold, cv, mean)["gripper_events"]
    assert g["events"] == 4 and g["policy"] == 3 and g["best_baseline"] == "constant_velocity" and g["baseline"] == 1
    # error 1 against 3: improvement 2/3; the score must exceed 1 + 0.2 x (4 - 1)
    assert g["improvement"] == pytest.approx(2 / 3) and g["required"] == pytest.approx(1.6) and g["passed"]
    assert g["baselines"] == {"hold": 0, "constant_velocity": 1, "mean_relative": -6}
    # matching events while inventing as many is no better than holding still
    assert not _gate(_errors([0.1, 0.1], events=([2, 2], [2, 2], [2, 2])), hold, cv, mean)["gripper_events"]["passed"]
    # no recorded event: a best baseline with no false event can only be matched, by inventing none
    assert _gate(_errors([0.1, 0.1]), zero, zero, zero)["gripper_events"]["passed"]
    assert not _gate(_errors([0.1, 0.1], events=([0, 0], [0, 0], [1, 0])), zero, zero, zero)["gripper_events"]["passed"]


def test_bootstrap_resamples_episodes_not_samples():
    # episode 0: three samples of error 1, episode 1: one sample of error 3 (per-step means 1.5 overall).
    # Resampling the 2 episodes gives {0, 0} (p 1/4), {0, 1} (1/2), {1, 1} (1/4): figures 1, 1.5, 3.
    policy = _errors([1.0, 1.0, 1.0, 3.0])
    flat = _errors([10.0] * 4)
    g = _gate(policy, flat, flat, flat, episodes=np.array([0, 0, 0, 1]))["position_error_m"]
    assert g["policy"] == pytest.approx(1.5)
    assert g["policy_ci95"] == [pytest.approx(1.0), pytest.approx(3.0)]
    assert g["improvement_ci95"] == [pytest.approx(0.7), pytest.approx(0.9)]
    flat = _errors([10.0, 10.0])
    same = _gate(_errors([2.0, 2.0]), flat, flat, flat, episodes=np.array([0, 1]))["position_error_m"]
    assert same["policy_ci95"] == [pytest.approx(2.0), pytest.approx(2.0)]
    with pytest.raises(ValueError, match="margin"):
        _gate(_errors([2.0, 2.0]), flat, flat, flat, margin=1.0)


def test_held_out_split_refusals_and_every_shipped_config_holds_out_enough():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with pytest.raises(RunError) as err:
        held_out_split(OmegaConf.create({"task": {"val_ratio": 0.25, "split_seed": 1}}), 1)
    assert err.value.code == "no_held_out_episodes" and "evaluation needs held-out episodes" in err.value.reason
    assert "1 episode" in err.value.reason
    with pytest.raises(RunError) as err:
        held_out_split(OmegaConf.create({"task": {"val_ratio": 0.0, "split_seed": 1}}), 4)
    assert err.value.code == "no_held_out_episodes"
    with pytest.raises(RunError) as err:  # an older checkpoint's split: one episode of four
        held_out_split(OmegaConf.create({"task": {"val_ratio": 0.25, "split_seed": 1}}), 4)
    assert err.value.code == "too_few_held_out_episodes" and "out 1 of 4" in err.value.reason

    from dpflow_core.train.app import CONFIG_DIR

    names = sorted(p.stem for p in Path(CONFIG_DIR).glob("*.yaml"))
    assert {"demo", "tiny", "train_diffusion_unet_image"} <= set(names)
    for name in names:
        with initialize_config_dir(config_dir=str(CONFIG_DIR)):
            cfg = compose(name, overrides=["task.dataset_path=x"])
        for n in range(3, 201):
            _, val = held_out_split(cfg, n)
            assert val.sum() >= 2 and val.sum() >= round(0.1 * n) and val.sum() < n, (name, n, val.sum())


# End to end on checkpoints of untrained policies --------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    # 5 episodes: round(5 x 0.25) = 1, so task.val_min_episodes=2 decides the split.
    path = tmp_path_factory.mktemp("data") / "dataset.npz"
    return write_synthetic_dataset(path, n_episodes=5, episode_length=40, image_size=(32, 32), frequency_hz=10.0)


UNTRAINED = ("optimizer.lr=0.0", "training.num_epochs=1", "training.max_train_steps=1", "training.max_val_steps=1")


@pytest.fixture(scope="module", params=["sample", "epsilon"])
def untrained(request, tmp_path_factory, dataset) -> Path:
    """The tiny config's policy with its initial weights (lr 0), saved as a trainer checkpoint."""
    run_dir = tmp_path_factory.mktemp("run") / request.param
    return train_in_process(dataset, run_dir, *UNTRAINED, f"policy.noise_scheduler.prediction_type={request.param}", config="tiny")


def test_an_untrained_policy_fails_the_gate(untrained, dataset, tmp_path):
    result = evaluate_checkpoint(untrained, dataset, tmp_path / "eval", EvaluationSettings(max_samples_per_episode=10))
    assert not result.beats_baseline, result.markdown_table()
    assert {"position_error_m", "rotation_error_rad"} <= set(result.failed_criteria)
    # tiny config: horizon 8, n_action_steps 4, latency 0: steps 1-4 run, a chunk every 4 steps,
    # anchors 0, 4, ..., 32 of each 40-step episode
    assert result.executed_steps == (1, 2, 3, 4) and result.n_samples == 18 and result.n_episodes == 2


def test_metrics_against_independent_computation(untrained, dataset, tmp_path):
    import torch

    from dpflow_core.replay_buffer import ReplayBuffer

    log = untrained.parent.parent / "logs.json.txt"
    result = evaluate_checkpoint(untrained, dataset, tmp_path / "eval", EvaluationSettings(max_samples_per_episode=None), log_path=log)

    train_mask, val_mask = split_episodes(5, 0.25, 42, min_val_episodes=2)  # task tiny: val_ratio, split_seed
    assert val_mask.sum() == 2
    assert result.held_out_episodes == tuple(np.flatnonzero(val_mask)) and result.train_episodes == 3
    assert result.n_samples == 18 and result.n_episodes == 2 and result.horizon == 8
    assert result.step_s == pytest.approx(0.1) and result.latency_s == 0.0 and result.n_action_steps == 4
    assert result.dataset_sha256 == result.recorded_dataset_sha256 == hashlib.sha256(dataset.read_bytes()).hexdigest()

    # The trainer split the same way: its normaliser was fit on exactly these training episodes.
    buf = ReplayBuffer(dataset)
    train_steps = np.concatenate([np.arange(buf.episode_slice(e).start, buf.episode_slice(e).stop) for e in np.flatnonzero(train_mask)])
    raw = np.concatenate([np.asarray(buf[k][train_steps], np.float64) for k in ABS_ACTION_KEYS], axis=1)
    from dpflow_core.inference import load_policy
    from dpflow_core.train.data import normalizer_stats

    normalizer = torch.load(untrained, weights_only=True)["normalizer"]["action"]
    expected = normalizer_stats(buf, load_policy(untrained).spec, train_mask)["action"]["mean"]
    assert np.allclose(normalizer["mean"].numpy(), expected, atol=1e-6)
    assert not np.allclose(expected, normalizer_stats(buf, load_policy(untrained).spec)["action"]["mean"], atol=1e-6)
    assert result.gripper_threshold_m == pytest.approx((raw[:, 6].min() + raw[:, 6].max()) / 2)

    # Hold recomputed here from the raw arrays, chunk by chunk: anchors 0, 4, ..., 32 of each held-out
    # episode, executed steps 1-4 (latency 0: step 0 is now), the pose of the anchor held.
    hold_sq, hold_pos, hold_rot = [], [], []
    for e in np.flatnonzero(val_mask):
        sl = buf.episode_slice(e)
        actions = np.concatenate([np.asarray(buf[k][sl], np.float64) for k in ABS_ACTION_KEYS], axis=1)
        for a in range(0, 33, 4):
            future = actions[a + 1 : a + 5]
            hold_sq.append((future - actions[a]) ** 2)
            hold_pos.append(np.linalg.norm(future[:, :3] - actions[a, :3], axis=1))
            hold_rot.append((Rotation.from_rotvec(future[:, 3:6]).inv() * Rotation.from_rotvec(actions[a, 3:6])).magnitude())
    assert result.mse("hold") == pytest.approx(np.mean(hold_sq), rel=1e-9)
    gate = result.gate
    assert gate["position_error_m"]["baselines"]["hold"] == pytest.approx(np.mean(hold_pos), rel=1e-9)
    assert gate["rotation_error_rad"]["baselines"]["hold"] == pytest.approx(np.mean(hold_rot), rel=1e-6)
    assert result.metrics["hold"]["position_error_m_per_step"][0] > 0  # step 0 (trivially 0 for hold) is not scored
    assert gate["position_error_m"]["best_baseline"] == "constant_velocity"  # a smooth synthetic arc
    for name in PREDICTORS:
        m = result.metrics[name]
        assert m["mse"] == pytest.approx(np.mean(m["mse_per_dim"])) == pytest.approx(np.mean(m["mse_per_step"]))
        gated = gate["position_error_m"]["policy"] if name == "policy" else gate["position_error_m"]["baselines"][name]
        assert m["position_error_m"] == pytest.approx(gated, rel=1e-12)
    for name, c in gate.items():
        assert c["passed"] == (c["improvement"] > 0.2), name
        lo, hi = c["policy_ci95"]
        assert lo <= c["policy"] <= hi, name
    assert result.beats_baseline == all(c["passed"] for c in gate.values())

    for plot in (result.trajectory_plot, result.error_plot, result.loss_plot):
        data = Path(plot).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000
    saved = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert saved["hold_mse"] == result.mse("hold") and saved["beats_baseline"] == result.beats_baseline
    assert saved["gate"]["position_error_m"]["policy"] == gate["position_error_m"]["policy"]
    assert json.dumps(type(result).from_dict(saved).to_dict(), sort_keys=True) == json.dumps(result.to_dict(), sort_keys=True)
    assert len(read_loss_curve(log)["epoch_train_loss"]) == 1
    with pytest.raises(RunError) as err:  # results are never overwritten unless asked
        evaluate_checkpoint(untrained, dataset, tmp_path / "eval")
    assert err.value.code == "exists"


@pytest.mark.parametrize("untrained", ["sample"], indirect=True)
def test_the_gate_passes_the_truth_and_fails_constant_velocity_fed_in_as_the_policy(untrained, dataset, tmp_path, monkeypatch):
    """The swap point returns the recorded actions (passes), then constant velocity's (fails)."""
    from dpflow_core.evaluation import absolute_actions, action_index_matrix
    from dpflow_core.evaluation import evaluate as ev

    def truth(policy, buffer, rows, **_):
        return absolute_actions(buffer, action_index_matrix(policy.spec, rows))

    monkeypatch.setattr(ev, "predict_absolute_actions", truth)
    result = ev.evaluate_checkpoint(untrained, dataset, tmp_path / "eval", EvaluationSettings(max_samples_per_episode=6))
    assert result.beats_baseline, result.markdown_table()
    assert result.gate["position_error_m"]["policy"] == 0.0 and result.gate["rotation_error_rad"]["policy"] < 1e-7

    monkeypatch.setattr(ev, "predict_absolute_actions", lambda policy, buffer, rows, **_: constant_velocity_baseline(buffer, policy.spec, rows))
    result = ev.evaluate_checkpoint(untrained, dataset, tmp_path / "eval_cv", EvaluationSettings(max_samples_per_episode=6))
    assert not result.beats_baseline and "position_error_m" in result.failed_criteria
    assert "[FAIL]" not in result.verdict() and "position_error_m" in result.verdict() and "FAIL" in result.verdict()


@pytest.mark.parametrize("untrained", ["sample"], indirect=True)
def test_refuses_a_dataset_with_another_sha256(untrained, dataset, tmp_path):
    import torch

    # Same episode and step counts, other content: only the hash tells them apart.
    other = write_npz(tmp_path / "other.npz", synthetic_arrays(n_episodes=5, episode_length=40, image_size=(32, 32), seed=7))
    want = hashlib.sha256(dataset.read_bytes()).hexdigest()
    got = hashlib.sha256(other.read_bytes()).hexdigest()
    with pytest.raises(DatasetError) as err:
        evaluate_checkpoint(untrained, other, tmp_path / "eval")
    assert err.value.code == "dataset_mismatch" and want in err.value.reason and got in err.value.reason

    # A checkpoint without the hash: the downloaded run record's is used.
    payload = torch.load(untrained, weights_only=True)
    del payload["dataset"]["sha256"]
    (tmp_path / "dl").mkdir()
    torch.save(payload, tmp_path / "dl" / "latest.ckpt")
    (tmp_path / "dl" / "run_record.json").write_text(json.dumps({"dataset": {"sha256": want}}))
    with pytest.raises(DatasetError) as err:
        evaluate_checkpoint(tmp_path / "dl" / "latest.ckpt", other, tmp_path / "eval")
    assert want in err.value.reason and got in err.value.reason and "run_record.json" in err.value.reason
