"""How well an offline metric ranks checkpoints as closed-loop success does: Spearman's rho with a bootstrap interval.

For each metric, Spearman's rank correlation (``scipy.stats.spearmanr``: Pearson's correlation of
the ranks, ties given their mean rank) between the checkpoints' metric values and their success
rates on the same held-out initial states. Every metric is an error, so a metric that ranks well
has a rho near -1: the lower the error, the higher the success.

The interval resamples the three things the figure depends on, each with replacement, in every
one of ``resamples`` draws (Efron and Tibshirani, *An Introduction to the Bootstrap*, 1993: the
percentile interval, 2.5 and 97.5 percentiles):

- the checkpoints (a different set of training runs could have been compared);
- the rollout initial states, the same draw for every checkpoint (they were rolled out on the
  same states, so their successes are paired);
- the held-out episodes the metric is computed on, the same draw for every checkpoint and metric
  (each metric is a ratio of per-episode sums, :mod:`~dpflow_core.evaluation.offline_metrics`).

A draw in which the success rates or the metric values are all equal has no rank correlation; it
is left out and counted (``undefined``). With fewer than half the draws defined the interval is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dpflow_core.evaluation.offline_metrics import METRICS, EpisodeStats, metric_values

BOOTSTRAP_RESAMPLES = 2000
LEVELS = ("checkpoints", "states", "episodes")


def spearman(values: Sequence[float], success: Sequence[float]) -> tuple[float, float]:
    """``(rho, two-sided p-value)`` of ``scipy.stats.spearmanr``; NaN, NaN when either side is constant
    or has a non-finite entry."""
    from scipy.stats import spearmanr

    x, y = np.asarray(values, dtype=np.float64), np.asarray(success, dtype=np.float64)
    if len(x) != len(y):
        raise ValueError(f"{len(x)} metric values for {len(y)} success rates")
    if len(x) < 2 or not (np.isfinite(x).all() and np.isfinite(y).all()) or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan")
    result = spearmanr(x, y)
    return float(result.statistic), float(result.pvalue)


@dataclass(frozen=True)
class Correlation:
    """One metric's rank correlation with success.

    Attributes:
        metric: its name; spearman, pvalue: of the point figures (:func:`spearman`).
        ci95: percentile interval ``[lo, hi]`` of the bootstrap draws; draws: the defined draws' rho.
        undefined: draws with no rank correlation; n_checkpoints: checkpoints ranked.
    """

    metric: str
    spearman: float
    pvalue: float
    ci95: tuple[float, float]
    n_checkpoints: int
    undefined: int
    draws: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {"metric": self.metric, "spearman": self.spearman, "pvalue": self.pvalue, "ci95": list(self.ci95),
                "n_checkpoints": self.n_checkpoints, "resamples": int(len(self.draws) + self.undefined),
                "undefined_resamples": self.undefined}


def spearman_rows(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman's rho of each row pair of ``x`` and ``y`` ``(B, C)``: ``(B,)``, NaN where a row is constant
    or not finite. The same figure as :func:`spearman` (Pearson's correlation of mean ranks, ``rankdata``),
    for all bootstrap draws at once."""
    from scipy.stats import rankdata

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    finite = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
    rx = rankdata(np.where(np.isfinite(x), x, 0.0), axis=1)
    ry = rankdata(np.where(np.isfinite(y), y, 0.0), axis=1)
    rx -= rx.mean(axis=1, keepdims=True)
    ry -= ry.mean(axis=1, keepdims=True)
    norm = np.sqrt((rx**2).sum(axis=1) * (ry**2).sum(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = (rx * ry).sum(axis=1) / norm
    return np.where(finite & (norm > 0), np.clip(rho, -1.0, 1.0), np.nan)


def _interval(draws: np.ndarray, total: int) -> tuple[float, float]:
    if not len(draws) or len(draws) < 0.5 * total:
        return float("nan"), float("nan")
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_draws(
    n_checkpoints: int, n_states: int, n_episodes: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
    levels: Sequence[str] = LEVELS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The resamples: ``(checkpoint indices (B, C), state weights (B, S), episode weights (B, E))``.

    A level left out of ``levels`` keeps every item once in every draw (identity indices, unit weights).
    """
    unknown = set(levels) - set(LEVELS)
    if unknown:
        raise ValueError(f"unknown bootstrap levels {sorted(unknown)}: choose from {list(LEVELS)}")
    rng = np.random.default_rng(seed)
    b = int(resamples)
    ckpt = rng.integers(0, n_checkpoints, size=(b, n_checkpoints)) if "checkpoints" in levels else np.tile(np.arange(n_checkpoints), (b, 1))

    def weights(n: int, on: bool) -> np.ndarray:
        return rng.multinomial(n, np.full(n, 1.0 / n), size=b).astype(np.float64) if on else np.ones((b, n))

    return ckpt, weights(n_states, "states" in levels), weights(n_episodes, "episodes" in levels)


def rank_metrics(
    stats: Sequence[EpisodeStats], success: np.ndarray, metrics: Sequence[str] | None = None,
    resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0, levels: Sequence[str] = LEVELS,
) -> dict[str, Correlation]:
    """Each metric's Spearman correlation with success, with its bootstrap interval (module docstring).

    Args:
        stats: per checkpoint its :class:`~dpflow_core.evaluation.offline_metrics.EpisodeStats`, all on
            the same held-out episodes.
        success: ``(C, S)`` bool or 0/1, checkpoint ``c``'s outcome on rollout state ``s`` (the same
            states for every checkpoint).
        metrics: which (default: every metric of :data:`~dpflow_core.evaluation.offline_metrics.METRICS`
            the stats hold, in that order, then any others); resamples, seed: of the bootstrap; levels: which of :data:`LEVELS` it resamples.

    Raises:
        ValueError: fewer than 2 checkpoints, stats on different episodes, a success matrix of the wrong shape.
    """
    ok = np.asarray(success, dtype=np.float64)
    if len(stats) < 2 or ok.ndim != 2 or ok.shape[0] != len(stats) or not ok.shape[1]:
        raise ValueError(f"need >= 2 checkpoints and a (checkpoints, states) success matrix, got {len(stats)} and {ok.shape}")
    episodes = stats[0].episodes
    if any(not np.array_equal(s.episodes, episodes) for s in stats):
        raise ValueError("every checkpoint's metrics must be on the same held-out episodes")
    known = [m for m, _, _ in METRICS]
    held = sorted(stats[0].numerator, key=lambda m: (known.index(m) if m in known else len(known), m))
    names = held if metrics is None else list(metrics)
    ckpt, w_states, w_eps = bootstrap_draws(len(stats), ok.shape[1], len(episodes), resamples, seed, levels)
    rate = ok.mean(axis=1)
    boot_rate = (w_states @ ok.T) / w_states.sum(axis=1, keepdims=True)  # (B, C)
    out = {}
    for name in names:
        point = np.array([s.value(name) for s in stats])
        rho, p = spearman(point, rate)
        boot_value = np.stack([metric_values(s.numerator[name], s.denominator[name], w_eps) for s in stats], axis=1)  # (B, C)
        rows = np.arange(len(ckpt))[:, None]
        draws = spearman_rows(boot_value[rows, ckpt], boot_rate[rows, ckpt])
        defined = draws[np.isfinite(draws)]
        out[name] = Correlation(name, rho, p, _interval(defined, len(draws)), len(stats), int(len(draws) - len(defined)), defined)
    return out


def correlation_table(correlations: Mapping[str, Correlation]) -> str:
    """A markdown table: metric, unit, Spearman, 95 % interval, checkpoints; best (most negative) first."""
    units = {m: (u, d) for m, u, d in METRICS}
    rows = ["| metric | what | Spearman with success | 95 % interval | checkpoints |", "|---|---|---:|---|---:|"]
    key = lambda c: c.spearman if math.isfinite(c.spearman) else math.inf  # noqa: E731
    for c in sorted(correlations.values(), key=key):
        unit, what = units.get(c.metric, ("", ""))
        lo, hi = c.ci95
        rows.append(f"| `{c.metric}` | {what} ({unit}) | {c.spearman:+.2f} | {lo:+.2f} to {hi:+.2f} | {c.n_checkpoints} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class GateAgreement:
    """How the offline gate's verdicts agree with closed-loop success (:func:`gate_agreement`).

    Attributes:
        floor: the success rate a checkpoint must exceed to count as better than the reference
            (open-loop replay's, a fraction).
        n_not_better, n_better: checkpoints at or below the floor, above it.
        passed_not_better, rejected_not_better, passed_better, rejected_better: the names in each cell.
        lowest_passed, highest_rejected: the lowest success rate among passed checkpoints and the highest
            among rejected ones (None when there is none).
        separable: True when some threshold ``t`` splits them exactly (pass iff success > t), that is
            every passed checkpoint's success exceeds every rejected one's.
        concordance: over every (passed, rejected) pair, the share in which the passed one has the higher
            success, ties counting one half (the Mann-Whitney ``U / (n_passed n_rejected)``, an area under
            the ROC curve); NaN when either side is empty.
    """

    floor: float
    n_not_better: int
    n_better: int
    passed_not_better: tuple[str, ...]
    rejected_not_better: tuple[str, ...]
    passed_better: tuple[str, ...]
    rejected_better: tuple[str, ...]
    lowest_passed: float | None
    highest_rejected: float | None
    separable: bool
    concordance: float

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    def table(self) -> str:
        """A markdown table: one row per group (not better than the floor, better), gate passes and rejects."""
        pct = f"{100 * self.floor:.0f} %"
        rows = ["| checkpoints | n | gate passes | gate rejects |", "|---|---:|---:|---:|",
                f"| success <= {pct} (no better than replay) | {self.n_not_better} | {len(self.passed_not_better)} | "
                f"{len(self.rejected_not_better)} |",
                f"| success > {pct} | {self.n_better} | {len(self.passed_better)} | {len(self.rejected_better)} |"]
        return "\n".join(rows)


def gate_agreement(names: Sequence[str], success_rate: Sequence[float], passed: Sequence[bool], floor: float) -> GateAgreement:
    """Cross the gate's verdicts with closed-loop success against a reference success rate.

    Args:
        names: ``(C,)`` checkpoint names; success_rate: ``(C,)`` their success rates (fractions, on the
            same states); passed: ``(C,)`` the gate's verdicts.
        floor: the reference's success rate (fraction): a checkpoint at or below it does no better.

    Raises:
        ValueError: lengths that differ, no checkpoint, a non-finite success rate or floor.
    """
    rate = np.asarray(success_rate, dtype=np.float64)
    ok = np.asarray(passed, dtype=bool)
    if not (len(names) == len(rate) == len(ok)) or not len(rate):
        raise ValueError(f"{len(names)} names, {len(rate)} success rates and {len(ok)} verdicts: need equal, non-zero counts")
    if not (np.isfinite(rate).all() and math.isfinite(float(floor))):
        raise ValueError(f"success rates and the floor must be finite, got {rate.tolist()} and {floor!r}")
    better = rate > float(floor)
    pick = lambda mask: tuple(n for n, m in zip(names, mask) if m)  # noqa: E731
    lowest = float(rate[ok].min()) if ok.any() else None
    highest = float(rate[~ok].max()) if (~ok).any() else None
    diff = rate[ok][:, None] - rate[~ok][None, :]
    concordance = float(((diff > 0) + 0.5 * (diff == 0)).mean()) if diff.size else float("nan")
    return GateAgreement(
        float(floor), int((~better).sum()), int(better.sum()), pick(ok & ~better), pick(~ok & ~better),
        pick(ok & better), pick(~ok & better), lowest, highest,
        bool(lowest is None or highest is None or lowest > highest), concordance,
    )
