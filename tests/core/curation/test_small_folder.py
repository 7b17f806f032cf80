"""`curate` on a folder too small for the task-relative checks: a trial on 4 random-motion sample episodes
dropped 2 as "comes down after a rise 2 times where the task's episodes usually do 1", where two of the
four do 2. Below ``min_task_episodes`` those checks warn, a tie is no usual number, and every episode
still gets a score."""

from __future__ import annotations

import json

from dpflow_core.curation.apply import curate
from dpflow_core.pairing import pair_recordings
from dpflow_core.recordings.samples import SampleSpec, write_task


def test_four_random_episodes_are_kept_with_warnings(tmp_path):
    write_task(tmp_path / "rec", episodes=4, seed=0, task="rand", spec=SampleSpec(width=64, height=48))
    result = curate(pair_recordings(tmp_path / "rec" / "rand"), tmp_path / "cur")
    loops = sorted(e["figures"]["approach_loops"] for e in result.episodes)
    assert loops == [1, 1, 2, 2]  # the trial's split vote
    assert [e["decision"] for e in result.episodes] == ["keep"] * 4 and result.dropped == 0
    assert result.warnings[0].startswith("only 4 episodes: too few for the task-relative checks")
    assert any(w.startswith("approach_loops not checked") for w in result.warnings)
    report = json.loads(result.report_path.read_text())
    assert report["warnings"] == result.warnings
    assert all(e["score"] == max(e["ratios"].values()) for e in report["episodes"])
    assert "warning: only 4 episodes" in result.table()
