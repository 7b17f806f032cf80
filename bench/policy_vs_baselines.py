"""Benchmark: a checkpoint's held-out action error against trivial predictors (not a test).

On the episodes the checkpoint's run held out (the split recomputed from its
config), for every sample anchor, in absolute dataset units
``[pos m, rotvec rad, gripper m]`` over the whole horizon:

* policy: :func:`dpflow_core.inference.predict_dataset` (EMA weights; the
  representation and normalisation undone);
* mean: the mean recorded action of the training episodes, always;
* hold: the latest observed state (pose and gripper at their latency-shifted
  time, what the policy itself sees last), held over the horizon;
* constant velocity: the latest observed state extrapolated with the velocity
  between the last two observation steps (positions and widths linearly,
  rotations by repeating the last relative rotation).

Prints MSE (all 7 dimensions), mean position error (m), mean geodesic
rotation error (rad) and mean gripper error (m) for each; figures go to
docs/benchmarks.md.

    python bench/policy_vs_baselines.py CHECKPOINT DATASET [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy.spatial.transform import Rotation

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpflow_core.inference import load_policy, predict_dataset  # noqa: E402
from dpflow_core.replay_buffer import ReplayBuffer  # noqa: E402
from dpflow_core.train import data as D  # noqa: E402


def errors(pred: np.ndarray, rec: np.ndarray) -> dict[str, float]:
    """MSE over all 7 dims, and mean position / geodesic rotation / gripper errors, of ``(N, H, 7)`` arrays."""
    rot = (Rotation.from_rotvec(pred[..., 3:6].reshape(-1, 3)).inv() * Rotation.from_rotvec(rec[..., 3:6].reshape(-1, 3)))
    return {
        "mse": float(((pred - rec) ** 2).mean()),
        "position_m": float(np.linalg.norm(pred[..., :3] - rec[..., :3], axis=-1).mean()),
        "rotation_rad": float(rot.magnitude().mean()),
        "gripper_m": float(np.abs(pred[..., 6] - rec[..., 6]).mean()),
    }


def baselines(buffer: ReplayBuffer, spec: D.ObsActionSpec, rows: np.ndarray, train_mask: np.ndarray) -> dict[str, np.ndarray]:
    """Mean, hold and constant-velocity predictions ``(N, H, 7)`` for sample ``rows``."""
    lowdim = D.lowdim_arrays(buffer, spec)
    raw = D.read_raw(lowdim, spec, rows)
    h = spec.horizon
    train_rows = D.sequence_index(buffer.episode_ends, train_mask, spec)
    mean = D.recorded_actions(buffer, spec, train_rows).reshape(-1, 7).mean(axis=0)
    last = np.concatenate([raw[D.POS_KEY][:, -1], raw[D.ROT_KEY][:, -1], raw[D.GRIPPER_KEY][:, -1]], axis=-1)
    hold = np.repeat(last[:, None], h, axis=1)
    # constant velocity: per action step, (observation step difference) x (action stride / observation stride)
    k = np.arange(h)[None, :, None] * spec.action_down_sample_steps / spec.obs_down_sample_steps
    if spec.n_obs_steps >= 2:
        dpos = raw[D.POS_KEY][:, -1] - raw[D.POS_KEY][:, -2]
        dgrip = raw[D.GRIPPER_KEY][:, -1] - raw[D.GRIPPER_KEY][:, -2]
        r_last = Rotation.from_rotvec(raw[D.ROT_KEY][:, -1])
        step = (Rotation.from_rotvec(raw[D.ROT_KEY][:, -2]).inv() * r_last).as_rotvec()
    else:
        dpos = np.zeros_like(last[:, :3])
        dgrip = np.zeros_like(last[:, 6:])
        r_last = Rotation.from_rotvec(last[:, 3:6])
        step = np.zeros_like(dpos)
    pos = last[:, None, :3] + k * dpos[:, None]
    grip = last[:, None, 6:] + k * dgrip[:, None]
    rots = np.stack(
        [(r_last * Rotation.from_rotvec(step * float(kk))).as_rotvec() for kk in k[0, :, 0]], axis=1
    )
    return {
        "mean": np.tile(mean, (len(rows), h, 1)),
        "hold": hold,
        "constant_velocity": np.concatenate([pos, rots, grip], axis=-1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("dataset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    started = time.monotonic()
    policy = load_policy(args.checkpoint)
    buffer = ReplayBuffer(args.dataset)
    task = policy.cfg.task
    train_mask, val_mask = D.split_episodes(
        buffer.n_episodes, float(task.val_ratio), int(task.split_seed), int(task.get("val_min_episodes", 1))
    )
    held_out = [int(e) for e in np.flatnonzero(val_mask)]
    result = predict_dataset(policy, buffer, episodes=held_out, seed=args.seed)
    table = {"policy": errors(result.predicted, result.recorded)}
    for name, pred in baselines(buffer, policy.spec, result.rows, train_mask).items():
        table[name] = errors(pred, result.recorded)
    best = min(table["mean"]["mse"], table["hold"]["mse"])
    summary = {
        "checkpoint": str(args.checkpoint),
        "dataset": str(args.dataset),
        "held_out_episodes": held_out,
        "samples": int(len(result.rows)),
        "horizon": policy.horizon,
        "errors": table,
        "policy_over_best_of_mean_and_hold": table["policy"]["mse"] / best,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(f"held-out episodes {held_out}, {len(result.rows)} samples, horizon {policy.horizon}")
    print(f"{'predictor':<18} {'MSE':>10} {'pos m':>9} {'rot rad':>9} {'grip m':>9}")
    for name, e in table.items():
        print(f"{name:<18} {e['mse']:>10.3g} {e['position_m']:>9.4f} {e['rotation_rad']:>9.4f} {e['gripper_m']:>9.5f}")
    print(f"policy MSE / best of mean and hold: {summary['policy_over_best_of_mean_and_hold']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
