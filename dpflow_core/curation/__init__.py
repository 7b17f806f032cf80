"""Curation: which demonstrations of a task help training, which hurt, and a person's last word.

- :mod:`~dpflow_core.curation.features`: the figures one recording shows (still stretches,
  gripper events, approach loops, the scene where the gripper lets go, the track);
- :mod:`~dpflow_core.curation.score`: checks of those figures against limits and against
  the task's other episodes, each finding with its ratio and reason (near misses included);
  an automatic decision per episode;
- :mod:`~dpflow_core.curation.apply`: a person's labels (keep or drop per stem) over the
  automatic decisions, idle stretches cut out of copies of the recordings (provenance
  kept), and the curated pairing manifest that conversion reads as any other.
"""

from dpflow_core.curation.score import CHECKS, CurationSettings, Finding, Scores, auto_decision, score_episodes

__all__ = ["CHECKS", "CurationSettings", "Finding", "Scores", "auto_decision", "score_episodes"]
