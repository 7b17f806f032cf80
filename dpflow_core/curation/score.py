"""Suspects among a task's episodes: each check compares one figure with a limit and gives a ratio.

Per episode, every check that applies gives a :class:`Finding`: its figure against its limit
and their ``ratio`` (``figure / limit``; ``limit / figure`` for ``duplicate``, which flags by being
under it; for the two release checks, which need two figures past their limits, the smaller
ratio). A ratio >= 1 flags the episode, with a reason naming the figure and the limit; under 1
it is a near miss. The episode's ``score`` is its largest ratio, flagged or not, so that
near misses rank (0 when no check applies). Checks on one episode alone use physical limits;
checks of "unlike the others" (task-relative) use robust statistics over the episodes of the
task (median and MAD, so that a fifth of bad episodes does not move the reference; Iglewicz &
Hoaglin's modified z-score, ``0.6745 (x - median) / MAD``):

==================  ===========================================================  =========
check               figure                                                       action
==================  ===========================================================  =========
``idle``            longest still stretch (s) against ``min_idle_s``             trim
``duplicate``       RMS distance (m) of the track to an earlier episode's        drop
``length``          modified z-score of the time in motion against ``length_z``   drop
``repeated_grasp``  closings of the fingers beyond the task's usual number        drop
                    (against 0.5: any one more flags)
``approach_loops``  descents after a rise beyond the task's usual number         drop
``release_height``  how far the release height departs from the usual (m, z)     drop
``release_scene``   colour-histogram distance of the release frame (z)           drop
==================  ===========================================================  =========

An episode whose only flag is ``idle`` is kept with its still stretches trimmed; any other
flag drops it (``auto`` decisions; a person's label overrides them,
:mod:`~dpflow_core.curation.apply`).

Task-relative checks need enough episodes to know what is usual. With fewer than
``min_task_episodes`` (10) accepted episodes their flags are warnings: reported, never a
drop, and :class:`Scores` says the folder is too small, with the count. Measured on 400 random
folders drawn from 120 of the world's ``pick_place`` demonstrations with a fifth bad, a good
episode was dropped by a task-relative check (all of them ``length``) 5.0 % of the time in
folders of 5, 2.3 % of 8, 2.1 % of 10, 1.4 % of 12, 0.9 % of 20 and never in all 120. The
z-score checks are not computed at all under 5 episodes (:data:`MIN_Z_EPISODES`). The *usual*
number of closings or descents is the count that more than half of the episodes share; when
none does (a tie included) that check has no usual number, flags nothing, and says so.

The two checks on time never count the same seconds: ``idle`` looks at the still stretches,
``length`` at the time in motion (the duration less every still stretch, whatever its length).
So ``min_idle_s`` decides only whether a stillness is trimmed; raising it keeps a pause shorter
than the limit in the recording, and never turns it into a ``length`` drop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from dpflow_core.curation.features import GRID_HZ, EpisodeFeatures

CHECKS = ("idle", "duplicate", "length", "repeated_grasp", "approach_loops", "release_height", "release_scene")
#: Checks whose flag alone keeps the episode, trimmed.
TRIM_CHECKS = ("idle",)
#: Checks that compare an episode with the task's other episodes.
TASK_RELATIVE_CHECKS = ("length", "repeated_grasp", "approach_loops", "release_height", "release_scene")
#: Fewest episodes (with a release, for the release checks) a modified z-score is computed over.
MIN_Z_EPISODES = 5


@dataclass(frozen=True)
class CurationSettings:
    """Limits of the checks (module docstring), in physical units or modified z-scores.

    Attributes:
        idle_speed_mps: the hand is still below this smoothed speed, m/s ...
        idle_angular_rps: ... and this angular speed, rad/s ...
        idle_finger_mps: ... and this finger speed, m/s.
        min_idle_s: a still stretch at least this long (s) is idle (a person's pauses and the
            settling of a grasp last well under a second).
        idle_keep_s: of each idle stretch trimmed, this much (s) is kept, half at each end.
        duplicate_rms_m: a track within this RMS distance (m) of an earlier one, on the same clock
            from each start, is the same demonstration; ``duplicate_duration_s``: durations must
            agree within this (s) to be compared.
        length_z, release_z, scene_z: modified z-scores beyond which the duration, the release
            height and the release scene are abnormal.
        release_min_m: the release height must also depart by at least this (m) from the median.
        scene_min: and the release scene's histogram by at least this L1 distance (0-2) from their median.
        min_task_episodes: fewest accepted episodes for a task-relative flag to drop an episode; with
            fewer, those flags are warnings (module docstring).
    """

    idle_speed_mps: float = 0.01
    idle_angular_rps: float = 0.1
    idle_finger_mps: float = 0.005
    min_idle_s: float = 1.5
    idle_keep_s: float = 0.5
    duplicate_rms_m: float = 0.004
    duplicate_duration_s: float = 0.3
    length_z: float = 3.5
    release_z: float = 5.0
    release_min_m: float = 0.02
    scene_z: float = 3.0
    scene_min: float = 0.03
    min_task_episodes: int = 10

    def validate(self) -> "CurationSettings":
        """``self``; ValueError naming the first value that is not > 0."""
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"curation setting {name} must be > 0, got {value!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Finding:
    """A check's figure on one episode against its limit.

    Attributes:
        check: one of :data:`CHECKS`.
        figure, limit: the figure and its limit (units in ``reason``).
        reason: the sentence that names them.
        below: the figure flags by being under the limit (``duplicate``).
        also: ``(figure, limit)`` of a second condition that must reach its limit too (the release
            checks' smallest departure); the ratio is then the smaller of the two.
        warning_only: a task-relative check on too few episodes: it is reported, never drops.
    """

    check: str
    figure: float
    limit: float
    reason: str
    below: bool = False
    also: tuple[float, float] | None = None
    warning_only: bool = False

    @property
    def ratio(self) -> float:
        """``figure / limit`` (``limit / figure`` when ``below``; the smaller with ``also``'s); >= 1 flags."""
        r = self.limit / max(self.figure, 1e-9) if self.below else self.figure / self.limit
        return min(r, self.also[0] / self.also[1]) if self.also else r

    @property
    def flags(self) -> bool:
        """Whether the figure reaches its limit (``ratio >= 1``)."""
        return self.ratio >= 1.0

    def to_dict(self) -> dict:
        out = {"check": self.check, "figure": round(self.figure, 4), "limit": round(self.limit, 4),
               "ratio": round(self.ratio, 3), "reason": self.reason}
        return out | ({"warning_only": True} if self.warning_only else {})


@dataclass(frozen=True)
class Scores:
    """What the checks found on one task's episodes (:func:`score_episodes`).

    Attributes:
        findings: per episode, in the order given, one :class:`Finding` per check that applies to it,
            flagged or not.
        warnings: sentences on checks that could not judge: too few episodes for the task-relative
            ones (their flags are ``warning_only``), a count with no usual number.
    """

    findings: list[list[Finding]]
    warnings: list[str]

    def flags(self, i: int) -> list[Finding]:
        """Episode ``i``'s findings that flag it."""
        return [f for f in self.findings[i] if f.flags]

    def score(self, i: int) -> float:
        """Episode ``i``'s largest ratio, flagged or not (0.0 when no check applies)."""
        return max((f.ratio for f in self.findings[i]), default=0.0)

    def ratios(self, i: int) -> dict[str, float]:
        """Episode ``i``'s ratio per check that applies (rounded to 3 decimals)."""
        return {f.check: round(f.ratio, 3) for f in self.findings[i]}


def modified_z(x: np.ndarray) -> np.ndarray:
    """Modified z-scores ``0.6745 (x - median) / MAD`` (Iglewicz & Hoaglin 1993); a MAD of 0 is
    replaced by the mean absolute deviation / 0.7979 (their fallback), then by 1e-12."""
    x = np.asarray(x, float)
    med = np.median(x)
    mad = np.median(np.abs(x - med))
    if mad == 0:
        mad = np.mean(np.abs(x - med)) / 0.7979 * 0.6745
    return 0.6745 * (x - med) / max(mad, 1e-12)


def usual_count(counts: list[int]) -> int | None:
    """The count that more than half of ``counts`` share, or None when none does (a tie included)."""
    values, n = np.unique(np.asarray(counts, int), return_counts=True)
    k = int(np.argmax(n))
    return int(values[k]) if 2 * n[k] > len(counts) else None


def _nearest_earlier(eps: list[EpisodeFeatures], s: CurationSettings) -> dict[int, tuple[int, float]]:
    """Per episode, the earlier one (by first capture time, then stem; durations within
    ``duplicate_duration_s``) whose track is nearest, and their RMS distance (m). An episode that
    repeats an earlier one (RMS under ``duplicate_rms_m``) is no reference for later ones."""
    order = sorted(range(len(eps)), key=lambda i: (eps[i].start_ns, eps[i].stem))
    nearest: dict[int, tuple[int, float]] = {}
    for rank, i in enumerate(order):
        for j in order[:rank]:
            if (j in nearest and nearest[j][1] < s.duplicate_rms_m) \
                    or abs(eps[i].duration_s - eps[j].duration_s) > s.duplicate_duration_s:
                continue
            k = min(len(eps[i].track_m), len(eps[j].track_m))
            rms = float(np.sqrt(np.mean(np.sum((eps[i].track_m[:k] - eps[j].track_m[:k]) ** 2, axis=1))))
            if i not in nearest or rms < nearest[i][1]:
                nearest[i] = (j, rms)
    return nearest


def stretch_s(start_s: float, end_s: float) -> float:
    """Length (s) of a still stretch ``[start_s, end_s]`` of grid times: both end samples included."""
    return end_s - start_s + 1.0 / GRID_HZ


def idle_stretches(e: EpisodeFeatures, settings: CurationSettings) -> list[list[float]]:
    """The still stretches ``[start_s, end_s]`` of ``e`` that are idle: :func:`stretch_s` at least
    ``settings.min_idle_s`` (the ones the ``idle`` check counts and trimming cuts)."""
    return [[a, b] for a, b in e.still if stretch_s(a, b) >= settings.min_idle_s]


def moving_s(e: EpisodeFeatures) -> float:
    """The time in motion (s): ``e.duration_s`` less every still stretch (whatever ``min_idle_s``)."""
    return max(e.duration_s - sum(stretch_s(a, b) for a, b in e.still), 0.0)


def score_episodes(eps: list[EpisodeFeatures], settings: CurationSettings) -> Scores:
    """Every check's :class:`Finding` on each episode of ``eps`` (one task's), and the warnings.

    With fewer than ``settings.min_task_episodes`` episodes, the task-relative findings are
    ``warning_only`` and :attr:`Scores.warnings` says so, with the count.

    Raises:
        ValueError: a setting is not > 0.
    """
    s = settings.validate()
    found: list[list[Finding]] = [[] for _ in eps]
    for i, e in enumerate(eps):
        idle = idle_stretches(e, s)
        longest = max((stretch_s(a, b) for a, b in e.still), default=0.0)
        n = f"; {len(idle)} such stretch{'es' if len(idle) > 1 else ''}" if idle else ""
        found[i].append(Finding("idle", longest, s.min_idle_s,
                                f"stands still for {longest:.1f} s (limit {s.min_idle_s:g} s{n})"))
    for i, (j, rms) in _nearest_earlier(eps, s).items():
        found[i].append(Finding("duplicate", rms, s.duplicate_rms_m,
                                f"repeats episode {eps[j].stem!r}: tracks {rms * 1000:.2f} mm RMS apart over "
                                f"{min(eps[i].duration_s, eps[j].duration_s):.1f} s (limit {s.duplicate_rms_m * 1000:g} mm)",
                                below=True))
    warnings = _task_relative(eps, s, found)
    if len(eps) < s.min_task_episodes:
        found = [[replace(f, warning_only=True, reason=f"{f.reason} [a warning only: {len(eps)} episodes]")
                  if f.check in TASK_RELATIVE_CHECKS and f.flags else f for f in fs] for fs in found]
        warnings.insert(0, f"only {len(eps)} episodes: too few for the task-relative checks "
                           f"({', '.join(TASK_RELATIVE_CHECKS)}), which need {s.min_task_episodes:g} to drop one; "
                           f"their flags are warnings")
    return Scores(found, warnings)


def _task_relative(eps: list[EpisodeFeatures], s: CurationSettings, found: list[list[Finding]]) -> list[str]:
    """Add the task-relative findings to ``found``; the warnings of counts with no usual number."""
    warnings = []
    if len(eps) >= MIN_Z_EPISODES:
        # still time is the idle check's, whatever min_idle_s: a pause is trimmed or kept, never a length drop
        active = np.array([moving_s(e) for e in eps])
        z = modified_z(np.log(np.maximum(active, 1e-3)))
        med = float(np.median(active))
        for i in range(len(eps)):
            found[i].append(Finding("length", abs(float(z[i])), s.length_z,
                                    f"moves for {active[i]:.1f} s (of {eps[i].duration_s:.1f} s; still stretches aside) "
                                    f"against a median of {med:.1f} s (modified z {z[i]:+.1f}, limit {s.length_z:g})"))
    for check, key, what in (("repeated_grasp", lambda e: len(e.closings_s), "closes the fingers"),
                             ("approach_loops", lambda e: e.approach_loops, "comes down after a rise")):
        counts = [key(e) for e in eps]
        usual = usual_count(counts)
        if usual is None:
            values, n = np.unique(counts, return_counts=True)
            warnings.append(f"{check} not checked: no count is shared by more than half of the {len(eps)} episodes "
                            f"({', '.join(f'{v}: {k}' for v, k in zip(values, n))})")
            continue
        for i, c in enumerate(counts):
            found[i].append(Finding(check, float(max(c - usual, 0)), 0.5,
                                    f"{what} {c} times where the task's episodes usually do {usual}"))
    _release_checks(eps, s, found)
    return warnings


def _release_checks(eps: list[EpisodeFeatures], s: CurationSettings, found: list[list[Finding]]) -> None:
    rel = [i for i, e in enumerate(eps) if e.release_rise_m is not None]
    if len(rel) < MIN_Z_EPISODES:
        return
    rise = np.array([eps[i].release_rise_m for i in rel])
    z, med = modified_z(rise), float(np.median(rise))
    for k, i in enumerate(rel):
        found[i].append(Finding("release_height", abs(float(z[k])), s.release_z,
                                f"lets go {rise[k] * 100:+.1f} cm from where it grasped, against a median of "
                                f"{med * 100:+.1f} cm (modified z {z[k]:+.1f}, limit {s.release_z:g})",
                                also=(abs(float(rise[k]) - med), s.release_min_m)))
    hists = np.stack([eps[i].release_hist for i in rel])
    dist = np.abs(hists - np.median(hists, axis=0)).sum(axis=1)
    z = modified_z(dist)
    for k, i in enumerate(rel):
        found[i].append(Finding("release_scene", max(float(z[k]), 0.0), s.scene_z,
                                f"what the camera sees where it lets go is unlike the other episodes' "
                                f"(colour-histogram distance {dist[k]:.2f} to their median, modified z {z[k]:+.1f}, "
                                f"limit {s.scene_z:g}): a wrong target?", also=(float(dist[k]), s.scene_min)))


def auto_decision(flags: list[Finding]) -> str:
    """``keep`` (no flag that acts), ``trim`` (only :data:`TRIM_CHECKS` flags) or ``drop``; ``flags``
    are an episode's flagging findings (:meth:`Scores.flags`); ``warning_only`` ones never act."""
    acting = [f for f in flags if f.flags and not f.warning_only]
    if not acting:
        return "keep"
    return "trim" if all(f.check in TRIM_CHECKS for f in acting) else "drop"
