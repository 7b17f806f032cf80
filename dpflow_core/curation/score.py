"""Suspects among a task's episodes: each check compares one figure with a limit and gives a ratio.

Per episode, every check gives ``figure / limit`` (a ratio >= 1 flags it, with a reason
naming the figure and the limit); the episode's ``score`` is its largest ratio. Checks on
one episode alone use physical limits; checks of "unlike the others" use robust
statistics over the episodes of the task (median and MAD, so that a fifth of bad
episodes does not move the reference; Iglewicz & Hoaglin's modified z-score,
``0.6745 (x - median) / MAD``):

==================  ===========================================================  =========
check               figure                                                       action
==================  ===========================================================  =========
``idle``            longest still stretch (s) against ``min_idle_s``             trim
``duplicate``       RMS distance (m) of the track to an earlier episode's        drop
``length``          modified z-score of the time in motion against ``length_z``   drop
``repeated_grasp``  closings of the fingers beyond the task's usual number       drop
``approach_loops``  descents after a rise beyond the task's usual number         drop
``release_height``  how far the release height departs from the usual (m, z)     drop
``release_scene``   colour-histogram distance of the release frame (z)           drop
==================  ===========================================================  =========

An episode whose only flag is ``idle`` is kept with its still stretches trimmed; any other
flag drops it (``auto`` decisions; a person's label overrides them,
:mod:`~dpflow_core.curation.apply`).

The two checks on time never count the same seconds: ``idle`` looks at the still stretches,
``length`` at the time in motion (the duration less every still stretch, whatever its length).
So ``min_idle_s`` decides only whether a stillness is trimmed; raising it keeps a pause shorter
than the limit in the recording, and never turns it into a ``length`` drop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from dpflow_core.curation.features import GRID_HZ, EpisodeFeatures

CHECKS = ("idle", "duplicate", "length", "repeated_grasp", "approach_loops", "release_height", "release_scene")
#: Checks whose flag alone keeps the episode, trimmed.
TRIM_CHECKS = ("idle",)


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

    def validate(self) -> "CurationSettings":
        """``self``; ValueError naming the first value that is not > 0."""
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"curation setting {name} must be > 0, got {value!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Flag:
    """A check's finding: ``check`` (one of :data:`CHECKS`), ``figure`` and ``limit`` (its units in
    ``reason``), the sentence ``reason``; ``below``: the figure flags by being under the limit.
    ``ratio`` (>= 1 when flagged) is figure / limit, or limit / figure when ``below``."""

    check: str
    figure: float
    limit: float
    reason: str
    below: bool = False

    @property
    def ratio(self) -> float:
        return self.limit / max(self.figure, 1e-9) if self.below else self.figure / self.limit

    def to_dict(self) -> dict:
        return {"check": self.check, "figure": round(self.figure, 4), "limit": round(self.limit, 4),
                "ratio": round(self.ratio, 3), "reason": self.reason}


def modified_z(x: np.ndarray) -> np.ndarray:
    """Modified z-scores ``0.6745 (x - median) / MAD`` (Iglewicz & Hoaglin 1993); a MAD of 0 is
    replaced by the mean absolute deviation / 0.7979 (their fallback), then by 1e-12."""
    x = np.asarray(x, float)
    med = np.median(x)
    mad = np.median(np.abs(x - med))
    if mad == 0:
        mad = np.mean(np.abs(x - med)) / 0.7979 * 0.6745
    return 0.6745 * (x - med) / max(mad, 1e-12)


def _usual(counts: list[int]) -> int:
    """The most frequent value (the smallest on a tie)."""
    values, n = np.unique(np.asarray(counts, int), return_counts=True)
    return int(values[np.argmax(n)])


def _duplicates(eps: list[EpisodeFeatures], s: CurationSettings) -> dict[int, tuple[int, float]]:
    """Per later episode, the earlier one (by first capture time, then stem) it repeats, and the RMS (m)."""
    order = sorted(range(len(eps)), key=lambda i: (eps[i].start_ns, eps[i].stem))
    found: dict[int, tuple[int, float]] = {}
    for rank, i in enumerate(order):
        for j in order[:rank]:
            if j in found or abs(eps[i].duration_s - eps[j].duration_s) > s.duplicate_duration_s:
                continue
            k = min(len(eps[i].track_m), len(eps[j].track_m))
            rms = float(np.sqrt(np.mean(np.sum((eps[i].track_m[:k] - eps[j].track_m[:k]) ** 2, axis=1))))
            if rms < s.duplicate_rms_m and (i not in found or rms < found[i][1]):
                found[i] = (j, rms)
    return found


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


def score_episodes(eps: list[EpisodeFeatures], settings: CurationSettings) -> list[list[Flag]]:
    """The flags of each episode of ``eps`` (one task's), in the order given."""
    s = settings.validate()
    flags: list[list[Flag]] = [[] for _ in eps]
    for i, e in enumerate(eps):
        idle = idle_stretches(e, s)
        if idle:
            longest, n = max(stretch_s(a, b) for a, b in idle), len(idle)
            flags[i].append(Flag("idle", longest, s.min_idle_s,
                                 f"stands still for {longest:.1f} s (limit {s.min_idle_s:g} s; {n} such stretch"
                                 f"{'es' if n > 1 else ''})"))
    for i, (j, rms) in _duplicates(eps, s).items():
        flags[i].append(Flag("duplicate", rms, s.duplicate_rms_m,
                             f"repeats episode {eps[j].stem!r}: tracks {rms * 1000:.2f} mm RMS apart over "
                             f"{min(eps[i].duration_s, eps[j].duration_s):.1f} s (limit {s.duplicate_rms_m * 1000:g} mm)", below=True))
    if len(eps) >= 5:
        # still time is the idle check's, whatever min_idle_s: a pause is trimmed or kept, never a length drop
        active = np.array([moving_s(e) for e in eps])
        z = modified_z(np.log(np.maximum(active, 1e-3)))
        med = float(np.median(active))
        for i in range(len(eps)):
            if abs(z[i]) >= s.length_z:
                flags[i].append(Flag("length", abs(float(z[i])), s.length_z,
                                     f"moves for {active[i]:.1f} s (of {eps[i].duration_s:.1f} s; still stretches aside) against a median of "
                                     f"{med:.1f} s "
                                     f"(modified z {z[i]:+.1f}, limit {s.length_z:g})"))
    for check, key, what in (("repeated_grasp", lambda e: len(e.closings_s), "closes the fingers"),
                             ("approach_loops", lambda e: e.approach_loops, "comes down after a rise")):
        counts = [key(e) for e in eps]
        usual = _usual(counts)
        for i, c in enumerate(counts):
            if c > usual:
                flags[i].append(Flag(check, float(c), float(usual) + 0.5,
                                     f"{what} {c} times where the task's episodes usually do {usual}"))
    _release_checks(eps, s, flags)
    return flags


def _release_checks(eps: list[EpisodeFeatures], s: CurationSettings, flags: list[list[Flag]]) -> None:
    rel = [i for i, e in enumerate(eps) if e.release_rise_m is not None]
    if len(rel) < 5:
        return
    rise = np.array([eps[i].release_rise_m for i in rel])
    z, med = modified_z(rise), float(np.median(rise))
    for k, i in enumerate(rel):
        if abs(z[k]) >= s.release_z and abs(rise[k] - med) >= s.release_min_m:
            flags[i].append(Flag("release_height", abs(float(z[k])), s.release_z,
                                 f"lets go {rise[k] * 100:+.1f} cm from where it grasped, against a median of "
                                 f"{med * 100:+.1f} cm (modified z {z[k]:+.1f}, limit {s.release_z:g})"))
    hists = np.stack([eps[i].release_hist for i in rel])
    dist = np.abs(hists - np.median(hists, axis=0)).sum(axis=1)
    z = modified_z(dist)
    for k, i in enumerate(rel):
        if z[k] >= s.scene_z and dist[k] >= s.scene_min:
            flags[i].append(Flag("release_scene", float(z[k]), s.scene_z,
                                 f"what the camera sees where it lets go is unlike the other episodes' "
                                 f"(colour-histogram distance {dist[k]:.2f} to their median, modified z {z[k]:+.1f}, "
                                 f"limit {s.scene_z:g}): a wrong target?"))


def auto_decision(flags: list[Flag]) -> str:
    """``keep`` (no flag), ``trim`` (only :data:`TRIM_CHECKS` flags) or ``drop``."""
    if not flags:
        return "keep"
    return "trim" if all(f.check in TRIM_CHECKS for f in flags) else "drop"
