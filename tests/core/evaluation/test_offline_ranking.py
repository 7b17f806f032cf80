"""The offline-metrics-against-success study's machinery: rank correlation and its bootstrap, the critical
steps, best-of-N, and every metric's per-episode sums, each against hand-worked values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpflow_core.evaluation.offline_metrics import (
    EpisodeStats, best_of_n, critical_mask, episode_statistics, metric_value, metric_values,
)
from dpflow_core.evaluation.ranking import (
    bootstrap_draws, correlation_table, gate_agreement, rank_metrics, spearman, spearman_rows,
)


def _stats(values_per_episode):
    """One checkpoint's stats for a metric ``m`` whose per-episode sums are ``values`` over 1 step each."""
    v = np.asarray(values_per_episode, dtype=np.float64)[:, None]
    return EpisodeStats(np.arange(len(v)), {"m": v}, {"m": np.ones_like(v)})


def test_spearman_hand_worked():
    # ranks 1..5 against 5,4,3,1,2: d = -4,-2,0,3,3, sum d^2 = 38, rho = 1 - 6*38/(5*24) = -0.9
    rho, p = spearman([1, 2, 3, 4, 5], [5, 4, 3, 1, 2])
    assert rho == pytest.approx(-0.9, abs=1e-12)
    assert 0 < p < 0.1
    # a tie: y ranks 4, 2.5, 2.5, 1; Pearson of the ranks = -4.5 / sqrt(5 * 4.5) = -3 / sqrt(10)
    assert spearman([1, 2, 3, 4], [4, 3, 3, 1])[0] == pytest.approx(-3 / math.sqrt(10), abs=1e-12)
    assert spearman([1, 2, 3], [7, 8, 9])[0] == pytest.approx(1.0)
    assert all(math.isnan(v) for v in spearman([1, 2, 3], [0.5, 0.5, 0.5]))  # constant success: no ranking
    # the bootstrap's row-wise figure is the same as scipy's, row by row
    rows = spearman_rows(np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 4], [1, 1, 1, 1, 1.0]]),
                         np.array([[5, 4, 3, 1, 2], [4, 3, 3, 1, 0], [1, 2, 3, 4, 5.0]]))
    assert rows[:2] == pytest.approx([-0.9, spearman([1, 2, 3, 4, 4], [4, 3, 3, 1, 0])[0]], abs=1e-12)
    assert math.isnan(rows[2])
    with pytest.raises(ValueError, match="3 metric values for 2"):
        spearman([1, 2, 3], [1, 2])


def test_checkpoint_bootstrap_matches_the_enumerated_distribution():
    # errors 1, 2, 3 with success 0.2, 0.3, 0.1 (ranks 2, 3, 1): d = -1, -1, 2, rho = 1 - 6*6/24 = -0.5.
    # The 27 equally likely checkpoint resamples: 3 draw one checkpoint (undefined); 18 draw two:
    # {0,1} ranks alike (+1, 6 of them), {0,2} and {1,2} opposite (-1, 12); 6 draw all three (-0.5).
    stats = [_stats([1.0]), _stats([2.0]), _stats([3.0])]
    success = np.zeros((3, 10), bool)
    for c, k in enumerate((2, 3, 1)):
        success[c, :k] = True
    corr = rank_metrics(stats, success, resamples=3000, seed=1, levels=("checkpoints",))["m"]
    assert corr.spearman == pytest.approx(-0.5)
    assert corr.ci95 == (-1.0, 1.0)
    assert corr.undefined / 3000 == pytest.approx(3 / 27, abs=0.02)
    d = corr.draws
    assert set(np.round(d, 9)) == {-1.0, -0.5, 1.0}
    assert np.mean(d == 1.0) == pytest.approx(6 / 24, abs=0.03)
    assert np.mean(d == -0.5) == pytest.approx(6 / 24, abs=0.03)
    table = correlation_table({"m": corr})
    assert "| `m` |" in table and "-0.50 | -1.00 to +1.00 | 3 |" in table


def test_state_bootstrap_is_paired_across_checkpoints():
    # nested successes (each checkpoint succeeds on a superset of the worse one's states) and errors
    # ordered in every episode: a paired resample of the states can tie successes, never invert them,
    # so every defined draw is negative; resampling each checkpoint's states on its own would invert some.
    success = np.zeros((3, 20), bool)
    for c, k in enumerate((6, 10, 14)):
        success[c, :k] = True
    stats = [_stats([3.0, 3.5]), _stats([2.0, 2.5]), _stats([1.0, 1.5])]
    corr = rank_metrics(stats, success, resamples=3000, seed=0, levels=("states", "episodes"))["m"]
    assert corr.spearman == pytest.approx(-1.0)
    assert (corr.draws < 0).all() and corr.draws.min() == pytest.approx(-1.0)
    assert corr.ci95[0] == pytest.approx(-1.0) and corr.ci95[1] < 0


def test_bootstrap_draws_and_weighted_metric():
    ckpt, w_s, w_e = bootstrap_draws(4, 5, 3, resamples=7, seed=2)
    assert ckpt.shape == (7, 4) and w_s.shape == (7, 5) and w_e.shape == (7, 3)
    assert (w_s.sum(axis=1) == 5).all() and (w_e.sum(axis=1) == 3).all() and ckpt.max() < 4
    ckpt, w_s, _ = bootstrap_draws(4, 5, 3, resamples=2, levels=("episodes",))
    assert (ckpt == np.arange(4)).all() and (w_s == 1).all()
    with pytest.raises(ValueError, match="unknown bootstrap levels"):
        bootstrap_draws(2, 2, 2, levels=("samples",))
    # a ratio of weighted sums: (2*1 + 1*3) / (2*1 + 1*2) = 1.25
    assert metric_value([[1.0], [3.0]], [[1.0], [2.0]], [2.0, 1.0]) == pytest.approx(1.25)
    # two columns, the second with no denominator: left out of the mean
    assert metric_value([[1.0, 5.0], [1.0, 5.0]], [[4.0, 0.0], [4.0, 0.0]]) == pytest.approx(0.25)
    assert math.isnan(metric_value([[1.0]], [[0.0]]))
    assert metric_values([[1.0], [3.0]], [[1.0], [1.0]], np.array([[1.0, 1.0], [2.0, 0.0]])) == pytest.approx([2.0, 1.0])


def test_critical_mask_picks_the_steps_near_events_and_at_contact():
    f = 10.0
    # episode 0 (30 steps): open until step 10, closed from 11: the close is at 1.05 s (halfway, threshold
    # 0.05); a 0.3 s window takes 0.75-1.35 s, steps 8-13. The TCP is down at steps 20-22 (z 0) and 24
    # (9 mm up, inside 1 cm), not at 23 (15 mm).
    w0 = np.where(np.arange(30) <= 10, 0.08, 0.02)
    z0 = np.full(30, 0.2)
    z0[20:23], z0[23], z0[24] = 0.0, 0.015, 0.009
    # episode 1 (8 steps): no event; its own lowest height 0.1 m at steps 3 and 4
    w1 = np.full(8, 0.08)
    z1 = np.array([0.3, 0.3, 0.3, 0.1, 0.1, 0.3, 0.3, 0.3])
    mask = critical_mask(np.concatenate([w0, w1]), np.concatenate([z0, z1]), np.array([30, 38]), f, 0.05,
                         window_s=0.3, contact_height_m=0.01)
    assert np.flatnonzero(mask[:30]).tolist() == [8, 9, 10, 11, 12, 13, 20, 21, 22, 24]
    assert np.flatnonzero(mask[30:]).tolist() == [3, 4]
    with pytest.raises(ValueError, match="must cover the episodes"):
        critical_mask(w0, z0, np.array([29]), f, 0.05)


def test_best_of_n_picks_the_closest_sample():
    e = np.zeros((3, 2, 2))
    e[:, 0] = [[0.5, 0.5], [0.1, 0.3], [0.3, 0.3]]  # anchor 0: means 0.5, 0.2, 0.3 -> draw 1
    e[:, 1] = [[np.nan, 0.0], [0.4, 0.4], [0.2, 0.25]]  # anchor 1: draw 0 not finite -> draw 2
    best, index = best_of_n(e)
    assert index.tolist() == [1, 2]
    assert best.tolist() == [[0.1, 0.3], [0.2, 0.25]]


def test_episode_statistics_hand_worked():
    n, s = 2, 4  # two anchors (episodes 0 and 1), four scored steps each
    targets = np.zeros((n, s, 7))
    targets[..., 6] = 0.08
    targets[0, 2:, 6] = 0.02  # anchor 0 closes between steps 1 and 2
    critical = np.zeros((n, s), bool)
    critical[0, 1:3] = True

    def offset(x):
        a = targets.copy()
        a[..., 0] += x
        return a

    draw0 = offset(np.where(critical, 0.02, 0.05))
    draw0[..., 6] = 0.08  # never closes: misses the event
    draws = np.stack([draw0, offset(0.01), offset(0.03)])
    hold = offset(0.1)
    st = episode_statistics(draws, targets, hold, np.array([0, 1]), critical, gripper_threshold_m=0.05, step_s=0.1)
    v = st.values()
    assert v["position_error_m"] == pytest.approx((2 * 0.05 + 2 * 0.02 + 4 * 0.05) / 8)
    assert v["critical_position_error_m"] == pytest.approx(0.02)
    assert v["best_of_n_position_error_m"] == pytest.approx(0.01)
    assert v["rotation_error_rad"] == pytest.approx(0.0, abs=1e-12)
    x_sse = 2 * 0.05**2 + 2 * 0.02**2 + 4 * 0.05**2
    width_sse = 2 * 0.06**2
    assert v["mse"] == pytest.approx((x_sse + width_sse) / 56)
    assert v["critical_mse"] == pytest.approx((2 * 0.02**2 + 0.06**2) / 14)
    # only x has a hold error (hold's width is the recorded one): 0.0158 / (8 * 0.1^2)
    assert v["hold_normalised_mse"] == pytest.approx(x_sse / (8 * 0.1**2))
    assert v["gripper_event_error"] == pytest.approx(1.0)  # one event, missed
    # episode 1 alone (weights 0, 1): no critical step, no event
    only1 = np.array([0.0, 1.0])
    assert st.value("position_error_m", only1) == pytest.approx(0.05)
    assert math.isnan(st.value("critical_position_error_m", only1))
    back = EpisodeStats.from_npz(st.to_npz())
    assert back.values() == pytest.approx(v, nan_ok=True)


def test_gate_agreement_counts_cells_threshold_and_concordance():
    names = ["a", "b", "c", "d", "e", "f"]
    rate = [0.0, 0.0, 0.04, 0.10, 0.50, 0.80]
    # a passes at 0 % (a false pass), c is rejected at 4 % (a cost), the rest as success says
    passed = [True, False, False, True, True, True]
    g = gate_agreement(names, rate, passed, floor=0.0)
    assert (g.n_not_better, g.n_better) == (2, 4)
    assert (g.passed_not_better, g.rejected_not_better) == (("a",), ("b",))
    assert (g.passed_better, g.rejected_better) == (("d", "e", "f"), ("c",))
    assert (g.lowest_passed, g.highest_rejected) == (0.0, 0.04)
    assert not g.separable
    # passed {0, .1, .5, .8} x rejected {0, .04}: pairs above: 0 vs 0 tie (1/2), 0 vs .04 no, the other 6 yes
    assert g.concordance == pytest.approx(6.5 / 8)
    table = g.table().splitlines()
    assert table[2] == "| success <= 0 % (no better than replay) | 2 | 1 | 1 |"
    assert table[3] == "| success > 0 % | 4 | 3 | 1 |"

    exact = gate_agreement(names, rate, [False, False, False, True, True, True], floor=0.04)
    assert exact.separable and exact.concordance == 1.0
    assert (exact.n_not_better, len(exact.rejected_better), len(exact.passed_not_better)) == (3, 0, 0)
    nobody = gate_agreement(names, rate, [False] * 6, floor=0.0)
    assert nobody.lowest_passed is None and nobody.separable and math.isnan(nobody.concordance)
    with pytest.raises(ValueError, match="equal, non-zero"):
        gate_agreement(names, rate[:-1], passed, floor=0.0)
    with pytest.raises(ValueError, match="finite"):
        gate_agreement(names, rate, passed, floor=float("nan"))
