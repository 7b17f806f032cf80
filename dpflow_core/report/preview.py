"""Episode previews: a strip of decoded frames, the 3-D camera path and the gripper width, as one PNG.

Takes an :class:`~dpflow_core.report.quality.EpisodeQuality` row and its :class:`PreviewData`; gives
the PNG (matplotlib, Agg backend) and, for Dagster's metadata, a JPEG thumbnail as a data URI.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.files import atomic_path

@dataclass(frozen=True)
class PreviewData:
    """What a preview is drawn from (the decoded strip and the low-rate streams).

    Attributes:
        frames: [(capture_time_ns, (H, W, 3) uint8 RGB)] evenly spaced decoded frames.
        t0_ns: capture time of the episode start (ns).
        position_m: (M, 3) float64 camera positions, metres.
        pose_valid: (M,) bool.
        gripper_ts_ns: (G,) int64; gripper_width_m: (G,) float64 metres.
    """

    frames: list[tuple[int, np.ndarray]]
    t0_ns: int
    position_m: np.ndarray
    pose_valid: np.ndarray
    gripper_ts_ns: np.ndarray
    gripper_width_m: np.ndarray


def draw_preview(quality, data: PreviewData, out_png: str | Path) -> Path:
    """Draw an episode's preview PNG (900 x 400 px).

    Top: the decoded frames with their time (s). Bottom left: the 3-D camera
    trajectory in metres on equal axes, start in green, ``pose_valid == false``
    poses in red. Bottom right: gripper width (mm) over time (s), ``pose_valid``
    gaps shaded red. The title says when the episode is an outlier. Written to a
    temporary name in the same folder, then renamed. ``quality``: the episode's
    :class:`~dpflow_core.report.quality.EpisodeQuality` row (not imported here: quality.py
    draws through this module).
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    out_png = Path(out_png)
    frames, t0_ns = data.frames, data.t0_ns
    cols = max(len(frames), 2)
    fig = Figure(figsize=(9.0, 4.0), dpi=100)
    fig.subplots_adjust(left=0.04, right=0.98, top=0.88, bottom=0.12, hspace=0.25, wspace=0.25)
    grid = fig.add_gridspec(2, 2 * cols, height_ratios=[1, 1.7])
    for i, (ts, img) in enumerate(frames):
        ax = fig.add_subplot(grid[0, 2 * i : 2 * i + 2])
        ax.imshow(img)
        ax.set_axis_off()
        ax.set_title(f"{(ts - t0_ns) / 1e9:.1f} s", fontsize=7, pad=2)
    ax3 = fig.add_subplot(grid[1, :cols], projection="3d")
    p, v = data.position_m, data.pose_valid
    ax3.plot(p[:, 0], p[:, 1], p[:, 2], lw=1.0, color="tab:blue")
    if (~v).any():
        ax3.scatter(p[~v, 0], p[~v, 1], p[~v, 2], s=4, color="tab:red", label="pose_valid=false")
        ax3.legend(fontsize=6, loc="upper left")
    ax3.scatter(*p[0], s=14, color="tab:green")
    centre = (p.max(axis=0) + p.min(axis=0)) / 2
    half = max(float(np.ptp(p, axis=0).max()) / 2, 1e-3)
    for setter, c in zip((ax3.set_xlim, ax3.set_ylim, ax3.set_zlim), centre):
        setter(c - half, c + half)
    for setter, name in zip((ax3.set_xlabel, ax3.set_ylabel, ax3.set_zlabel), "xyz"):
        setter(f"{name} (m)", fontsize=6, labelpad=-6)
    for axis in (ax3.xaxis, ax3.yaxis, ax3.zaxis):
        axis.set_major_locator(MaxNLocator(3))  # fewer ticks: a 3-D axis draws each one in Python
    ax3.tick_params(labelsize=5, pad=-2)
    axg = fig.add_subplot(grid[1, cols:])
    axg.plot((data.gripper_ts_ns - t0_ns) / 1e9, data.gripper_width_m * 1e3, lw=1.0, color="tab:purple")
    for g in quality.pose_gaps:
        axg.axvspan(g.start_s, g.end_s, color="tab:red", alpha=0.2, lw=0)
    axg.set_xlabel("time (s)", fontsize=7)
    axg.set_ylabel("gripper width (mm)", fontsize=7)
    axg.tick_params(labelsize=6)
    title = f"{quality.stem}: {quality.duration_s:.1f} s, score median {quality.score_median:.2f}"
    if quality.is_outlier:
        title += "  OUTLIER: " + "; ".join(quality.outlier_reasons)
    fig.suptitle(title, fontsize=8, color="tab:red" if quality.is_outlier else "black")
    with atomic_path(out_png, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return out_png


def thumbnail_data_uri(png: str | Path, width: int, *, quality: int = 80) -> str:
    """A ``data:image/jpeg;base64,...`` URI of ``png`` scaled to ``width`` pixels (aspect kept), JPEG ``quality``.

    For a table shown where local files cannot be read (a web UI). Returns ``""`` when the file
    cannot be read as an image or encoded (OpenCV ``imread``/``imencode``).
    """
    import cv2

    image = cv2.imread(str(png), cv2.IMREAD_COLOR)
    if image is None:
        return ""
    height = max(1, round(image.shape[0] * width / image.shape[1]))
    ok, data = cv2.imencode(".jpg", cv2.resize(image, (width, height), interpolation=cv2.INTER_AREA),
                            [cv2.IMWRITE_JPEG_QUALITY, quality])
    return f"data:image/jpeg;base64,{base64.b64encode(data.tobytes()).decode('ascii')}" if ok else ""
