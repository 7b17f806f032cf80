"""Stream offsets measured from the recording itself: how late the camera's and the IMU's stamps are
against the VIO pose clock.

The trainer shifts low-dimensional observations by latencies in seconds (``task.camera_obs_latency``
and the others); a recording whose camera stamps lag their capture by ``L`` seconds pairs each frame
with a pose ``L`` seconds newer than the one it saw. Every recording already holds what is needed to
measure ``L``: the camera's own motion between consecutive frames must match the VIO track's motion,
and the IMU's gyro must match the VIO's angular velocity.

Method (a lag scan of a linear fit: a cross-correlation of vector signals of unknown axes and units):

- **image motion** (:class:`ImageMotion`): consecutive decoded frames, grey and reduced to about
  :attr:`OffsetOptions.thumb_width` pixels, are tracked with Lucas-Kanade optical flow on a 7 x 7
  grid (OpenCV ``calcOpticalFlowPyrLK``) and fitted with a 4-parameter similarity by trimmed least
  squares: shift x, shift y (fractions of the width), in-plane rotation (rad) and scale change per
  frame pair. Trimming keeps the background's motion and drops what moves with the camera (the
  gripper's fingers, a held object).
- **VIO motion**: the pose track's increments in the camera's own frame, rotation (the relative
  rotation's vector, rad) and translation (m), summed into cumulative tracks so that the increment
  over any interval is a difference of two interpolations.
- **the scan**: for each candidate offset ``tau`` the image motion of the frame pair stamped
  ``[a, b]`` is regressed (least squares with intercept, standardised targets) on the VIO increment
  over ``[a - tau, b - tau]``; the fraction of variance explained, ``R^2(tau)``, peaks at the true
  offset. The map between image and camera axes, the focal length and the scene depth are absorbed
  by the fit, so nothing about the camera need be known. The scan runs on a coarse grid over
  ``+-search_s``, then on a fine one around the best, refined by a parabola through the top three.
- **does the camera belong to the poses** (:attr:`OffsetEstimate.fast_r2`): the same fit, both sides
  high-passed (each less its centred mean over :attr:`OffsetOptions.fast_window_s`), best over
  ``+-2 search_s``, beside the share of the high-passed image motion that stands above its frame-to-frame
  noise (``fast_ceiling``, what an honest camera's fit can reach). Slow smooth motion fits any other slow
  motion (two unrelated random-motion samples reach the honest pair's ``R^2``, 0.53 to 0.97); the fast part of
  a hand's motion does not. :func:`dpflow_core.recordings.camera_pose.check_camera_pose` judges it.
- **IMU**: gyro readings integrated (trapezoid) and differenced over the VIO pose intervals shifted
  by ``tau``, regressed the same way against the VIO rotation increments; any fixed IMU-to-camera
  rotation is absorbed by the fit.

Sign: an offset is how many seconds *later* a stream's stamps are than the pose clock (a camera that
stamps frames 0.1 s after capture measures +0.1 s): the frame stamped ``t`` was captured at ``t - offset``.

Confidence (:class:`OffsetEstimate`): the peak ``R^2``, its contrast (the peak minus the best
``R^2`` more than :attr:`OffsetOptions.contrast_window_s` away), the peak's width at half height
above the scan's median, and the motion energy (RMS angular speed of the VIO, rad/s). An episode
that barely rotates, whose peak is weak, flat or at the edge of the search, says
``not_measurable`` with the figure and the limit, never a number. At the edge means within one sample
(frame or pose interval) of ``+-search_s``, or a better fit (by ``min_contrast``) on a scan from
``search_s`` to twice that: the true offset may lie beyond, and a peak inside is then a side lobe
(:attr:`OffsetEstimate.at_search_limit`, warned as ``offset_at_search_limit``).

:func:`task_offsets` gives the dataset's per-task figures (median, spread, the episodes whose
offset differs from the median by more than :attr:`OffsetOptions.flag_threshold_s`) and the
recommendation that ``task.latency: measured`` makes the trainer take (:func:`obs_latencies_s`).

Over 500 lines because the image motion, the two scans, their judgement and the task figures built on
them are one method, read top to bottom.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

import numpy as np

#: What ``task.latency`` may be: ``config`` (the config's three latencies as given) or ``measured``.
LATENCY_SOURCES = ("config", "measured")


@dataclass(frozen=True)
class OffsetOptions:
    """Settings of the offset estimate (seconds, rad/s, pixels).

    Attributes:
        search_s: offsets in ``[-search_s, +search_s]`` are scanned.
        coarse_step_s, fine_step_s: the two scan grids' steps.
        min_rotation_rps: RMS angular speed of the VIO below which an episode is ``not_measurable``.
        min_r2: smallest peak ``R^2`` that counts as measured.
        min_limit_prominence: least ``R^2`` at (or beyond) the search limit above the median of the scan
            that says the true offset may lie beyond (:attr:`OffsetEstimate.at_search_limit`). Less is no
            peak: an IMU of noise peaks anywhere, the limit included, 0.02 to 0.09 above its median, and slow
            smooth motion (the sample recordings) leaves the camera's scan as flat (up to 0.09); true offsets
            beyond the limit (simulated world, poses or camera 0.38 to 0.6 s late) stand 0.27 to 0.64 above it.
        min_contrast: smallest ``R^2`` drop from the peak to the best candidate more than
            ``contrast_window_s`` away (a flat or repeated peak is not measured).
        contrast_window_s: see ``min_contrast``.
        min_samples: fewest frame pairs (IMU: pose intervals) the fit needs.
        max_samples: at most this many pairs are tracked (every k-th beyond), bounding the cost.
        thumb_width: width (pixels) of the grey frames tracked.
        flag_threshold_s: an episode whose offset differs from the task's median by more is flagged.
        fast_window_s: the high-pass window (s) of :attr:`OffsetEstimate.fast_r2` (0: not computed, as in
            :func:`clock_skew`'s windows, and for frames tracked narrower than ``thumb_width``: at 32 px the
            tracker's noise hides the fast motion, honest and swapped cameras alike).
        skew_windows, skew_min_window_s: :func:`clock_skew` measures the offset in this many windows of the
            episode, each at least this long (s), fewer when the episode is short (3 at least).
    """

    search_s: float = 0.4
    coarse_step_s: float = 0.008
    fine_step_s: float = 0.0005
    min_rotation_rps: float = 0.05
    min_r2: float = 0.5
    min_limit_prominence: float = 0.15
    min_contrast: float = 0.05
    contrast_window_s: float = 0.1
    min_samples: int = 60
    max_samples: int = 1800
    thumb_width: int = 48
    flag_threshold_s: float = 0.02
    skew_windows: int = 4
    skew_min_window_s: float = 2.4
    fast_window_s: float = 0.5


DEFAULT_OPTIONS = OffsetOptions()


@dataclass(frozen=True)
class OffsetEstimate:
    """One stream's measured offset against the VIO pose clock.

    Attributes:
        stream: ``camera`` or ``imu``.
        status: ``measured``, ``not_measurable`` (``reason`` says why, with the figure) or
            ``absent`` (the recording has no such stream).
        offset_s: seconds the stream's stamps are later than the pose clock; None unless measured.
        r2: peak fraction of variance explained, in [0, 1] (None when no scan ran).
        contrast: ``r2`` minus the best ``R^2`` more than ``contrast_window_s`` from the peak.
        peak_width_s: width of the peak at half its height above the scan's median, seconds.
        rotation_rms_rps: RMS angular speed of the VIO over the samples used, rad/s.
        samples: frame pairs (IMU: pose intervals) in the fit.
        reason: why not measured (None when measured).
        at_search_limit: the best fit, or a candidate within ``min_contrast`` of it, lies at (or within
            one sample of) ``+-search_s``: the true offset may lie beyond the search, so nothing is
            measured and the episode is warned (``offset_at_search_limit``).
        fast_r2, fast_ceiling, fast_rotation_rps: (camera only, None when not computed, see ``fast_window_s``) the best
            ``R^2`` at any offset within ``+-2 search_s`` of the high-passed fit (module docstring); the share of the
            high-passed image motion above its frame-to-frame noise, ``1 - var(diff) / (2 var)`` averaged over the four
            features, in [0, 1]; and the RMS of the high-passed VIO angular speed, rad/s.
    """

    stream: str
    status: str
    offset_s: float | None = None
    r2: float | None = None
    contrast: float | None = None
    peak_width_s: float | None = None
    rotation_rms_rps: float | None = None
    samples: int = 0
    reason: str | None = None
    at_search_limit: bool = False
    fast_r2: float | None = None
    fast_ceiling: float | None = None
    fast_rotation_rps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, figures rounded (offsets to 0.1 ms)."""
        return {k: round(float(v), 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


# --------------------------------------------------------------------------- image motion


class ImageMotion:
    """Image motion between consecutive frames, fed one decoded frame at a time (bounded memory).

    Each frame is turned grey and halved (``cv2.pyrDown``: a Gaussian 2x reduction, no aliasing of fine
    texture, and cheap) until narrower than twice :attr:`OffsetOptions.thumb_width`; a 7 x 7 grid of points
    is tracked into the next frame (Lucas-Kanade, one level, 7 x 7 window); :meth:`result` fits each
    pair's similarity by trimmed least squares (points beyond 2.5 x the median residual, at least 0.3 px,
    dropped; three rounds).

    Frames are numbered in the order :meth:`add` receives them (capture order). With more than
    ``options.max_samples`` pairs expected, only pairs ``(k, k + 1)`` with ``k`` a multiple of the
    stride are tracked, so the cost per episode stays bounded. ``seconds`` is the time spent here, ``width`` the
    tracked frames' width (px). Each tracked pair's change of the grey frame's 8 x 8 cell means is kept too
    (:meth:`cell_change`: where the fingers move, :mod:`dpflow_core.recordings.gripper_timing`).
    """

    def __init__(self, expected_frames: int, options: OffsetOptions = DEFAULT_OPTIONS):
        self.options = options
        self.stride = max(1, math.ceil((max(int(expected_frames), 2) - 1) / options.max_samples))
        self.seconds = 0.0
        self.width = 0  # of the grey frames tracked, px
        self._k = 0
        self._prev: np.ndarray | None = None
        self._points: np.ndarray | None = None
        self._first: list[int] = []
        self._moved: list[np.ndarray] = []
        self._found: list[np.ndarray] = []
        self._cells, self._prev_cells = [], None  # per pair, |change| of the 8 x 8 cell means (grey levels); the last's

    def add(self, rgb: np.ndarray) -> None:
        """The next frame: (H, W, 3) uint8 RGB, any size (all frames of one episode the same)."""
        k = self._k
        self._k += 1
        if k % self.stride > 1:
            return
        import cv2

        started = time.perf_counter()
        grey = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
        while grey.shape[1] >= 2 * self.options.thumb_width:
            grey = cv2.pyrDown(grey)
        self.width = grey.shape[1]
        cells = cv2.resize(grey.astype(np.float32), (8, 8), interpolation=cv2.INTER_AREA)
        if self._points is None:
            h, w = grey.shape
            xs, ys = np.meshgrid(np.linspace(4, w - 5, 7), np.linspace(4, h - 5, 7))
            self._points = np.stack([xs.ravel(), ys.ravel()], -1).astype(np.float32)[:, None]
        if self._prev is not None and (k % self.stride == 1 or self.stride == 1):
            moved, found, _err = cv2.calcOpticalFlowPyrLK(self._prev, grey, self._points, None, winSize=(7, 7),
                                                          maxLevel=0)
            self._first.append(k - 1)
            self._moved.append(moved[:, 0])
            self._found.append(found.ravel() == 1)
            self._cells.append(np.abs(cells - self._prev_cells).ravel())
        self._prev, self._prev_cells = grey, cells
        self.seconds += time.perf_counter() - started

    def cell_change(self) -> np.ndarray:
        """(P, 64) float32, per pair of :meth:`result` the absolute change of each of the 8 x 8 cell means (grey levels)."""
        return np.asarray(self._cells, np.float32).reshape(len(self._cells), 64)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(pairs (P, 2) int64 frame numbers, features (P, 4) float64)``: per pair the shift x and y
        (fractions of the thumbnail's width), the in-plane rotation (rad) and the scale change; NaN
        where fewer than 6 points agree."""
        started = time.perf_counter()
        first = np.asarray(self._first, dtype=np.int64)
        pairs = np.stack([first, first + 1], axis=1) if len(first) else np.zeros((0, 2), np.int64)
        if not len(first):
            return pairs, np.zeros((0, 4))
        h, w = self._prev.shape
        centre = np.array([(w - 1) / 2, (h - 1) / 2])
        p = self._points[:, 0].astype(np.float64) - centre
        q = np.asarray(self._moved, np.float64) - centre
        found = np.asarray(self._found)
        weight = found.astype(np.float64)
        for _ in range(3):
            n = weight.sum(1).clip(1e-9)
            pm = weight @ p / n[:, None]
            qm = np.einsum("pk,pkc->pc", weight, q) / n[:, None]
            pc, qc = p[None] - pm[:, None], q - qm[:, None]
            norm = (weight * (pc**2).sum(2)).sum(1).clip(1e-9)
            ca = (weight * (pc * qc).sum(2)).sum(1) / norm
            sb = (weight * (pc[..., 0] * qc[..., 1] - pc[..., 1] * qc[..., 0])).sum(1) / norm
            fit = np.stack([ca[:, None] * pc[..., 0] - sb[:, None] * pc[..., 1],
                            sb[:, None] * pc[..., 0] + ca[:, None] * pc[..., 1]], -1) + qm[:, None]
            resid = np.where(found, np.linalg.norm(fit - q, axis=2), np.inf)
            ranked = np.sort(resid, axis=1)
            median = ranked[np.arange(len(ranked)), np.maximum(found.sum(1) - 1, 0) // 2]
            weight = (resid <= np.maximum(2.5 * median, 0.3)[:, None]).astype(np.float64)
        shift = qm - np.stack([ca * pm[:, 0] - sb * pm[:, 1], sb * pm[:, 0] + ca * pm[:, 1]], -1)
        features = np.stack([shift[:, 0] / w, shift[:, 1] / w, np.arctan2(sb, ca), np.hypot(ca, sb) - 1], -1)
        features[weight.sum(1) < 6] = np.nan
        self.seconds += time.perf_counter() - started
        return pairs, features


# --------------------------------------------------------------------------- VIO tracks


def _body_increments(pose_ts_ns: np.ndarray, quat_xyzw: np.ndarray, position_m: np.ndarray | None) -> np.ndarray:
    """(M, 3 or 6) cumulative camera-frame rotation (rad) [and translation (m)] at each pose."""
    from scipy.spatial.transform import Rotation

    rot = Rotation.from_quat(quat_xyzw)
    steps = [(rot[:-1].inv() * rot[1:]).as_rotvec()]
    if position_m is not None:
        steps.append(rot[:-1].inv().apply(np.diff(position_m, axis=0)))
    inc = np.hstack(steps)
    return np.vstack([np.zeros((1, inc.shape[1])), np.cumsum(inc, axis=0)])


def _spans_clear(a: np.ndarray, b: np.ndarray, t: np.ndarray, max_step: float) -> np.ndarray:
    """(N,) bool: ``[a, b]`` lies inside ``t``'s span and holds no interval of ``t`` longer than ``max_step``."""
    inside = (a >= t[0]) & (b <= t[-1])
    holes = np.flatnonzero(np.diff(t) > max_step)
    if len(holes):
        # A hole (t[i], t[i+1]) meets [a, b] when it starts before b and ends after a.
        first_end_after_a = np.searchsorted(t[holes + 1], a, side="right")
        nxt = np.minimum(first_end_after_a, len(holes) - 1)
        inside &= ~((first_end_after_a < len(holes)) & (t[holes[nxt]] < b))
    return inside


def interp_rows(x: np.ndarray, xp: np.ndarray, fp: np.ndarray) -> np.ndarray:
    """``np.interp`` of every column of ``fp`` (M, C) float at ``x`` (any shape; ``xp`` (M,) increasing, same unit) with one
    search: (*x.shape, C) float64, held at the end rows outside ``xp``. ``M`` must be at least 2; nothing is raised."""
    i = np.clip(np.searchsorted(xp, x, side="right"), 1, len(xp) - 1)
    w = np.clip((x - xp[i - 1]) / (xp[i] - xp[i - 1]), 0.0, 1.0)[..., None]
    return fp[i - 1] * (1 - w) + fp[i] * w


def _scan(target: np.ndarray, regressors, taus: np.ndarray) -> np.ndarray:
    """``R^2(tau)``: the share of the standardised ``target``'s variance that a least-squares fit
    (with intercept) of ``regressors(taus)`` ((T, N, k)) explains, for each of the (T,) ``taus``."""
    y = (target - target.mean(0)) / np.maximum(target.std(0), 1e-12)
    x = regressors(taus)
    x = x - x.mean(axis=1, keepdims=True)
    xtx = np.einsum("tni,tnj->tij", x, x) + 1e-12 * np.eye(x.shape[2])
    xty = np.einsum("tni,nj->tij", x, y)
    beta = np.linalg.solve(xtx, xty)
    explained = np.einsum("tij,tij->t", beta, xty)
    return explained / float((y**2).sum())


def estimate_offset(stream: str, target: np.ndarray, regressors, rotation_rms: float, opts: OffsetOptions,
                    sample_s: float = 0.0) -> OffsetEstimate:
    """The :class:`OffsetEstimate` of ``stream``: the two-stage scan of ``target`` (N, k) on ``regressors(taus)`` ((T, N, r)
    for (T,) lags, s), its peak judged (module docstring; ``rotation_rms`` rad/s; ``sample_s`` the samples' interval, s,
    the margin of the search limit); a weak, flat or edge peak is ``not_measurable``, nothing is raised."""
    n = len(target)
    common = {"stream": stream, "rotation_rms_rps": rotation_rms, "samples": n}
    if n < opts.min_samples:
        return OffsetEstimate(status="not_measurable", reason=f"{n} usable samples, fewer than {opts.min_samples}",
                              **common)
    if rotation_rms < opts.min_rotation_rps:
        return OffsetEstimate(status="not_measurable", reason=(
            f"the camera barely rotates: {rotation_rms:.3f} rad/s RMS, below {opts.min_rotation_rps:g} rad/s"), **common)
    coarse = np.arange(-opts.search_s, opts.search_s + opts.coarse_step_s / 2, opts.coarse_step_s)
    r2 = _scan(target, regressors, coarse)
    if not np.all(np.isfinite(r2)):  # a NaN pose that VIO marked valid poisons every fit: no peak to judge
        return OffsetEstimate(status="not_measurable", reason=f"{stream} or pose motion NaN/inf: no fit", **common)
    k = int(np.argmax(r2))
    fine = np.arange(coarse[k] - opts.coarse_step_s, coarse[k] + opts.coarse_step_s * 1.001, opts.fine_step_s)
    fine = fine[np.abs(fine) <= opts.search_s]
    r2_fine = _scan(target, regressors, fine)
    j = int(np.argmax(r2_fine))
    best, peak = float(fine[j]), float(r2_fine[j])
    if 0 < j < len(fine) - 1:
        y0, y1, y2 = r2_fine[j - 1 : j + 2]
        denom = y0 - 2 * y1 + y2
        if denom < 0:
            best += opts.fine_step_s * float(np.clip(0.5 * (y0 - y2) / denom, -0.5, 0.5))
    away = np.abs(coarse - best) > opts.contrast_window_s
    contrast = peak - float(r2[away].max()) if away.any() else peak
    half = np.concatenate([[0], r2 >= (peak + float(np.median(r2))) / 2, [0]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(half))  # starts and stops of the runs above half height
    width = next(b - a for a, b in zip(edges[::2], edges[1::2]) if a <= k < b) * opts.coarse_step_s
    figures = dict(r2=peak, contrast=contrast, peak_width_s=float(width), **common)
    margin = max(2 * opts.coarse_step_s, sample_s)
    beyond = np.arange(opts.search_s + opts.coarse_step_s, 2 * opts.search_s + opts.coarse_step_s / 2, opts.coarse_step_s)
    beyond = np.concatenate([-beyond[::-1], beyond])
    r2_beyond = _scan(target, regressors, beyond)
    far = int(np.argmax(np.where(np.isfinite(r2_beyond), r2_beyond, -np.inf)))
    level = float(np.median(r2)) + opts.min_limit_prominence
    edge = abs(best) >= opts.search_s - margin
    if (edge and peak >= level) or (r2_beyond[far] > peak + opts.min_contrast and r2_beyond[far] >= level):
        why = (f"best fit R^2 {peak:.2f} at {best:+.3f} s, within one sample ({margin:.3f} s) of the limit" if edge else
               f"R^2 {r2_beyond[far]:.2f} at {beyond[far]:+.3f} s beyond it against {peak:.2f} at {best:+.3f} s inside")
        return OffsetEstimate(status="not_measurable", at_search_limit=True, **figures, reason=(
            f"at the search limit +-{opts.search_s:g} s: the true offset may lie beyond ({why})"))
    if edge and peak >= opts.min_r2:
        reason = (f"no peak: the best fit, R^2 {peak:.2f} at {best:+.3f} s, lies at the search limit but only "
                  f"{peak - level + opts.min_limit_prominence:.2f} above the scan's median (a peak: "
                  f"{opts.min_limit_prominence:g})")
        return OffsetEstimate(status="not_measurable", reason=reason, **figures)
    if peak < opts.min_r2:
        reason = f"the motion fits poorly at its best offset: R^2 {peak:.2f}, below {opts.min_r2:g}"
    elif contrast < opts.min_contrast:
        reason = (f"no distinct peak: R^2 {peak:.2f} at {best:+.3f} s is within {contrast:.3f} of an offset more "
                  f"than {opts.contrast_window_s:g} s away (minimum contrast {opts.min_contrast:g})")
    else:
        return OffsetEstimate(status="measured", offset_s=best, **figures)
    return OffsetEstimate(status="not_measurable", reason=reason, **figures)


def _high_pass(x: np.ndarray, n: int, axis: int) -> np.ndarray:
    """``x`` less its centred moving mean over ``n`` samples along ``axis`` (fewer at the ends)."""
    c = np.cumsum(np.concatenate([np.zeros_like(np.take(x, [0], axis=axis)), x], axis=axis), axis=axis)
    i = np.arange(x.shape[axis])
    lo, hi = np.clip(i - n // 2, 0, None), np.clip(i + n // 2 + 1, None, x.shape[axis])
    shape = [-1 if k == axis else 1 for k in range(x.ndim)]
    return x - (np.take(c, hi, axis=axis) - np.take(c, lo, axis=axis)) / (hi - lo).reshape(shape)


def _fast_fit(est: OffsetEstimate, target: np.ndarray, regressors, a: np.ndarray, b: np.ndarray,
              opts: OffsetOptions) -> OffsetEstimate:
    """``est`` with its ``fast_*`` figures: the scan of :func:`_scan` over ``+-2 search_s`` on the target and the
    regressors high-passed over ``fast_window_s``; ``a``, ``b`` (N,) the pairs' times (s). Tracking noise is white
    from frame to frame, a hand's motion is not: the noise's variance is about half that of the differences."""
    if opts.fast_window_s <= 0 or est.r2 is None:
        return est
    n = max(3, int(round(opts.fast_window_s / max(float(np.median(np.diff(a))), 1e-6))))
    taus = np.arange(-2 * opts.search_s, 2 * opts.search_s + opts.coarse_step_s / 2, opts.coarse_step_s)
    r2 = _scan(_high_pass(target, n, 0), lambda t: _high_pass(regressors(t), n, 1), taus)
    image = _high_pass(target, n, 0)
    above = 1 - np.var(np.diff(image, axis=0), axis=0) / np.maximum(2 * np.var(image, axis=0), 1e-30)
    rot = _high_pass(regressors(np.zeros(1))[0, :, :3] / (b - a)[:, None], n, 0)
    return replace(est, fast_r2=float(np.nanmax(r2)), fast_ceiling=float(np.mean(np.clip(above, 0.0, 1.0))),
                   fast_rotation_rps=float(np.sqrt(np.mean(np.sum(rot**2, axis=1)))))


def _rotation_rms(pose_s: np.ndarray, rot_cum: np.ndarray, lo: float, hi: float) -> float:
    """RMS angular speed (rad/s) of the pose intervals inside ``[lo, hi]``."""
    use = (pose_s[:-1] >= lo) & (pose_s[1:] <= hi)
    rate = np.linalg.norm(np.diff(rot_cum, axis=0)[use], axis=1) / np.maximum(np.diff(pose_s)[use], 1e-9)
    return float(np.sqrt(np.mean(rate**2))) if len(rate) else 0.0


def _usable_poses(pose_ts_ns, quat_xyzw, position_m, pose_ok):
    keep = np.ones(len(pose_ts_ns), bool) if pose_ok is None else np.asarray(pose_ok, bool)
    t0 = int(pose_ts_ns[0]) if len(pose_ts_ns) else 0
    pose_s = (np.asarray(pose_ts_ns, np.int64)[keep] - t0) / 1e9
    return t0, pose_s, np.asarray(quat_xyzw)[keep], None if position_m is None else np.asarray(position_m)[keep]


def _strided(n: int, limit: int) -> np.ndarray:
    return np.arange(0, n, max(1, math.ceil(n / limit)))


def camera_offset(frame_ts_ns: np.ndarray, pairs: np.ndarray, features: np.ndarray, pose_ts_ns: np.ndarray,
                  quat_xyzw: np.ndarray, position_m: np.ndarray, pose_ok: np.ndarray | None = None,
                  options: OffsetOptions = DEFAULT_OPTIONS) -> OffsetEstimate:
    """The camera-to-VIO offset of one episode (method: module docstring).

    Args:
        frame_ts_ns: (K,) int64 camera stamps of the frames :class:`ImageMotion` numbered.
        pairs, features: :meth:`ImageMotion.result`.
        pose_ts_ns: (M,) int64 increasing pose stamps; quat_xyzw (M, 4) unit; position_m (M, 3) m.
        pose_ok: (M,) bool, poses to use (None: all); a stretch of unusable poses is a hole no
            sample may span.
        options: thresholds and grids.

    Returns:
        The estimate; ``not_measurable`` (with the reason) when fewer than ``min_samples`` pairs
        lie inside the pose track, the camera barely rotates, or the peak is weak or flat.
    """
    opts = options
    t0, pose_s, quat, pos = _usable_poses(pose_ts_ns, quat_xyzw, position_m, pose_ok)
    if len(pose_s) < 3 or not len(pairs):
        return OffsetEstimate("camera", "not_measurable", reason=f"{len(pairs)} frame pairs, {len(pose_s)} usable poses")
    ts = (np.asarray(frame_ts_ns, np.int64) - t0) / 1e9
    a, b = ts[pairs[:, 0]], ts[pairs[:, 1]]
    period = float(np.median(b - a))
    pose_step = float(np.median(np.diff(pose_s)))
    ok = (np.isfinite(features).all(axis=1) & (b - a > 0) & (b - a <= 1.5 * period)
          & _spans_clear(a - opts.search_s, b + opts.search_s, pose_s, 3 * max(pose_step, period)))
    use = np.flatnonzero(ok)
    use = use[_strided(len(use), opts.max_samples)]
    if len(use) < opts.min_samples:
        return OffsetEstimate("camera", "not_measurable", samples=int(len(use)),
                              reason=f"{len(use)} frame pairs inside the pose track, fewer than {opts.min_samples}")
    cum = _body_increments(pose_s, quat, pos)
    a, b = a[use], b[use]

    def regressors(taus: np.ndarray) -> np.ndarray:
        return interp_rows(b[None] - taus[:, None], pose_s, cum) - interp_rows(a[None] - taus[:, None], pose_s, cum)

    rms = _rotation_rms(pose_s, cum[:, :3], float(a[0]), float(b[-1]))
    est = estimate_offset("camera", features[use], regressors, rms, opts, period)
    return _fast_fit(est, features[use], regressors, a, b, opts)


def imu_offset(imu_ts_ns: np.ndarray, gyro_rps: np.ndarray, pose_ts_ns: np.ndarray, quat_xyzw: np.ndarray,
               pose_ok: np.ndarray | None = None, options: OffsetOptions = DEFAULT_OPTIONS) -> OffsetEstimate:
    """The IMU-to-VIO offset of one episode: gyro (I, 3) rad/s at ``imu_ts_ns`` (I,) int64 against the
    VIO rotation over each pose interval (``pose_*`` and ``pose_ok`` as :func:`camera_offset`).

    Returns:
        The estimate; ``not_measurable`` as :func:`camera_offset`.
    """
    opts = options
    t0, pose_s, quat, _ = _usable_poses(pose_ts_ns, quat_xyzw, None, pose_ok)
    if len(imu_ts_ns) < 3 or len(pose_s) < 3:
        return OffsetEstimate("imu", "not_measurable", reason=f"{len(imu_ts_ns)} IMU samples, {len(pose_s)} usable poses")
    imu_s = (np.asarray(imu_ts_ns, np.int64) - t0) / 1e9
    order = np.argsort(imu_s, kind="stable")
    imu_s, gyro = imu_s[order], np.asarray(gyro_rps, np.float64)[order]
    keep = np.concatenate([[True], np.diff(imu_s) > 0]) & np.isfinite(gyro).all(axis=1)  # NaN: imu_not_finite
    imu_s, gyro = imu_s[keep], gyro[keep]
    if len(imu_s) < 3:
        return OffsetEstimate("imu", "not_measurable", reason=f"{len(imu_s)} finite IMU samples at distinct times")
    integral = np.vstack([np.zeros((1, 3)), np.cumsum((gyro[1:] + gyro[:-1]) / 2 * np.diff(imu_s)[:, None], axis=0)])
    cum = _body_increments(pose_s, quat, None)
    a, b = pose_s[:-1], pose_s[1:]
    pose_step = float(np.median(b - a))
    imu_step = float(np.median(np.diff(imu_s)))
    ok = (b - a <= 3 * pose_step) & _spans_clear(a - opts.search_s, b + opts.search_s, imu_s, 5 * imu_step)
    use = np.flatnonzero(ok)
    use = use[_strided(len(use), opts.max_samples)]
    target = (cum[1:] - cum[:-1])[use]
    a, b = a[use], b[use]

    def regressors(taus: np.ndarray) -> np.ndarray:
        return (interp_rows(b[None] + taus[:, None], imu_s, integral)
                - interp_rows(a[None] + taus[:, None], imu_s, integral))

    rms = _rotation_rms(pose_s, cum, float(a[0]), float(b[-1])) if len(use) else 0.0
    return estimate_offset("imu", target, regressors, rms, opts, pose_step)


def clock_skew(estimate_in, pose_ts_ns: np.ndarray, pose_ok: np.ndarray | None, stream: str,
               options: OffsetOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    """How fast a stream's clock runs against the pose clock, from its offset measured in windows of the episode.

    Two clocks that tick at different rates (a pose clock 3 % fast) give an offset that grows along the episode:
    each frame is paired with a pose further off the later it is. The episode is cut into
    :attr:`OffsetOptions.skew_windows` windows of equal time (each at least :attr:`OffsetOptions.skew_min_window_s`
    long, else fewer); the offset is measured in each (``estimate_in``: :func:`camera_offset` or :func:`imu_offset`
    on one window's samples) and a line fitted through the measured ones, robust to one mis-measured window
    (Theil-Sen: the median of the pairwise slopes, ``scipy.stats.theilslopes``).

    Args:
        estimate_in: ``(pose mask (M,) bool, start ns, end ns)`` -> :class:`OffsetEstimate` of the stream's samples
            between the two stamps, on the poses of the mask (the window and ``search_s`` either side).
        pose_ts_ns: (M,) int64 pose stamps; pose_ok: (M,) bool usable poses (None: all).
        stream: ``camera`` or ``imu`` (named in the result).

    Returns:
        ``{"stream", "status", "skew", "windows"}``: ``skew`` the slope, seconds of offset per second of pose
        clock (+0.03: the stream's offset grows 30 ms a second, its clock 3 % fast against the pose's; a pose
        clock 3 % fast gives -0.03), None
        unless at least 3 windows were measured (``status`` ``measured``, else ``not_measurable`` and
        ``reason``); ``windows``: ``[start_s, end_s, offset_s or None]`` from the pose track's start.
    """
    ts = np.asarray(pose_ts_ns, np.int64)
    ok = np.ones(len(ts), bool) if pose_ok is None else np.asarray(pose_ok, bool)
    out: dict[str, Any] = {"stream": stream, "status": "not_measurable", "skew": None, "windows": []}
    if not ok.any():
        return {**out, "reason": "no usable poses"}
    t = (ts - int(ts[0])) / 1e9
    lo, hi = float(t[ok][0]), float(t[ok][-1])
    n = min(options.skew_windows, int((hi - lo) / options.skew_min_window_s + 1e-6))
    if n < 3:
        return {**out, "reason": f"{hi - lo:.1f} s of poses: fewer than 3 windows of {options.skew_min_window_s:g} s"}
    edges = np.linspace(lo, hi, n + 1)
    mids, offs = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        # the poses around the window too, so that its samples' spans, shifted by up to search_s, stay inside
        near = ok & (t >= a - options.search_s - 0.05) & (t <= b + options.search_s + 0.05)
        est = estimate_in(near, int(ts[0]) + int(a * 1e9), int(ts[0]) + int(b * 1e9))
        out["windows"].append([round(float(a), 3), round(float(b), 3),
                               None if est.offset_s is None else round(float(est.offset_s), 4)])
        if est.status == "measured":
            mids.append((a + b) / 2)
            offs.append(float(est.offset_s))
    if len(offs) < 3:
        return {**out, "reason": f"{len(offs)} of {n} windows measured, fewer than 3"}
    from scipy.stats import theilslopes

    slope = float(theilslopes(offs, mids).slope)
    return {**out, "status": "measured", "skew": round(slope, 5)}


def check_clock_skew(skews: list[dict], t0_ns: int, pose_t0_ns: int, opts: Any = None) -> list:
    """``clock_skew`` findings from :func:`dpflow_core.offsets.clock_skew` results: each stream whose measured
    drift against the pose clock exceeds ``max_clock_skew`` (s/s); ``t0_ns`` the episode start, ``pose_t0_ns``
    the pose track's first stamp (the windows' origin); ``opts`` a
    :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions` (None: the defaults)."""
    from dpflow_core.recordings.plausibility import PlausibilityOptions, new_finding

    opts = PlausibilityOptions() if opts is None else opts
    shift = (int(pose_t0_ns) - int(t0_ns)) / 1e9
    out = []
    for sk in skews:
        if sk.get("status") != "measured" or abs(sk["skew"]) <= opts.max_clock_skew:
            continue
        (a, _, first), (_, b, last) = sk["windows"][0], sk["windows"][-1]
        faster = "fast" if sk["skew"] > 0 else "slow"
        out.append(new_finding(
            opts, "clock_skew", sk["stream"], a + shift, b + shift, abs(sk["skew"]), opts.max_clock_skew, "s/s",
            skew=sk["skew"], windows=sk["windows"],
            why=f"its offset against the pose clock drifts {sk['skew'] * 1e3:+.1f} ms a second "
                f"({first if first is not None else '?'} s in the first window, {last if last is not None else '?'} s in "
                f"the last): its clock runs {abs(sk['skew']) * 100:.2g} % {faster} against the pose's, so frames "
                "late in the episode meet the wrong poses"))
    return out


# --------------------------------------------------------------------------- recordings


def measure_offsets(motion: ImageMotion, frame_ts_ns: np.ndarray, pose_ts_ns: np.ndarray, quat_xyzw: np.ndarray,
                    position_m: np.ndarray, pose_ok: np.ndarray | None = None, imu_ts_ns: np.ndarray | None = None,
                    gyro_rps: np.ndarray | None = None, options: OffsetOptions = DEFAULT_OPTIONS) -> dict[str, Any]:
    """Both offsets of one recording, as the keys of its ``dataset.json`` episode entry:
    ``camera_offset_s`` and ``imu_offset_s`` (seconds or None) with ``camera_offset`` and
    ``imu_offset`` (:meth:`OffsetEstimate.to_dict`) beside them, and each stream's clock rate against the
    pose clock, ``camera_clock_skew`` and ``imu_clock_skew`` (:func:`clock_skew`).

    Args:
        motion: has seen every frame whose stamp is in ``frame_ts_ns`` ((K,) int64 ns), in order.
        pose_ts_ns, quat_xyzw, position_m, pose_ok: the pose track (see :func:`camera_offset`).
        imu_ts_ns, gyro_rps: the IMU (see :func:`imu_offset`); None: the recording has none
            (``imu_offset`` is then ``absent``).
        options: thresholds and grids.
    """
    pairs, features = motion.result()
    whole = options if motion.width >= options.thumb_width else replace(options, fast_window_s=0.0)
    cam = camera_offset(frame_ts_ns, pairs, features, pose_ts_ns, quat_xyzw, position_m, pose_ok, whole).to_dict()
    frame_ts = np.asarray(frame_ts_ns, np.int64)
    # a window's offset is a fit over a stretch that may drift: grids twice as coarse halve the cost
    win = replace(options, coarse_step_s=2 * options.coarse_step_s, fine_step_s=2 * options.fine_step_s, fast_window_s=0.0)

    def camera_in(ok: np.ndarray, a_ns: int, b_ns: int) -> OffsetEstimate:
        inside = (frame_ts[pairs[:, 0]] >= a_ns) & (frame_ts[pairs[:, 1]] <= b_ns) if len(pairs) else np.zeros(0, bool)
        return camera_offset(frame_ts, pairs[inside], features[inside], pose_ts_ns, quat_xyzw, position_m, ok, win)

    cam_skew = clock_skew(camera_in, pose_ts_ns, pose_ok, "camera", options)
    if imu_ts_ns is None or gyro_rps is None:
        imu = OffsetEstimate("imu", "absent", reason="the recording has no IMU messages").to_dict()
        imu_skew = {"stream": "imu", "status": "absent", "skew": None, "windows": []}
    else:
        imu = imu_offset(imu_ts_ns, gyro_rps, pose_ts_ns, quat_xyzw, pose_ok, options).to_dict()
        pose_ts = np.asarray(pose_ts_ns, np.int64)
        imu_skew = clock_skew(lambda ok, a_ns, b_ns: imu_offset(imu_ts_ns, gyro_rps, pose_ts_ns, quat_xyzw,
                                                                ok & (pose_ts >= a_ns) & (pose_ts <= b_ns), win),
                              pose_ts_ns, pose_ok, "imu", options)
    return {"camera_offset_s": cam["offset_s"], "camera_offset": cam, "imu_offset_s": imu["offset_s"], "imu_offset": imu,
            "camera_clock_skew": cam_skew, "imu_clock_skew": imu_skew}


# --------------------------------------------------------------------------- task level


def task_offsets(episodes: Sequence[Mapping[str, Any]], threshold_s: float = DEFAULT_OPTIONS.flag_threshold_s) -> dict:
    """Per-task figures from episode entries holding :func:`measure_offsets`' keys (a recording split
    into pieces counts once, by ``stem``).

    Returns:
        ``{"threshold_s", "camera": {...}, "imu": {...}, "flagged": [...], "recommendation": {...}}``:
        per stream ``median_s``, ``spread_s`` (1.4826 x MAD), ``min_s``, ``max_s``, ``measured``
        (count) and ``not_measurable`` (stems); ``flagged``: ``{"stem", "stream", "offset_s",
        "median_s", "difference_s", "reason"}`` for each measured offset farther than ``threshold_s``
        from its stream's median; ``at_search_limit``: ``{"stem", "stream", "reason"}`` for each estimate at
        the search limit (:attr:`OffsetEstimate.at_search_limit`); ``recommendation``: ``{"camera_offset_s"}`` (the camera median,
        None when no episode was measured), what ``task.latency: measured`` takes
        (:func:`obs_latencies_s`).
    """
    by_stem = {e["stem"]: e for e in episodes}
    out: dict[str, Any] = {"threshold_s": threshold_s, "flagged": []}
    for stream in ("camera", "imu"):
        values = {s: e.get(f"{stream}_offset_s") for s, e in by_stem.items()}
        got = {s: float(v) for s, v in values.items() if v is not None}
        info = {"measured": len(got),
                "not_measurable": [s for s, e in by_stem.items() if (e.get(f"{stream}_offset") or {}).get("status")
                                   == "not_measurable"]}
        if got:
            x = np.array(list(got.values()))
            med = float(np.median(x))
            info.update(median_s=round(med, 4), spread_s=round(1.4826 * float(np.median(np.abs(x - med))), 4),
                        min_s=round(float(x.min()), 4), max_s=round(float(x.max()), 4))
            for s, v in got.items():
                if abs(v - med) > threshold_s:
                    out["flagged"].append({
                        "stem": s, "stream": stream, "offset_s": round(v, 4), "median_s": round(med, 4),
                        "difference_s": round(v - med, 4),
                        "reason": f"{stream} offset {v:+.3f} s differs from the task median {med:+.3f} s by "
                                  f"{v - med:+.3f} s (threshold {threshold_s:g} s)"})
        out[stream] = info
    out["at_search_limit"] = [
        {"stem": s, "stream": stream, "reason": f"{s}_vio.mcap: {stream} offset not measurable, "
                                                f"{(e.get(f'{stream}_offset') or {}).get('reason')}"}
        for s, e in by_stem.items() for stream in ("camera", "imu") if (e.get(f"{stream}_offset") or {}).get("at_search_limit")]
    out["recommendation"] = {"camera_offset_s": out["camera"].get("median_s")}
    return out


def offset_warnings(summary: Mapping[str, Any]) -> list[dict]:
    """``dataset.json`` warnings (``{"stem", "code", "reason"}``) of :func:`task_offsets`' flags (``offset_outlier``)
    and of the offsets at the search limit (``offset_at_search_limit``: not measured, the true offset may lie beyond)."""
    return ([{"stem": f["stem"], "code": "offset_outlier", "reason": f["reason"]} for f in summary["flagged"]]
            + [{"stem": f["stem"], "code": "offset_at_search_limit", "reason": f["reason"]}
               for f in summary.get("at_search_limit", [])])


def obs_latencies_s(task: Any, metadata: Mapping[str, Any] | None) -> tuple[float, float, float]:
    """The camera, robot and gripper observation latencies (s) the trainer turns into steps.

    ``task.latency`` (absent or ``config``): the config's ``camera_obs_latency``,
    ``robot_obs_latency`` and ``gripper_obs_latency`` as given. ``measured``: the dataset pairs each
    frame with poses and gripper widths ``L`` = ``offsets.recommendation.camera_offset_s`` seconds
    newer than its capture, so ``L`` is taken out of every low-dimensional key's shift, ``(camera -
    own latency - L) x frequency`` steps; the latencies returned have those differences and stay
    non-negative (``L`` is added to the robot and gripper latencies, or ``-L`` to the camera's).

    Raises:
        ValueError: an unknown ``task.latency``, or ``measured`` with a dataset whose metadata has no
            measured camera offset (named, with the episodes' reasons).
    """
    camera, robot, gripper = (float(task[k]) for k in ("camera_obs_latency", "robot_obs_latency", "gripper_obs_latency"))
    source = task.get("latency", "config") or "config"
    if source not in LATENCY_SOURCES:
        raise ValueError(f"task.latency must be one of {LATENCY_SOURCES}, got {source!r}")
    if source == "config":
        return camera, robot, gripper
    summary = (metadata or {}).get("offsets") or {}
    offset = (summary.get("recommendation") or {}).get("camera_offset_s")
    if offset is None:
        why = "; ".join(f"{e.get('stem')}: {(e.get('camera_offset') or {}).get('reason')}"
                        for e in (metadata or {}).get("episodes", [])[:5])
        raise ValueError("task.latency=measured but the dataset has no measured camera offset "
                         f"(converted before offsets were measured, or no episode measurable{': ' + why if why else ''})")
    offset = float(offset)
    if offset >= 0:
        return camera, robot + offset, gripper + offset
    return camera - offset, robot, gripper
