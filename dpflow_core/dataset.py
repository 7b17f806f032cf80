"""Normalisation statistics and validation of a converted ``dataset.npz``.

Both read the replay buffer through :class:`dpflow_core.replay_buffer.ReplayBuffer`
(memory-mapped members), never decode images and never load the image member:
statistics come from the low-dimensional ``data__*`` arrays only. Missing or
inconsistent metadata is an immediate :class:`~dpflow_core.errors.DatasetError`
naming the file, the member and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.files import sha256_file, write_text_atomic
from dpflow_core.replay_buffer import ReplayBuffer

#: Statistics format version of ``norm_stats.json``.
NORM_STATS_VERSION = 1

#: Data keys never normalised: images, and the per-episode clock.
NON_STATE_KEYS = ("timestamp",)

#: Episode length below which the UMI sampler yields no training sample:
#: (action_horizon 16 - 1) x down_sample_steps 3 + 1 (formats.md section 2).
MIN_TRAIN_LENGTH = 46

_CHUNK_STEPS = 1 << 16


def lowdim_keys(buffer: ReplayBuffer) -> list[str]:
    """Data keys of ``buffer`` that get norm stats: every non-image key except ``timestamp``."""
    return sorted(k for k in buffer if not k.endswith("_rgb") and k not in NON_STATE_KEYS)


def compute_norm_stats(npz_path: str | Path, sha256: str | None = None,
                       allow_zero_variance: bool | Iterable[str] = False) -> dict:
    """Per-dimension statistics of every low-dimensional key of a replay buffer.

    For each key (``robot0_eef_pos``, ``robot0_eef_rot_axis_angle``,
    ``robot0_gripper_width``, ``robot0_demo_start_pose``, ``robot0_demo_end_pose``;
    not ``timestamp``, not images) and each dimension: mean, std (population,
    ddof=0), min, max, q01 and q99 (``numpy.quantile``, linear method), and the
    sample count T, all computed in float64 over the whole member. Layout of the
    result (openpi-style ``norm_stats`` plus provenance)::

        {"norm_stats_version": 1,
         "dataset": {"path", "sha256", "size_bytes", "n_episodes", "total_steps", "frequency_hz"},
         "created_at": ISO-8601 UTC,
         "norm_stats": {key: {"mean": [...], "std": [...], "min": [...], "max": [...],
                              "q01": [...], "q99": [...], "count": T}}}

    Args:
        npz_path: the ``dataset.npz``.
        sha256: its SHA-256 when already known (conversion computes it while
            writing); otherwise the file is hashed here.
        allow_zero_variance: record constant dimensions (std 0) instead of
            raising; the consumer must then guard its division (the trainer's
            normaliser treats a range below ``range_eps`` as constant). True for
            every key, or the keys for which it holds (e.g. the demo start/end
            pose of a single-episode dataset, constant by construction). Constant
            dimensions are listed as ``constant_dims`` of their key.

    Raises:
        DatasetError: the buffer does not open (missing file or member, members of
            different lengths, ``episode_ends`` not strictly increasing or not ending
            at T, metadata missing or contradicting the arrays: see
            :class:`ReplayBuffer`), a value is NaN or infinite, or a dimension has
            zero variance (min == max); the message names the member and dimension.
    """
    path = Path(npz_path)
    buffer = ReplayBuffer(path)
    keys = lowdim_keys(buffer)
    if not keys:
        raise DatasetError("no low-dimensional data__ members to compute statistics of", path=path)
    n = buffer.n_steps
    stats: dict[str, dict] = {}
    for key in keys:
        member = f"data__{key}"
        values = np.asarray(buffer[key], dtype=np.float64).reshape(n, -1)
        finite = np.isfinite(values)
        if not finite.all():
            step, dim = (int(v) for v in np.argwhere(~finite)[0])
            raise DatasetError(
                f"member {member!r} dimension {dim} holds {int((~finite).sum())} NaN/inf values "
                f"(first at step {step}: {values[step, dim]})",
                path=path,
                code="dataset_not_finite",
            )
        lo, hi = values.min(axis=0), values.max(axis=0)
        flat = np.flatnonzero(lo == hi)
        allowed = allow_zero_variance is True or (
            not isinstance(allow_zero_variance, bool) and key in set(allow_zero_variance))
        if flat.size and not allowed:
            hint = " (a single episode makes demo start/end poses constant)" if buffer.n_episodes == 1 else ""
            raise DatasetError(
                f"member {member!r} dimension {int(flat[0])} has zero variance (every one of {n} steps is "
                f"{float(lo[flat[0]])!r}); it cannot be normalised{hint}",
                path=path,
                code="dataset_zero_variance",
            )
        q01, q99 = np.quantile(values, [0.01, 0.99], axis=0)
        stats[key] = {
            "mean": values.mean(axis=0).tolist(),
            "std": values.std(axis=0).tolist(),
            "min": lo.tolist(),
            "max": hi.tolist(),
            "q01": q01.tolist(),
            "q99": q99.tolist(),
            "count": n,
        }
        if flat.size:
            stats[key]["constant_dims"] = [int(d) for d in flat]
    return {
        "norm_stats_version": NORM_STATS_VERSION,
        "dataset": {
            "path": str(path),
            "sha256": sha256 or sha256_file(path),
            "size_bytes": path.stat().st_size,
            "n_episodes": buffer.n_episodes,
            "total_steps": n,
            "frequency_hz": buffer.frequency_hz,
        },
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "norm_stats": stats,
    }


def write_norm_stats(stats: dict, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``stats`` (from :func:`compute_norm_stats`) as JSON, atomically.

    Raises:
        DatasetError: ``path`` exists and ``overwrite`` is false (``output_exists``).
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise DatasetError("norm stats file exists; pass --overwrite (overwrite=True from Python) to replace it", path=path, code="output_exists")
    try:
        write_text_atomic(path, json.dumps(stats, indent=2) + "\n", overwrite=overwrite)
    except FileExistsError as exc:
        raise DatasetError("norm stats file appeared meanwhile; left untouched", path=path, code="output_exists") from exc
    return path


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one dataset check.

    Attributes:
        name: stable check name (the Dagster asset check name).
        passed: whether the check passed.
        severity: ``"error"`` (blocks downstream use) or ``"warn"``.
        description: one sentence with the numbers.
        metadata: figures behind the outcome (JSON-serialisable).
    """

    name: str
    passed: bool
    severity: str
    description: str
    metadata: dict = field(default_factory=dict)


#: Check names in the order :func:`validate_dataset` returns them.
CHECKS = (
    "members_length_T",
    "episode_ends_valid",
    "values_finite",
    "rotation_norm_le_pi",
    "image_size",
    "min_two_episodes",
    "short_episodes",
)


def validate_dataset(
    npz_path: str | Path,
    image_size: tuple[int, int] | None = None,
    min_episodes: int = 2,
    min_train_length: int = MIN_TRAIN_LENGTH,
    max_short_episodes: int = 0,
) -> list[CheckResult]:
    """Check a replay buffer; one :class:`CheckResult` per name in :data:`CHECKS`.

    Checks: every ``data__*`` member has length T; ``episode_ends`` strictly
    increasing with last == T; low-dimensional values finite; rotation-vector
    norms <= pi (+1e-6 for float32 rounding); frames of ``image_size`` (W, H)
    when given, else of the metadata's ``image_size``; at least ``min_episodes``
    episodes; and (severity ``warn``) at most ``max_short_episodes`` episodes
    shorter than ``min_train_length`` steps (they yield no training sample).
    When the buffer does not open, every check fails with the reason.

    Never raises for a bad dataset; the results say what is wrong.
    """
    path = Path(npz_path)
    try:
        buffer = ReplayBuffer(path)
    except DatasetError as exc:
        return [
            CheckResult(name, False, "warn" if name == "short_episodes" else "error",
                        f"dataset does not open: {exc.reason}", {"path": str(path)})
            for name in CHECKS
        ]
    n = buffer.n_steps
    ends = buffer.episode_ends
    lengths = buffer.episode_lengths
    results = []

    member_lengths = {f"data__{k}": int(buffer[k].shape[0]) for k in buffer}
    results.append(CheckResult("members_length_T", all(v == n for v in member_lengths.values()), "error",
                               f"all {len(member_lengths)} data__ members hold T = {n} steps", member_lengths))
    ok_ends = bool(ends.size and np.all(np.diff(ends) > 0) and ends[0] > 0 and int(ends[-1]) == n)
    results.append(CheckResult("episode_ends_valid", ok_ends, "error",
                               f"episode_ends strictly increasing, last = {int(ends[-1])}, T = {n}",
                               {"n_episodes": int(ends.size), "last": int(ends[-1]), "T": n}))

    bad: dict[str, int] = {}
    for key in buffer:
        arr = buffer[key]
        if arr.dtype.kind != "f":
            continue
        count = 0
        for s in range(0, n, _CHUNK_STEPS):
            count += int(np.count_nonzero(~np.isfinite(arr[s : s + _CHUNK_STEPS])))
        if count:
            bad[f"data__{key}"] = count
    results.append(CheckResult(
        "values_finite", not bad, "error",
        "all floating-point members are finite" if not bad else f"non-finite values: {bad}",
        {"non_finite": bad}))

    if "robot0_eef_rot_axis_angle" in buffer:
        norms = np.linalg.norm(np.asarray(buffer["robot0_eef_rot_axis_angle"], dtype=np.float64), axis=1)
        max_norm = float(np.nanmax(norms)) if norms.size else 0.0
        ok = bool(np.all(norms <= math.pi + 1e-6))
        results.append(CheckResult("rotation_norm_le_pi", ok, "error",
                                   f"largest rotation-vector norm {max_norm:.6f} rad (limit pi)",
                                   {"max_norm_rad": max_norm, "over_pi": int(np.count_nonzero(norms > math.pi + 1e-6))}))
    else:
        results.append(CheckResult("rotation_norm_le_pi", False, "error",
                                   "member 'data__robot0_eef_rot_axis_angle' is missing", {}))

    want = list(image_size) if image_size is not None else list(buffer.metadata["image_size"])
    rgb = {k: [int(buffer[k].shape[2]), int(buffer[k].shape[1])] for k in buffer if k.endswith("_rgb")}
    ok = bool(rgb) and all(v == want for v in rgb.values())
    results.append(CheckResult("image_size", ok, "error",
                               f"frames {rgb} (W, H), requested {want}", {"requested": want, "members": rgb}))

    results.append(CheckResult("min_two_episodes", buffer.n_episodes >= min_episodes, "error",
                               f"{buffer.n_episodes} episodes (at least {min_episodes} for a train/val split by episode)",
                               {"n_episodes": buffer.n_episodes, "minimum": min_episodes}))

    short = [int(i) for i in np.flatnonzero(lengths < min_train_length)]
    results.append(CheckResult(
        "short_episodes", len(short) <= max_short_episodes, "warn",
        f"{len(short)} of {buffer.n_episodes} episodes shorter than {min_train_length} steps "
        f"(no training sample; threshold {max_short_episodes})",
        {"short_episodes": short, "lengths": lengths.tolist(), "min_train_length": min_train_length}))
    return results


def read_recorded_sha256(sidecar_path: str | Path) -> str:
    """The ``sha256`` a dataset's sidecar (``dataset.json``) recorded when the dataset was written.

    The one reader of that field: :func:`check_recorded_sha256` and :func:`recorded_sha256` both use it.

    Returns:
        64 hex digits.

    Raises:
        DatasetError: the sidecar cannot be read, is not JSON, or records no 64-digit ``sha256``
            (code ``bad_sidecar``; names the sidecar).
    """
    sidecar_path = Path(sidecar_path)
    try:
        doc = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read the dataset's sidecar: {exc}", path=sidecar_path, code="bad_sidecar") from exc
    sha = doc.get("sha256") if isinstance(doc, dict) else None
    if not isinstance(sha, str) or len(sha) != 64:
        raise DatasetError("the dataset's sidecar records no sha256", path=sidecar_path, code="bad_sidecar")
    return sha


def check_recorded_sha256(npz_path: str | Path, sidecar_path: str | Path) -> CheckResult:
    """Check ``npz_path`` against the SHA-256 its sidecar (``dataset.json``) recorded when it was written
    (:func:`read_recorded_sha256`).

    This catches what the structural checks of :func:`validate_dataset` cannot see, such as a
    changed byte inside an image. Result name ``sha256_matches_sidecar``, severity ``error``;
    a missing or unreadable sidecar, or one without ``sha256``, fails with that reason.

    Never raises for a bad dataset or sidecar; an unreadable dataset fails the check.
    """
    npz_path, sidecar_path = Path(npz_path), Path(sidecar_path)
    meta = {"path": str(npz_path), "sidecar_path": str(sidecar_path)}
    try:
        recorded = read_recorded_sha256(sidecar_path)
    except DatasetError as exc:
        return CheckResult("sha256_matches_sidecar", False, "error", str(exc), meta)
    try:
        actual = sha256_file(npz_path)
    except OSError as exc:
        return CheckResult("sha256_matches_sidecar", False, "error", f"dataset is unreadable: {exc}", meta)
    ok = actual == recorded
    text = (f"SHA-256 {actual[:16]}... equals the one recorded in {sidecar_path.name}" if ok else
            f"SHA-256 {actual} differs from {recorded} recorded in {sidecar_path.name}: the file changed after conversion")
    return CheckResult("sha256_matches_sidecar", ok, "error", text, meta | {"sha256": actual, "recorded_sha256": recorded})


def recorded_sha256(dataset_path: str | Path) -> str | None:
    """The SHA-256 recorded for a dataset when it was converted: ``sha256`` of its sidecar
    (``dataset.json`` beside ``dataset.npz``, :func:`dpflow_core.conversion.sidecar_path_for`),
    read by :func:`read_recorded_sha256`.

    Returns:
        64 hex digits, or None when there is no sidecar (a dataset not written by dpflow).

    Raises:
        DatasetError: the sidecar exists but is not JSON or records no ``sha256``
            (code ``bad_sidecar``; names the sidecar).
    """
    sidecar = Path(dataset_path).with_suffix(".json")
    if not sidecar.exists():
        return None
    return read_recorded_sha256(sidecar)


def dataset_task(dataset_path: str | Path | None) -> str | None:
    """The task a dataset was converted from (its sidecar ``dataset.json``'s ``task``), or None when the
    path is empty, the sidecar is not on this machine or does not say; never raises (a label, not a check)."""
    if not dataset_path:
        return None
    try:
        task = json.loads(Path(dataset_path).with_suffix(".json").read_text()).get("task")
    except (OSError, ValueError, AttributeError):
        return None
    return str(task) if task else None


def origin_start_keys(npz_path: str | Path) -> tuple[str, ...]:
    """``("robot0_demo_start_pose",)`` when every constant dimension of the buffer's start pose is 0: the VIO
    origin (formats.md section 1), where every episode's track starts, so constant by construction; ``()``
    otherwise (a start pose constant at another value, such as the same take twice, is a fault)."""
    key = "robot0_demo_start_pose"
    buffer = ReplayBuffer(Path(npz_path))
    if key not in buffer:
        return ()
    v = np.asarray(buffer[key], dtype=np.float64).reshape(buffer.n_steps, -1)
    flat = v.min(axis=0) == v.max(axis=0)
    return (key,) if flat.any() and bool(np.all(np.abs(v[0, flat]) < 1e-12)) else ()
