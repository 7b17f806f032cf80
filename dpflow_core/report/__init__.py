"""Episode quality at a glance: per-episode measurements, outlier flags and previews.

Before anyone trains, a lab wants to see its demonstrations. For every accepted
episode of a pairing manifest this module reads the ``<STEM>_vio.mcap`` once
(:func:`dpflow_core.recordings.read_streams`) and measures:

- duration (the overlap of camera, pose and gripper streams, which is what
  conversion keeps) and the full recorded span;
- the measured rate of each stream (1 / median capture interval, robust to drops);
- the VIO ``score`` distribution and the ``pose_valid == false`` gaps (VIO lost
  tracking), each gap measured from its first invalid pose to the next valid one;
- camera frames trimmed (outside the stream overlap), dropped (capture intervals
  longer than 1.5 median intervals) and undecodable (before the first IDR frame);
- the gripper width range;
- the plausibility findings of the pose and gripper streams (:mod:`dpflow_core.recordings.plausibility`:
  spikes, jumps, frozen VIO, a dead, stuck or out-of-range gripper, a quaternion convention the IMU
  contradicts), each of which flags the episode;
- the camera's and the IMU's offsets against the pose clock, measured from the recording
  (:mod:`dpflow_core.offsets`); an offset farther than
  :attr:`~dpflow_core.offsets.OffsetOptions.flag_threshold_s` from the task's median flags the episode;
- a preview PNG: a strip of frames decoded by conversion's own decoder (any number of access
  units per message, B-frames placed by presentation time), the 3-D trajectory and the gripper
  width over time (matplotlib, Agg backend).

Outliers are flagged with a modified z-score against the task's median
(Iglewicz & Hoaglin, "How to Detect and Handle Outliers", ASQC 1993): an
episode is an outlier on a metric when ``|x - median| > 3.5 * scale`` where
``scale = 1.4826 * MAD``, floored by a per-metric minimum (:data:`OUTLIER_FLOORS`)
so that a task whose episodes agree exactly (MAD = 0) does not flag noise.

:func:`write_report` writes ``report.html`` (a table with the previews beside it
in ``previews/``) and ``quality.json``; :func:`markdown_table` gives the same
table as Markdown for a Dagster materialization.

Modules: :mod:`~dpflow_core.report.quality` (the measurements and the outlier rule),
:mod:`~dpflow_core.report.preview` (the PNG) and :mod:`~dpflow_core.report.render` (HTML, JSON,
Markdown); the names other code uses are re-exported here.
"""

from __future__ import annotations

from dpflow_core.report.preview import PreviewData, draw_preview, thumbnail_data_uri
from dpflow_core.report.quality import (
    OUTLIER_FLOORS, OUTLIER_Z, PREVIEW_WIDTH, STRIP_FRAMES, EpisodeQuality, PoseGap, decode_camera_strip,
    episode_quality, flag_outliers,
)
from dpflow_core.report.render import (
    ReportResult, markdown_table, quality_figures, report_dir_for, write_report,
)

__all__ = [
    "OUTLIER_FLOORS", "OUTLIER_Z", "PREVIEW_WIDTH", "STRIP_FRAMES", "EpisodeQuality", "PoseGap", "PreviewData",
    "ReportResult", "decode_camera_strip", "draw_preview", "episode_quality", "flag_outliers", "markdown_table",
    "quality_figures", "report_dir_for", "thumbnail_data_uri", "write_report",
]
