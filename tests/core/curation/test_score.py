"""The checks on time, on figures made here: ``idle`` counts the still stretches, ``length`` the time in
motion, so that no limit makes the other count the same seconds.

A trial ran ``dpflow curate --set min_idle_s=5`` on world recordings with idle faults: a 4.9 s pause, no
longer idle under the new limit, stayed in the length figure ("lasts 14.5 s (idle stretches aside)", modified
z +4.6) and the episode, trimmed at the default limit, was dropped for its length."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dpflow_core.curation.features import EpisodeFeatures
from dpflow_core.curation.score import (CurationSettings, auto_decision, idle_stretches, moving_s, score_episodes,
                                        usual_count)

#: Seconds in motion of 12 ordinary demonstrations (as the world's pick_place ones).
MOVING_S = (9.1, 8.1, 9.6, 7.7, 10.2, 9.6, 9.0, 9.0, 9.3, 8.2, 9.0, 7.7)
SETTLE_S = 0.6  # every demonstration stands still this long once (the grasp settling)


def _episode(k: int, moving: float, pause_s: float = 0.0) -> EpisodeFeatures:
    """Figures of a demonstration that moves ``moving`` s, settles once, and pauses ``pause_s`` s."""
    still = [[2.0, 2.0 + SETTLE_S - 1 / 30]] + ([[3.0, 3.0 + pause_s - 1 / 30]] if pause_s else [])
    duration = moving + SETTLE_S + pause_s
    t = np.arange(0.0, duration, 1 / 30)
    track = np.random.default_rng(k).normal(size=(len(t), 3))  # no two alike: no duplicate
    return EpisodeFeatures(f"ep_{k:04d}", "", duration, k * 10**9, still, [4.0], [7.0], 0.004, 1,
                           np.full(13, 1 / 13), t, track, np.zeros(len(t)))


@pytest.mark.parametrize("min_idle_s, decision", [(1.5, "trim"), (5.0, "keep"), (6.0, "keep")])
def test_a_pause_under_the_idle_limit_is_kept_not_dropped_for_its_length(min_idle_s, decision):
    eps = [_episode(k, m) for k, m in enumerate(MOVING_S)] + [_episode(99, 9.0, pause_s=4.9)]
    settings = CurationSettings(min_idle_s=min_idle_s)
    scores = score_episodes(eps, settings)
    assert all(not scores.flags(i) for i in range(len(eps) - 1))
    assert auto_decision(scores.flags(len(eps) - 1)) == decision, [f.reason for f in scores.flags(len(eps) - 1)]
    assert moving_s(eps[-1]) == pytest.approx(9.0)  # the same figure whatever the idle limit
    assert len(idle_stretches(eps[-1], settings)) == (decision == "trim")


def test_a_long_demonstration_is_dropped_for_the_time_it_moves_and_says_so():
    eps = [_episode(k, m) for k, m in enumerate(MOVING_S)] + [_episode(99, 19.0, pause_s=2.0)]
    for min_idle_s in (1.5, 5.0):
        scores = score_episodes(eps, CurationSettings(min_idle_s=min_idle_s))
        (length,) = [f for f in scores.flags(len(eps) - 1) if f.check == "length"]
        assert length.reason.startswith("moves for 19.0 s (of 21.6 s; still stretches aside) against a median of 9.0 s")


def test_every_episode_scores_its_largest_ratio_flagged_or_not():
    """A new user found every unflagged episode scored 0.0, though the score is "its largest figure / limit":
    near misses could not be ranked. A 0.7 s pause against the 1.5 s limit is a ratio of 0.47."""
    eps = [_episode(k, m) for k, m in enumerate(MOVING_S)] + [_episode(98, 9.0, pause_s=0.7),
                                                              _episode(99, 9.0, pause_s=1.4)]
    scores = score_episodes(eps, CurationSettings())
    assert not any(scores.flags(i) for i in range(len(eps)))
    near, nearer = len(eps) - 2, len(eps) - 1
    assert scores.ratios(near)["idle"] == pytest.approx(0.7 / 1.5, abs=1e-3)
    assert scores.ratios(0)["idle"] == pytest.approx(SETTLE_S / 1.5, abs=1e-3)
    for i in range(len(eps)):
        assert 0 < scores.score(i) < 1
        assert scores.score(i) == pytest.approx(max(scores.ratios(i).values()), abs=1e-3)
    assert max(range(len(eps)), key=scores.score) == nearer  # 1.4 / 1.5: the nearest miss ranks first
    assert scores.ratios(0)["approach_loops"] == 0.0  # the usual count is no near miss


def _loops(counts: list[int]) -> list[EpisodeFeatures]:
    return [replace(_episode(k, MOVING_S[k % len(MOVING_S)]), approach_loops=c) for k, c in enumerate(counts)]


def test_a_tie_is_not_what_episodes_usually_do():
    """4 random-motion episodes, two with 1 descent after a rise and two with 2: a trial dropped the two
    that do 2 "where the task's episodes usually do 1"."""
    scores = score_episodes(_loops([2, 1, 1, 2]), CurationSettings(min_task_episodes=2))
    assert not any(scores.flags(i) for i in range(4))
    assert "approach_loops not checked: no count is shared by more than half of the 4 episodes (1: 2, 2: 2)" \
        in scores.warnings
    assert usual_count([1, 1, 2, 2]) is None and usual_count([1, 1, 2]) == 1 and usual_count([3]) == 3


@pytest.mark.parametrize("n", [6, 9, 10])
def test_too_few_episodes_for_task_relative_checks_warn_instead_of_dropping(n):
    scores = score_episodes(_loops([1] * (n - 1) + [3]), CurationSettings())
    (flag,) = scores.flags(n - 1)
    assert flag.check == "approach_loops" and flag.ratio == pytest.approx(4.0)  # 2 beyond the usual, limit 0.5
    if n < 10:
        assert flag.warning_only and auto_decision(scores.flags(n - 1)) == "keep"
        assert scores.warnings[0].startswith(f"only {n} episodes: too few for the task-relative checks")
        assert "need 10 to drop one" in scores.warnings[0] and f"[a warning only: {n} episodes]" in flag.reason
    else:
        assert not flag.warning_only and auto_decision(scores.flags(n - 1)) == "drop" and not scores.warnings
    lowered = score_episodes(_loops([1] * (n - 1) + [3]), CurationSettings(min_task_episodes=n))
    assert auto_decision(lowered.flags(n - 1)) == "drop"
