"""Episode rates in the LeRobot export: the conversion's ``rate_policy``, applied to the episodes a writer holds.

One ``fps`` describes a LeRobot dataset, so an episode at another rate than its task's cannot stay as it
is. The rule is the conversion's (:mod:`dpflow_core.conversion.rates`): the task's rate is that of the
largest group of episodes agreeing within ``frequency_tolerance`` (:func:`~dpflow_core.conversion.rates.rate_groups`,
the median of that group), and an episode outside it is, by ``rate_policy``:

* ``"resample"`` (default): put on the task's grid (``1 / rate`` apart, from its first frame to its last):
  images sample and hold (the latest frame captured at or before each grid time,
  :func:`~dpflow_core.conversion.rates.sample_and_hold_grid`), position and gripper width linear, rotation
  slerp (:func:`~dpflow_core.conversion.rates.resample_pose`); actions are made again from the resampled
  state. The held frames are the episode's frames as its first encoding decodes them, encoded once more (a
  second generation of H.264 for that episode only: the export streams each episode's video as it arrives,
  before the task's rate is known). Placed after the other episodes, as in ``dataset.npz``.
* ``"group"``: each other rate group written as a LeRobot dataset of its own beside the output
  (``<name>-<rate>hz``, :func:`~dpflow_core.conversion.rates.group_path`), at its own fps.
* ``"reject"``: left out as ``frequency_mismatch`` with the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import av
import numpy as np

from dpflow_core.conversion.rates import (
    RATE_POLICIES, group_path, group_rate_hz, rate_groups, resample_pose, sample_and_hold_grid,
)
from dpflow_core.errors import ConversionError

__all__ = ["RATE_POLICIES", "RatePlan", "plan_rates", "group_dir", "resample_state", "decode_frames"]


@dataclass(frozen=True)
class RatePlan:
    """What becomes of each episode (indices into the writer's episodes, in their order).

    Attributes:
        rate_hz: the task's rate (its largest agreeing group's median), Hz.
        main: episodes at the task's rate.
        resample: episodes to put on the task's grid (``"resample"``).
        groups: (group rate Hz, episodes) of each other rate group (``"group"``), largest first.
        rejected: episode -> ``frequency_mismatch`` reason (``"reject"``).
    """

    rate_hz: float
    main: list[int]
    resample: list[int]
    groups: list[tuple[float, list[int]]]
    rejected: dict[int, str]


def plan_rates(rates_hz: Sequence[float], policy: str, tolerance: float) -> RatePlan:
    """Sort episodes by their measured rates (Hz, 1 / median frame interval) under ``policy`` (module docstring).

    Raises:
        ConversionError: ``policy`` is not one of :data:`RATE_POLICIES` (``bad_option``).
    """
    if policy not in RATE_POLICIES:
        raise ConversionError(f"rate_policy must be one of {RATE_POLICIES}, got {policy!r}", code="bad_option")
    rates = [float(r) for r in rates_hz]
    groups = rate_groups(rates, tolerance)
    ref = group_rate_hz(rates, groups[0])
    others = groups[1:]
    off = sorted(i for g in others for i in g)
    rejected = {}
    if policy == "reject":
        for i in off:
            dev = abs(rates[i] - ref) / ref
            rejected[i] = (f"frequency_mismatch: measured {rates[i]:.3f} Hz differs from the dataset's {ref:.3f} Hz "
                           f"by {dev:.1%} (tolerance {tolerance:.1%})")
    return RatePlan(
        rate_hz=ref,
        main=sorted(groups[0]),
        resample=off if policy == "resample" else [],
        groups=[(group_rate_hz(rates, g), sorted(g)) for g in others] if policy == "group" else [],
        rejected=rejected,
    )


def group_dir(out_dir: Path, rate_hz: float) -> Path:
    """A rate group's dataset folder beside ``out_dir``: ``pick_place`` -> ``pick_place-15hz``, the rate labelled as
    :func:`~dpflow_core.conversion.rates.group_path` labels it (whole Hz when within 1 %, else 0.1 Hz); the whole
    folder name is kept (a folder has no suffix: ``ds.v3`` -> ``ds.v3-15hz``)."""
    return out_dir.with_name(out_dir.name + group_path(Path("x"), rate_hz).name[1:])


def resample_state(state: np.ndarray, t_s: np.ndarray, rate_hz: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An episode's 7-D state on the ``rate_hz`` grid.

    Args:
        state: (N, 7) float32 [x, y, z (m), rotation vector (rad), gripper width (m)].
        t_s: (N,) float64 strictly increasing capture times, seconds.
        rate_hz: the task's rate, Hz.

    Returns:
        (grid (M,) float64 seconds, state (M, 7) float32, source (M,) int64: the frame each step shows).
    """
    grid, source = sample_and_hold_grid(t_s, rate_hz)
    pos, rot, width = resample_pose(t_s, grid, state[:, 0:3], state[:, 3:6], state[:, 6])
    return grid, np.concatenate([pos, rot, width], axis=1).astype(np.float32), source


def decode_frames(path: Path, n: int) -> np.ndarray:
    """The (n, H, W, 3) uint8 RGB frames of an episode's staged video, in order (PyAV).

    Raises:
        ConversionError: the video does not hold exactly ``n`` frames.
    """
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    if len(frames) != n:
        raise ConversionError(f"staged video holds {len(frames)} frames, expected {n}", path)
    return np.stack(frames)
