"""Episode rates: each episode's measured frame rate against its task's, and what is done with one at another rate.

Takes the aligned episodes' summaries (from :func:`~dpflow_core.conversion.jobs.align_all`), each with
its measured ``frequency_hz`` (1 / its median frame interval); gives the parts to write, the episodes
rejected and the rate groups set aside. The task's rate is that of the largest group of episodes whose
rates agree within ``frequency_tolerance`` (relative): a majority, not a mean of two camera settings.
An episode outside that group is, by ``rate_policy``:

* ``"resample"`` (default): put on the task's time grid, ``1 / rate`` apart from its first frame to its
  last. Images: the latest frame captured at or before each grid time (sample and hold, what the
  camera had shown by then: a frame is never invented or blended), copied from the frames already in
  the dataset file; position and gripper width: linear interpolation of the episode's aligned values,
  rotation: scipy ``Slerp``. Provenance in ``episodes[].resampled`` and a ``rate_resampled`` warning.
  Resampled episodes follow the others in the dataset (their frames are appended after them).
* ``"group"``: kept as a dataset of its own, one per rate group, beside the output
  (``<stem>-<rate>hz.npz`` with its own sidecar and norm stats, converted from the same cache), listed in
  the main dataset's ``rate_groups``.
* ``"reject"``: left out as ``frequency_mismatch`` with the figures.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from dpflow_core.conversion.align import LOWDIM_KEYS
from dpflow_core.conversion.settings import RATE_POLICIES  # noqa: F401 (re-exported: the export's rates use it)


def rate_groups(rates_hz: Sequence[float], tolerance: float) -> list[list[int]]:
    """Indices of ``rates_hz`` grouped by agreeing rate, the task's group first.

    Repeatedly, among the episodes not yet grouped: the episode with the most others within
    ``tolerance`` (relative, of its rate) of it (ties: the one nearest their median) founds a group
    of exactly those. Every index is in one group; groups keep index order.
    """
    rates = [float(r) for r in rates_hz]
    remaining = list(range(len(rates)))
    groups = []
    while remaining:
        near = {i: [j for j in remaining if abs(rates[j] - rates[i]) <= tolerance * rates[i]] for i in remaining}
        median = float(np.median([rates[j] for j in remaining]))
        best = max(remaining, key=lambda i: (len(near[i]), -abs(rates[i] - median)))
        groups.append(near[best])
        remaining = [j for j in remaining if j not in set(near[best])]
    return groups


def group_rate_hz(rates_hz: Sequence[float], group: Sequence[int]) -> float:
    """A group's rate: the median of its episodes' measured rates, Hz."""
    return float(np.median([rates_hz[i] for i in group]))


def group_path(out: Path, rate_hz: float) -> Path:
    """Where a rate group's own dataset goes beside ``out``: ``dataset.npz`` -> ``dataset-15hz.npz``.

    The rate in whole Hz when that is within 1 % of the measured one (60.1 -> 60, 29.97 -> 30: the
    setting, not the clock's jitter), else to 0.1 Hz (5.3).
    """
    whole = round(rate_hz)
    label = str(whole) if whole and abs(rate_hz - whole) <= 0.01 * rate_hz else f"{rate_hz:.1f}"
    return out.with_name(f"{out.stem}-{label}hz{out.suffix}")


def sample_and_hold_grid(t_s: np.ndarray, rate_hz: float) -> tuple[np.ndarray, np.ndarray]:
    """The grid of an episode resampled to ``rate_hz`` and the frame each grid time shows.

    Args:
        t_s: (N,) float64 strictly increasing frame times, seconds.
        rate_hz: the target rate, Hz.

    Returns:
        grid (M,) float64 seconds, ``t_s[0] + k / rate_hz`` up to ``t_s[-1]``, and source (M,) int64:
        the index of the latest frame at or before each grid time (a microsecond of slack, so a frame
        stamped at a grid time is that time's frame).
    """
    period = 1.0 / rate_hz
    m = int(np.floor((t_s[-1] - t_s[0]) / period + 1e-6)) + 1
    grid = t_s[0] + np.arange(m) * period
    source = np.searchsorted(t_s, grid + 1e-6, side="right") - 1
    return grid, source.astype(np.int64)


def resample_pose(t_s: np.ndarray, grid: np.ndarray, pos: np.ndarray, rotvec: np.ndarray, gripper: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An episode's pose and gripper width at the times ``grid``: position and width linear (``np.interp``), rotation
    scipy ``Slerp`` (the module docstring's rule; the LeRobot export uses it too).

    Args:
        t_s: (N,) float64 strictly increasing sample times, seconds; ``grid`` (M,) within them.
        pos: (N, 3) metres; rotvec: (N, 3) rotation vectors, radians; gripper: (N,) or (N, 1) metres.

    Returns:
        (M, 3) position, (M, 3) rotation vector, (M, 1) width, float32.
    """
    from scipy.spatial.transform import Rotation, Slerp

    pos_m = np.stack([np.interp(grid, t_s, pos[:, d]) for d in range(3)], axis=1).astype(np.float32)
    rot_m = Slerp(t_s, Rotation.from_rotvec(np.asarray(rotvec, np.float64)))(grid).as_rotvec().astype(np.float32)
    width = np.interp(grid, t_s, np.asarray(gripper).reshape(len(t_s), -1)[:, 0]).astype(np.float32)[:, None]
    return pos_m, rot_m, width


def resample_part(part: dict, rate_hz: float, writer, out_dir: Path, tag: tuple) -> dict:
    """One aligned part put on the ``rate_hz`` grid (see the module docstring); its frames appended to ``writer``.

    Args:
        part: a part summary of :func:`~dpflow_core.conversion.jobs.align_all` whose frames ``writer``
            holds as the piece tagged ``tag``.
        rate_hz: the dataset's rate, Hz.
        writer: the :class:`~dpflow_core.replay_buffer.writer.NpzStreamWriter` of the dataset; the
            resampled frames are appended to it from its own file, as pieces tagged ``(*tag, "rate", q)``.
        out_dir: a scratch folder for the resampled low-dimensional arrays (``.npy``).

    Returns:
        The resampled part: ``n``, ``files``, ``ranges``, ``report`` (``frames``, ``frequency_hz`` and
        ``resampled``: {from_hz, to_hz, frames_before, frames_after, images, low_dim}) and ``tags``, the
        pieces that now hold its frames in order.
    """
    files = part["files"]
    t_s = np.load(files["timestamp"])
    grid, source = sample_and_hold_grid(t_s, rate_hz)
    arrays = {"timestamp": grid}
    (arrays["robot0_eef_pos"], arrays["robot0_eef_rot_axis_angle"], arrays["robot0_gripper_width"]) = resample_pose(
        t_s, grid, np.load(files["robot0_eef_pos"]), np.load(files["robot0_eef_rot_axis_angle"]),
        np.load(files["robot0_gripper_width"]))
    for key in ("robot0_demo_start_pose", "robot0_demo_end_pose"):
        arrays[key] = np.repeat(np.load(files[key])[:1], len(grid), axis=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    new_files = {}
    for key in ("timestamp", *LOWDIM_KEYS):
        new_files[key] = str(out_dir / f"{key}.npy")
        np.save(new_files[key], np.ascontiguousarray(arrays[key]))

    piece = next(p for p in writer.pieces if p.tag == tag)
    row = writer.row_bytes
    # Runs of consecutive source rows become one piece each: a held frame starts a new run.
    breaks = np.flatnonzero(np.diff(source) != 1) + 1
    tags = []
    for q, run in enumerate(np.split(source, breaks)):
        tags.append((*tag, "rate", q))
        writer.append(tags[-1], writer.path, piece.offset + int(run[0]) * row, len(run) * row)
    frames = np.memmap(writer.path, np.uint8, mode="r", offset=piece.offset,
                       shape=(len(t_s), *writer.frame_shape))[np.unique(source)]
    ranges = {key: {"min": np.min(a, axis=0).tolist(), "max": np.max(a, axis=0).tolist()}
              for key, a in arrays.items() if key != "timestamp"}
    ranges["camera0_rgb"] = {"min": int(frames.min()), "max": int(frames.max())}
    from_hz = float(part["report"]["frequency_hz"])
    report = {**part["report"], "frames": len(grid), "frequency_hz": rate_hz, "resampled": {
        "from_hz": from_hz, "to_hz": rate_hz, "frames_before": len(t_s), "frames_after": len(grid),
        "images": "latest frame at or before each step (sample and hold)",
        "low_dim": "position and gripper width linear, rotation slerp, from the episode's aligned values",
    }}
    return {**part, "n": len(grid), "files": new_files, "ranges": ranges, "report": report, "tags": tags}


def subset_inputs(inputs, stems: Sequence[str]):
    """The :class:`~dpflow_core.conversion.inputs.ConversionInputs` of only ``stems`` of ``inputs`` (the same
    manifests, task, root and topics; nothing rejected), for a rate group's own dataset: gathered already, so
    the group's conversion reads no manifest again."""
    wanted = set(stems)
    return replace(inputs, episodes=[e for e in inputs.episodes if e.stem in wanted], rejected=[])


def apply_rate_policy(ok: list[tuple[int, dict]], policy: str, tolerance: float, writer, work: Path
                      ) -> tuple[list[dict], list[dict], list[tuple[float, list[str]]]]:
    """Sort the aligned episodes by rate (module docstring) once every frame is in ``writer``.

    Args:
        ok: (episode index, summary) of the episodes aligned without error, in manifest order.
        policy: one of :data:`RATE_POLICIES`.
        tolerance: ``frequency_tolerance``, relative.
        writer: the dataset's frame writer (every part's frames appended, tagged (index, part)).
        work: the conversion's scratch folder.

    Returns:
        (parts to write, in dataset order, each with ``tags``, ``seconds``, ``peak_rss_mb``, ``cached``,
        ``in_cache``; rejected entries ``frequency_mismatch``; rate groups set aside under ``"group"``:
        (rate Hz, stems)).
    """
    rates = [float(r["report"]["frequency_hz"]) for _, r in ok]
    groups = rate_groups(rates, tolerance)
    ref_hz = group_rate_hz(rates, groups[0])
    main = set(groups[0])
    aside = [(group_rate_hz(rates, g), [ok[j][1]["stem"] for j in g]) for g in groups[1:]] if policy == "group" else []
    kept, resampled, rejected = [], [], []
    for j, (i, r) in enumerate(ok):
        run = {"seconds": r["seconds"], "peak_rss_mb": r["peak_rss_mb"], "cached": r.get("cached", False),
               "in_cache": r.get("in_cache", False)}
        if j in main:
            kept.extend({**part, **run, "tags": [(i, k)]} for k, part in enumerate(r["parts"]))
        elif policy == "reject":
            dev = abs(rates[j] - ref_hz) / ref_hz
            rejected.append({
                "stem": r["stem"], "stage": "conversion", "path": r["report"]["path"], "code": "frequency_mismatch",
                "reason": f"measured {rates[j]:.3f} Hz differs from the dataset's {ref_hz:.3f} Hz by {dev:.1%} "
                          f"(tolerance {tolerance:.1%})",
            })
        elif policy == "resample":
            resampled.extend({**resample_part(part, ref_hz, writer, work / f"rate-{i:06d}-{k:03d}", (i, k)), **run}
                             for k, part in enumerate(r["parts"]))
    return kept + resampled, rejected, aside
