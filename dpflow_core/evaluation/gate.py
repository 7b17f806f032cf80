"""The offline gate: the policy against the best trivial predictor, criterion by criterion, with bootstrap intervals.

Three criteria, each in its own unit and each invariant to the dataset's world frame
(:mod:`dpflow_core.evaluation.metrics`), on the steps a robot executes:

- ``position_error_m``: mean TCP position error (m), lower is better;
- ``rotation_error_rad``: mean geodesic TCP rotation error (rad), lower is better;
- ``gripper_events``: gripper open/close events matched minus false ones, higher is better.
  Its error is ``missed + false`` (``events - score``), 0 for a predictor that gets every
  event and invents none.

Each criterion passes when the policy's error undercuts the best baseline's by the margin,
``improvement = 1 - error_policy / error_best > margin`` (the best baseline is chosen per
criterion: hold is often best on rotation while constant velocity is on position), or
when the policy's error is exactly 0. A best baseline with error 0 can only be matched, by an
error of 0. The gate (``beats_baseline``) passes when all three pass.

Intervals: the held-out *episodes* are resampled with replacement (samples of one episode are
correlated, so resampling samples would claim far too much certainty), ``resamples`` times
with a fixed seed; each criterion reports the 2.5 and 97.5 percentiles of the policy's figure
and of its improvement over the best baseline of each resample (Efron and Tibshirani, *An
Introduction to the Bootstrap*, 1993, ch. 13: the percentile interval). They say how far a
verdict can be trusted; the gate itself is decided on the point figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpflow_core.evaluation.metrics import SampleErrors

#: The gated criteria, in report order: (name, unit, what the figure is).
CRITERIA: tuple[tuple[str, str, str], ...] = (
    ("position_error_m", "m", "mean TCP position error"),
    ("rotation_error_rad", "rad", "mean geodesic TCP rotation error"),
    ("gripper_events", "events", "gripper events matched minus false"),
)
BOOTSTRAP_RESAMPLES = 2000


def _episode_sums(values: np.ndarray, episodes: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros(n)
    np.add.at(out, episodes, values)
    return out


def _interval(samples: np.ndarray) -> list[float]:
    finite = samples[np.isfinite(samples)]
    if len(finite) < 0.5 * len(samples) or not len(finite):
        return [float("nan"), float("nan")]
    lo, hi = np.percentile(finite, [2.5, 97.5])
    return [float(lo), float(hi)]


def _improvement(err_policy, err_best):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(np.asarray(err_best) > 0, 1.0 - np.asarray(err_policy) / np.asarray(err_best), np.nan)


def gate_criteria(
    errors: Mapping[str, SampleErrors],
    episodes: np.ndarray,
    baselines: tuple[str, ...],
    margin: float,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Each gated criterion's figures, verdict and episode-bootstrap intervals.

    Args:
        errors: per predictor (``"policy"`` and each of ``baselines``) its :class:`SampleErrors`
            on the same samples.
        episodes: ``(N,)`` the held-out episode of each sample.
        baselines: the trivial predictors the policy must beat.
        margin: fraction in [0, 1) by which the policy's error must undercut the best baseline's.
        resamples: bootstrap resamples of the episodes; seed: their generator's seed.

    Returns:
        ``{criterion: {"unit", "description", "policy", "baselines": {name: figure}, "best_baseline",
        "baseline", "required", "improvement", "passed", "policy_ci95": [lo, hi],
        "improvement_ci95": [lo, hi]}}``, plus ``"events"`` (recorded events) for
        ``gripper_events``. ``required`` is the figure the policy must do better than:
        ``(1 - margin) x baseline`` for the errors, ``baseline + margin x (events - baseline)``
        for the event score.

    Raises:
        ValueError: a predictor missing, shapes that differ, a margin outside [0, 1).
    """
    if not 0.0 <= float(margin) < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    names = ("policy",) + tuple(baselines)
    missing = [n for n in names if n not in errors]
    if missing:
        raise ValueError(f"errors lack predictors {missing}")
    _, ep = np.unique(np.asarray(episodes), return_inverse=True)
    n_ep = int(ep.max()) + 1 if len(ep) else 0
    if any(len(errors[n].events) != len(ep) for n in names):
        raise ValueError("every predictor's errors must cover the same samples as episodes")
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n_ep, np.full(n_ep, 1.0 / n_ep), size=int(resamples)).astype(np.float64)

    # per predictor and criterion: (error sum, count) per episode; the figure is sum / count
    sums: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {c: {} for c, _, _ in CRITERIA}
    for n in names:
        e = errors[n]
        for crit, arr in (("position_error_m", e.position_error_m), ("rotation_error_rad", e.rotation_error_rad)):
            a = np.asarray(arr, dtype=np.float64)
            sums[crit][n] = (_episode_sums(a.sum(axis=1), ep, n_ep), _episode_sums(np.full(len(a), a.shape[1], float), ep, n_ep))
        err = (e.events - e.matched + e.false).astype(np.float64)
        # totals, not means: weights of 1 / episodes sum to 1 in every resample
        sums["gripper_events"][n] = (_episode_sums(err, ep, n_ep), np.full(n_ep, 1.0 / n_ep))
    events = float(errors["policy"].events.sum())

    out: dict[str, dict[str, Any]] = {}
    for crit, unit, description in CRITERIA:
        point = {n: float(s.sum() / c.sum()) for n, (s, c) in sums[crit].items()}
        boot = {n: (weights @ s) / (weights @ c) for n, (s, c) in sums[crit].items()}
        best = min(baselines, key=lambda n: (point[n] if math.isfinite(point[n]) else math.inf))
        best_boot = np.min(np.stack([boot[n] for n in baselines]), axis=0)
        improvement = float(_improvement(point["policy"], point[best]))
        passed = bool(point["policy"] == 0.0 or (math.isfinite(improvement) and improvement > margin))
        if crit == "gripper_events":  # errors (missed + false) -> scores (matched - false)
            figure = {n: events - v for n, v in point.items()}
            policy_boot = _boot_events(weights, errors["policy"], ep, n_ep) - boot["policy"]
            required = figure[best] + margin * (events - figure[best])
        else:
            figure = point
            policy_boot = boot["policy"]
            required = (1.0 - margin) * point[best]
        out[crit] = {
            "unit": unit,
            "description": description,
            "policy": figure["policy"],
            "baselines": {n: figure[n] for n in baselines},
            "best_baseline": best,
            "baseline": figure[best],
            "required": float(required),
            "improvement": improvement,
            "passed": passed,
            "policy_ci95": _interval(np.asarray(policy_boot, dtype=np.float64)),
            "improvement_ci95": _interval(_improvement(boot["policy"], best_boot)),
        }
        if crit == "gripper_events":
            out[crit]["events"] = int(events)
    return out


def _boot_events(weights: np.ndarray, policy: SampleErrors, ep: np.ndarray, n_ep: int) -> np.ndarray:
    """Recorded events of each bootstrap resample, ``(resamples,)``."""
    return weights @ _episode_sums(policy.events.astype(np.float64), ep, n_ep)
