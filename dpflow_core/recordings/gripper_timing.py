"""Is the gripper's width stamped on the camera's clock? (the plausibility class ``gripper_offset``)

A gripper-width stream stamped a second late (every sample's stamp shifted by +1 s, or -1 s) parses, overlaps
and converts: each frame meets a width, just the one of a second earlier or later, and the policy learns to close
the gripper a second after the fingers closed. The wrist camera sees the fingers (the simulated world's, a UMI-style
device's), so the recording itself says when they moved.

Method (the camera offset's lag scan, :mod:`dpflow_core.offsets`, on another pair of signals):

- **where the image changes** (:meth:`~dpflow_core.offsets.ImageMotion.cell_change`, kept in the pass that tracks
  the image motion, no second decode): per tracked frame pair, the absolute change of each of the 8 x 8 cell means
  of the grey frame (grey levels). A cell the fingers cross changes when they move, whatever the camera does
  (they are fixed to it); a cell of the scene changes when the camera moves. Each cell's change is regressed on the
  pair's background change (the median over the 64 cells) and an intercept, and the residual kept.
- **the gripper's motion**: ``|w(b + tau) - w(a + tau)| / (b - a)`` (m/s), the width interpolated linearly at the
  pair's times ``[a, b]`` shifted by ``tau`` (held at its end values beyond the stream).
- **which cells**: each cell's best squared correlation with the gripper's motion at any ``tau`` within ``+-2
  search_s`` (a 20 ms grid); the cells reaching :data:`SELECT_SHARE` of the best cell's are summed into one signal.
  The choice looks at every offset alike, so it favours none.
- **the scan**: the signal regressed on the gripper's motion at each ``tau`` (``R^2(tau)``, coarse then fine grid
  over ``+-search_s``, parabola refinement), judged as the camera's offset (:func:`dpflow_core.offsets.estimate_offset`:
  peak ``R^2``, contrast, at the search limit) with :data:`GRIPPER_OPTIONS`. Not measurable, too, when the gripper
  barely moves (its width's 1st to 99th percentile under :data:`MIN_TRAVEL_M`) or the image signal is flat.

Sign: the offset is how many seconds *later* the gripper's stamps are than the camera's (a width stream stamped 1 s
late measures +1.0 s: the fingers move in the image at camera time ``t`` and in the width stream at ``t + 1``).

Measured (``record_task``'s world, both tasks, episodes 1-12 each, at 64 x 64 and 128 x 128 px: 48 episodes, each
written as recorded and with its gripper stamps shifted by +-0.3, +-0.5 and +-1.0 s, and converted by
:func:`~dpflow_core.conversion.align_episode` at its own size):

- honest: all 48 measured, -0.010 to +0.012 s (median -0.001 s, 1.4826 MAD 0.005 s), ``R^2`` 0.66-0.89, contrast
  0.64-0.85; shifted: all 288 measured, each within 0.012 s of its shift (both signs), ``R^2`` 0.66-0.88, contrast
  0.64-0.86; 10 of the honest ones converted at 32, 48, 96 and 224 px: -0.011 to +0.011 s, ``R^2`` 0.72-0.82;
- the same frames with the finger rows left out (a camera that does not see the fingers): ``R^2`` at most 0.14, none
  measured; another episode's gripper stream: 21 of 24 not measurable, 3 measured at arbitrary offsets (-1.24 to
  -0.06 s, contrast 0.62-0.69: a stream that does not belong is no better than a late one);
- random-motion samples (``samples.write_episode``: 2.5 to 8 s, 96 x 72 to 320 x 240 px converted at 48 x 36 to 160
  x 120; their fingers are dark bars whose width follows a slow sigmoid, 0.7 s from 10 to 90 %), 20 episodes, each
  also shifted as above (132 conversions; the 2.5 s ones shifted by 1 s are ``low_coverage``): ``R^2`` at most 0.69,
  contrast at most 0.38 (the slow closing leaves a broad peak), none measured.

So ``min_contrast`` 0.5 lies 1.3 times under the world's least and 1.3 times over the samples' most; an honest offset
stays within 12 ms of zero, so the plausibility rule (:func:`check_gripper_offset`) warns beyond
``gripper_offset_warn_s`` 0.1 s (8 times the largest honest offset) and refuses beyond ``gripper_offset_max_s``
0.25 s: a gripper action that late misses the grasp the hand slows down for (the world's fingers close in 0.3 s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import Any, Mapping

import numpy as np

from dpflow_core.offsets import DEFAULT_OPTIONS, OffsetEstimate, OffsetOptions, estimate_offset, interp_rows

#: The scan's settings: the camera offset's, searched over +-1.5 s (a gripper 1 s late is inside), a contrast taken
#: 0.2 s from the peak (the fingers take about 0.3 s to close) and of at least 0.5 (module docstring); the gripper's
#: motion, not the VIO's rotation, decides whether there is anything to measure.
GRIPPER_OPTIONS = replace(DEFAULT_OPTIONS, search_s=1.5, contrast_window_s=0.2, min_contrast=0.5, min_rotation_rps=0.0)
#: The gripper's width must span at least this much (m, 1st to 99th percentile) to be measured.
MIN_TRAVEL_M = 0.01
#: Cells whose best fit reaches this share of the best cell's are summed into the signal.
SELECT_SHARE = 0.5


def gripper_offset(frame_ts_ns: np.ndarray, pairs: np.ndarray, cell_change: np.ndarray, gripper_ts_ns: np.ndarray,
                   gripper_width_m: np.ndarray, options: OffsetOptions = GRIPPER_OPTIONS) -> dict[str, Any]:
    """The gripper-width stream's offset against the camera of one episode (method: module docstring).

    Args:
        frame_ts_ns: (K,) int64 camera stamps of the frames :class:`~dpflow_core.offsets.ImageMotion` numbered.
        pairs: (P, 2) int64 frame numbers (:meth:`~dpflow_core.offsets.ImageMotion.result`); cell_change: (P, 64)
            float (:meth:`~dpflow_core.offsets.ImageMotion.cell_change`, grey levels).
        gripper_ts_ns: (G,) int64 gripper stamps; gripper_width_m: (G,) float widths, m.
        options: the scan's grids and confidence rules (:data:`GRIPPER_OPTIONS`).

    Returns:
        :meth:`OffsetEstimate.to_dict` of stream ``gripper`` (``offset_s`` seconds the gripper's stamps are later
        than the camera's, None unless ``measured``; ``rotation_rms_rps`` None) with ``travel_m`` (the width's 1st
        to 99th percentile span, m) and ``cells`` (the cells summed, row-major in the 8 x 8 grid).
    """
    t0 = int(frame_ts_ns[0]) if len(frame_ts_ns) else 0
    g_t = (np.asarray(gripper_ts_ns, np.int64) - t0) / 1e9
    width = np.asarray(gripper_width_m, np.float64)
    order = np.argsort(g_t, kind="stable")
    g_t, width = g_t[order], width[order]
    keep = np.isfinite(width) & np.concatenate([[True], np.diff(g_t) > 0])
    g_t, width = g_t[keep], width[keep][:, None]
    travel = float(np.percentile(width, 99) - np.percentile(width, 1)) if len(width) else 0.0

    def result(est: OffsetEstimate, cells=()) -> dict[str, Any]:
        return {**replace(est, rotation_rms_rps=None).to_dict(), "travel_m": round(travel, 5), "cells": [int(c) for c in cells]}

    if len(g_t) < 3 or not len(pairs):
        return result(OffsetEstimate("gripper", "not_measurable", reason=f"{len(g_t)} gripper samples, {len(pairs)} frame pairs"))
    if travel < MIN_TRAVEL_M:
        return result(OffsetEstimate("gripper", "not_measurable", reason=(
            f"the gripper barely moves: its width spans {travel * 1e3:.1f} mm, under {MIN_TRAVEL_M * 1e3:g} mm")))
    ts = (np.asarray(frame_ts_ns, np.int64) - t0) / 1e9
    a, b = ts[pairs[:, 0]], ts[pairs[:, 1]]
    period = float(np.median(b - a))
    change = np.asarray(cell_change, np.float64)
    ok = np.isfinite(change).all(axis=1) & (b - a > 0) & (b - a <= 1.5 * period) & (a >= g_t[0]) & (b <= g_t[-1])
    use = np.flatnonzero(ok)
    a, b, change = a[use], b[use], change[use]
    if len(use) < options.min_samples:
        return result(OffsetEstimate("gripper", "not_measurable", samples=int(len(use)), reason=(
            f"{len(use)} frame pairs inside the gripper stream, fewer than {options.min_samples}")))
    background = np.stack([np.ones(len(use)), np.median(change, axis=1)], axis=1)
    resid = change - background @ np.linalg.lstsq(background, change, rcond=None)[0]

    def regressors(taus: np.ndarray) -> np.ndarray:
        moved = interp_rows(b[None] + taus[:, None], g_t, width) - interp_rows(a[None] + taus[:, None], g_t, width)
        return np.abs(moved) / (b - a)[None, :, None]

    lags = regressors(np.arange(-2 * options.search_s, 2 * options.search_s + 1e-9, 0.02))[..., 0]
    lags = lags - lags.mean(axis=1, keepdims=True)
    centred = resid - resid.mean(axis=0)
    r2 = (lags @ centred) ** 2 / np.maximum((lags**2).sum(1)[:, None] * (centred**2).sum(0)[None], 1e-30)
    best = r2.max(axis=0)
    cells = np.flatnonzero(best >= SELECT_SHARE * best.max())
    signal = resid[:, cells].sum(axis=1, keepdims=True)
    if float(np.std(signal)) < 1e-6:
        return result(OffsetEstimate("gripper", "not_measurable", samples=int(len(use)), reason=(
            "the image does not change where the fingers would be: a flat signal")), cells)
    return result(estimate_offset("gripper", signal, regressors, math.inf, options, period), cells)


def measure_gripper(motion: Any, frame_ts_ns: np.ndarray, gripper_ts_ns: np.ndarray | None,
                    gripper_width_m: np.ndarray | None, options: OffsetOptions = GRIPPER_OPTIONS) -> dict[str, Any]:
    """The keys of a ``dataset.json`` episode entry: ``gripper_offset_s`` (seconds or None) and ``gripper_offset``
    (:func:`gripper_offset`'s dict), from ``motion`` (an :class:`~dpflow_core.offsets.ImageMotion` that has seen every
    frame of ``frame_ts_ns``, (K,) int64 ns, in order) and the gripper stream ((G,) int64 ns, (G,) m; None or empty:
    ``absent``)."""
    if gripper_ts_ns is None or gripper_width_m is None or not len(gripper_ts_ns):
        est = {**OffsetEstimate("gripper", "absent", reason="the recording has no gripper messages").to_dict(),
               "travel_m": None, "cells": []}
    else:
        pairs, _ = motion.result()
        est = gripper_offset(frame_ts_ns, pairs, motion.cell_change(), gripper_ts_ns, gripper_width_m, options)
    return {"gripper_offset_s": est["offset_s"], "gripper_offset": est}


def check_gripper_offset(offsets: Mapping[str, Any], t0_ns: int, gripper_ts_ns: np.ndarray, opts: Any = None) -> list:
    """``gripper_offset`` findings of one episode: its gripper stream measured (:func:`measure_gripper`) off the pose
    clock by more than ``gripper_offset_warn_s`` is warned, by more than ``gripper_offset_max_s`` takes the class's
    policy (``reject`` by default).

    The gripper is measured against the camera; a camera whose own stamps are late against the pose clock (a lab's
    camera pipeline is often 0.1-0.2 s late, which ``task.camera_obs_latency`` or ``task.latency: measured`` takes
    care of) makes an honest gripper look early by as much. So when the camera's offset against the pose clock is
    measured (``camera_offset_s``), the gripper is judged on the sum: its offset against the pose clock. When it is
    not, either stream may be the late one and the finding only warns, whatever its size.

    Args:
        offsets: holds ``gripper_offset`` (:func:`gripper_offset`'s dict; anything but ``measured``: no finding) and
            ``camera_offset_s`` (s or None, :func:`~dpflow_core.offsets.measure_offsets`).
        t0_ns: the episode start; gripper_ts_ns: (G,) int64 the gripper stamps (the finding spans them).
        opts: a :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions` (None: the defaults).

    Returns:
        ``[Finding]`` (value: ``|offset|`` s against the pose clock, or against the camera's when the camera's is
        unknown; limit: the threshold it passed) or ``[]``.
    """
    from dpflow_core.recordings.plausibility import Finding, PlausibilityOptions, new_finding

    opts = PlausibilityOptions() if opts is None else opts
    est = offsets.get("gripper_offset") or {}
    off_camera, camera = est.get("offset_s"), offsets.get("camera_offset_s")
    if est.get("status") != "measured" or off_camera is None or not len(gripper_ts_ns):
        return []
    off = off_camera + camera if camera is not None else off_camera
    if abs(off) <= opts.gripper_offset_warn_s:
        return []
    late = "later" if off > 0 else "earlier"
    limit = opts.gripper_offset_max_s if abs(off) > opts.gripper_offset_max_s else opts.gripper_offset_warn_s
    against = (f"the pose clock's ({off_camera:+.3f} s against the camera's, whose stamps are {camera:+.3f} s against "
               "the pose clock)" if camera is not None else
               "the camera's (the camera's own offset against the pose clock is not measured, so either stream may be "
               "the late one)")
    a, b = (int(np.min(gripper_ts_ns)) - t0_ns) / 1e9, (int(np.max(gripper_ts_ns)) - t0_ns) / 1e9
    f = new_finding(
        opts, "gripper_offset", "gripper", a, b, abs(off), limit, "s", offset_s=off, offset_vs_camera_s=off_camera,
        camera_offset_s=camera, r2=est.get("r2"), contrast=est.get("contrast"),
        why=f"the gripper width's stamps are {abs(off):.3f} s {late} than {against}: the fingers move in the image "
            f"{abs(off_camera):.3f} s {'before' if off_camera > 0 else 'after'} the width stream says (R^2 "
            f"{est.get('r2'):.2f}, contrast {est.get('contrast'):.2f} over {est.get('samples')} frame pairs); a policy "
            f"trained on it acts on the gripper {abs(off):.2f} s {'late' if off > 0 else 'early'}")
    if limit == opts.gripper_offset_max_s and camera is not None:
        return [f]
    note = (f"under gripper_offset_max_s {opts.gripper_offset_max_s:g} s: warned" if camera is not None else
            "the camera's offset against the pose clock is not measured: warned, not judged")
    return [Finding(**{**asdict(f), "policy": "warn", "action": "warned", "detail": {**f.detail, "note": note}})]
