"""The checks on time, on figures made here: ``idle`` counts the still stretches, ``length`` the time in
motion, so that no limit makes the other count the same seconds.

A trial ran ``dpflow curate --set min_idle_s=5`` on world recordings with idle faults: a 4.9 s pause, no
longer idle under the new limit, stayed in the length figure ("lasts 14.5 s (idle stretches aside)", modified
z +4.6) and the episode, trimmed at the default limit, was dropped for its length."""

from __future__ import annotations

import numpy as np
import pytest

from dpflow_core.curation.features import EpisodeFeatures
from dpflow_core.curation.score import CurationSettings, auto_decision, idle_stretches, moving_s, score_episodes

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
    flags = score_episodes(eps, settings)
    assert all(not f for f in flags[:-1])
    assert auto_decision(flags[-1]) == decision, [f.reason for f in flags[-1]]
    assert moving_s(eps[-1]) == pytest.approx(9.0)  # the same figure whatever the idle limit
    assert len(idle_stretches(eps[-1], settings)) == (decision == "trim")


def test_a_long_demonstration_is_dropped_for_the_time_it_moves_and_says_so():
    eps = [_episode(k, m) for k, m in enumerate(MOVING_S)] + [_episode(99, 19.0, pause_s=2.0)]
    for min_idle_s in (1.5, 5.0):
        (length,) = [f for f in score_episodes(eps, CurationSettings(min_idle_s=min_idle_s))[-1] if f.check == "length"]
        assert length.reason.startswith("moves for 19.0 s (of 21.6 s; still stretches aside) against a median of 9.0 s")
