"""UMI export: the replay buffer as upstream UMI's ``dataset.zarr.zip`` (zarr format 2).

Takes a ``dataset.npz`` (:class:`~dpflow_core.replay_buffer.ReplayBuffer`); gives the zip that upstream
UMI's ``ReplayBuffer.copy_from_store`` / ``UmiDataset`` read, with its SHA-256 in a JSON sidecar
(``<name>.json`` beside it, as ``dataset.json`` beside the npz).

Layout (the UMI replay buffer, zarr format 2, each group and array a folder of the zip)::

    data/camera0_rgb                (T, H, W, 3) uint8, one frame per chunk, JPEG-XL (imagecodecs'
                                    numcodecs codec ``imagecodecs_jpegxl``: level and effort given here)
    data/robot0_eef_pos             (T, 3) float32, metres
    data/robot0_eef_rot_axis_angle  (T, 3) float32, rotation vector, radians
    data/robot0_gripper_width       (T, 1) float32, metres
    data/robot0_demo_start_pose     (T, 6) float32
    data/robot0_demo_end_pose       (T, 6) float32
    meta/episode_ends               (E,) int64, cumulative, last == T

The root group's attributes (``.zattrs``) hold ``frequency_hz``, the dataset's measured rate (Hz),
read on the GPU server for ``task.dataset_frequeny`` (:func:`dpflow_core.runs.dataset_frequency`).
Low-dimensional arrays are one uncompressed chunk each. A reader must register the codecs first
(``imagecodecs.numcodecs.register_codecs()``), as UMI does. The store is written by zarr into a
temporary folder, then packed into the zip with each entry written once (zarr 3's ``ZipStore``
appends a duplicate entry when a key is rewritten), stored uncompressed (the frames are compressed
already), under a temporary name renamed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.errors import DatasetError
from dpflow_core.files import atomic_path, os_errors_named, remove_stale_temporaries, sha256_file, temp_name
from dpflow_core.results import StageResult

#: The ``data/`` arrays UMI reads, in order.
UMI_DATA_KEYS = (
    "camera0_rgb",
    "robot0_eef_pos",
    "robot0_eef_rot_axis_angle",
    "robot0_gripper_width",
    "robot0_demo_start_pose",
    "robot0_demo_end_pose",
)
#: JPEG-XL quality (libjxl "level", 0-100; UMI's own conversion uses 80) and effort (1-9, speed).
DEFAULT_JPEGXL_LEVEL = 80
DEFAULT_JPEGXL_EFFORT = 3


@dataclass(frozen=True)
class UmiExport(StageResult):
    """What :func:`export_umi` wrote; the value of the ``umi_dataset`` asset (``to_dict``/``from_dict``).

    Attributes:
        path: the ``dataset.zarr.zip``; sidecar_path: its JSON sidecar.
        sha256: SHA-256 (hex) of the zip; size_bytes: its size in bytes.
        n_steps, n_episodes: T and E.
        image_shape: (H, W, 3) of ``camera0_rgb``.
        jpegxl_level, jpegxl_effort: the codec settings of the frames.
        source: the npz it came from; source_sha256: that file's SHA-256 (from its metadata when recorded).
    """

    path: str
    sidecar_path: str
    sha256: str
    size_bytes: int
    n_steps: int
    n_episodes: int
    image_shape: tuple[int, int, int]
    jpegxl_level: int
    jpegxl_effort: int
    source: str
    source_sha256: str


def umi_sidecar_path(out: Path) -> Path:
    """``<out>.json`` (``dataset.zarr.zip`` -> ``dataset.zarr.zip.json``)."""
    return out.with_name(out.name + ".json")


def read_umi_sidecar(
    out: str | Path, *, source_sha256: str, jpegxl_level: int, jpegxl_effort: int
) -> UmiExport | None:
    """The earlier export at ``out`` when it holds exactly this dataset with these codec settings, else None.

    Reuse is decided by content: the sidecar must name ``source_sha256`` and the same JPEG-XL level
    and effort, and the zip's SHA-256 must equal the sidecar's (a changed or truncated zip is not
    reused). Returns None when ``out`` or its sidecar is missing or unreadable.
    """
    out = Path(out)
    sidecar = umi_sidecar_path(out)
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not out.is_file():
        return None
    if (meta.get("source_sha256"), meta.get("jpegxl_level"), meta.get("jpegxl_effort")) != (
        source_sha256, int(jpegxl_level), int(jpegxl_effort)
    ):
        return None
    if sha256_file(out) != meta.get("sha256"):
        return None
    fields = {k: meta[k] for k in UmiExport.__dataclass_fields__ if k in meta}
    if len(fields) != len(UmiExport.__dataclass_fields__):
        return None
    fields["image_shape"] = tuple(int(v) for v in fields["image_shape"])
    return UmiExport(**fields)


def _jpegxl(level: int, effort: int):
    from imagecodecs.numcodecs import Jpegxl

    # lossless=False: imagecodecs' numcodecs codec defaults to lossless, which ignores the level
    # (frames 3-4x larger and slower to decode than the lossy level-80 frames UMI writes)
    return Jpegxl(level=int(level), effort=int(effort), lossless=False, numthreads=1)


def export_umi(
    dataset: str | Path,
    out: str | Path,
    *,
    jpegxl_level: int = DEFAULT_JPEGXL_LEVEL,
    jpegxl_effort: int = DEFAULT_JPEGXL_EFFORT,
    overwrite: bool = False,
) -> UmiExport:
    """Write ``dataset`` (a ``dataset.npz``) as UMI's zarr replay buffer ``out`` (see the module docstring).

    Args:
        dataset: the replay buffer written by ``dpflow convert``.
        out: the ``.zarr.zip`` to create (its sidecar ``<out>.json`` too).
        jpegxl_level: JPEG-XL quality of the frames, 0-100 (100 is not lossless; see imagecodecs).
        jpegxl_effort: JPEG-XL encoder effort, 1 (fast) to 9 (small).
        overwrite: replace an existing output (and its sidecar).

    Returns:
        UmiExport with the SHA-256 of the zip.

    Raises:
        DatasetError: when the output or its sidecar exists (and not ``overwrite``), the output name
            does not end in ``.zip``, a level or effort is out of range, or the dataset is invalid
            (as :class:`~dpflow_core.replay_buffer.ReplayBuffer` reports it).
        StorageError: a full disk, a read-only file system or a denied permission while writing, naming ``out``
            (nothing is left: neither the zip, its sidecar nor the work folder).
    """
    from dpflow_core.replay_buffer import ReplayBuffer

    out = Path(out)
    sidecar = umi_sidecar_path(out)
    if not out.name.endswith(".zip"):
        raise DatasetError("a UMI replay buffer is a zip: name it <name>.zarr.zip", path=out, code="bad_output")
    if not 0 <= int(jpegxl_level) <= 100:
        raise DatasetError(f"JPEG-XL level must be 0..100, got {jpegxl_level!r}", path=out, code="bad_config")
    if not 1 <= int(jpegxl_effort) <= 9:
        raise DatasetError(f"JPEG-XL effort must be 1..9, got {jpegxl_effort!r}", path=out, code="bad_config")
    for path in (out, sidecar):
        if path.exists() and not overwrite:
            raise DatasetError("exists already (pass --overwrite to replace it)", path=path, code="exists")
    buffer = ReplayBuffer(dataset, required=UMI_DATA_KEYS)
    with os_errors_named(out, "writing the UMI replay buffer"):
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out.parent)  # a killed export's store, as large as the frames
        work = out.parent / temp_name(out.name, "work")
        work.mkdir()
        try:
            return _write_umi(buffer, dataset, out, sidecar, work, jpegxl_level, jpegxl_effort, overwrite)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _write_umi(buffer, dataset, out: Path, sidecar: Path, work: Path, jpegxl_level: int, jpegxl_effort: int,
               overwrite: bool) -> UmiExport:
    """The zarr store in ``work``, packed into ``out``, then the sidecar (see :func:`export_umi`)."""
    import zarr

    frames = buffer["camera0_rgb"]
    n_steps = int(frames.shape[0])
    # the zip is installed first, then its sidecar (overwrite=False: linked, never over a file
    # that appeared meanwhile); on any error neither is
    with atomic_path(sidecar, overwrite=overwrite) as sidecar_tmp, atomic_path(out, overwrite=overwrite) as tmp_zip:
        root = zarr.open_group(zarr.storage.LocalStore(work / "store"), mode="w", zarr_format=2)
        data = root.create_group("data")
        codec = _jpegxl(jpegxl_level, jpegxl_effort)
        rgb = data.create_array(
            "camera0_rgb", shape=frames.shape, chunks=(1, *frames.shape[1:]), dtype="uint8", compressors=codec,
        )
        for start in range(0, n_steps, 64):  # 64 frames at a time: memory stays small, chunks written once
            rgb[start:start + 64] = np.asarray(frames[start:start + 64])
        for key in UMI_DATA_KEYS[1:]:
            values = np.asarray(buffer[key])
            data.create_array(key, shape=values.shape, chunks=values.shape, dtype=values.dtype, compressors=None)[...] = values
        frequency = buffer.metadata.get("frequency_hz")
        if frequency is not None:  # for the server's run spec (task.dataset_frequeny); UMI's reader ignores it
            root.attrs["frequency_hz"] = float(frequency)
        meta = root.create_group("meta")
        ends = np.asarray(buffer.episode_ends, dtype=np.int64)
        meta.create_array("episode_ends", shape=ends.shape, chunks=ends.shape, dtype="int64", compressors=None)[...] = ends

        store_dir = work / "store"
        with zipfile.ZipFile(tmp_zip, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for folder, dirs, files in os.walk(store_dir):
                dirs.sort()
                for name in sorted(files):
                    full = Path(folder) / name
                    # fixed member times (as dataset.npz): the same dataset and settings give the same bytes
                    info = zipfile.ZipInfo(full.relative_to(store_dir).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                    info.external_attr = 0o644 << 16
                    zf.writestr(info, full.read_bytes(), compress_type=zipfile.ZIP_STORED)
        digest = sha256_file(tmp_zip)
        size = tmp_zip.stat().st_size
        result = UmiExport(
            path=str(out), sidecar_path=str(sidecar), sha256=digest, size_bytes=size, n_steps=n_steps,
            n_episodes=int(len(ends)), image_shape=tuple(int(v) for v in frames.shape[1:]),
            jpegxl_level=int(jpegxl_level), jpegxl_effort=int(jpegxl_effort), source=str(Path(dataset).resolve()),
            source_sha256=buffer.metadata.get("sha256") or sha256_file(dataset),
        )
        sidecar_tmp.write_text(json.dumps({**result.to_dict(), "format": "umi-zarr-v2",
                                           "frequency_hz": buffer.metadata.get("frequency_hz")}, indent=2) + "\n")
    return result


__all__ = [
    "DEFAULT_JPEGXL_EFFORT", "DEFAULT_JPEGXL_LEVEL", "UMI_DATA_KEYS", "UmiExport", "export_umi", "read_umi_sidecar",
    "umi_sidecar_path",
]
