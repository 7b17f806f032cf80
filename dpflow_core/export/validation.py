"""Validation of a LeRobot v2.1 dataset folder, and its low-dimensional columns.

Takes a dataset folder; gives a :class:`LeRobotLayout` once ``meta/info.json`` and the files agree
(else a :class:`~dpflow_core.errors.DatasetError` naming the file and the field), and the state and
action columns (float32 ``(N, D)``) read from the parquet files only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from dpflow_core.errors import DatasetError
from dpflow_core.export.features import CODEBASE_VERSION, EPISODES_PATH, INFO_PATH, OPENPI_NORM_KEYS


# --------------------------------------------------------------------------- norm stats


@dataclass(frozen=True)
class LeRobotLayout:
    """The parts of a LeRobot dataset's metadata that norm stats rely on.

    Attributes:
        root: the dataset folder.
        info: ``meta/info.json`` as parsed.
        lengths: episode index -> number of frames (``meta/episodes.jsonl``).
        keys: openpi norm key (``state``, ``actions``) -> LeRobot feature key.
        dims: openpi norm key -> vector length D.
    """

    root: Path
    info: dict
    lengths: dict[int, int]
    keys: dict[str, str]
    dims: dict[str, int]

    def data_file(self, episode_index: int) -> Path:
        """The parquet file of an episode (``data_path`` template of ``info.json``)."""
        chunk = episode_index // int(self.info["chunks_size"])
        return self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=episode_index)


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{what} is not valid JSON: {exc}", path, code="bad_metadata") from exc


def validate_lerobot_dataset(dataset_dir: str | Path, expected_version: str = CODEBASE_VERSION) -> LeRobotLayout:
    """Check a LeRobot dataset's metadata before anything is computed from it.

    Reads only ``meta/info.json`` and ``meta/episodes.jsonl`` (local files).

    Args:
        dataset_dir: the dataset folder (the one holding ``meta/``).
        expected_version: the ``codebase_version`` required.

    Returns:
        The validated layout.

    Raises:
        DatasetError: when the folder or ``meta/info.json`` is missing (the
            dataset was never converted), ``codebase_version`` differs from
            ``expected_version`` (both named), a required field or feature is
            missing or malformed, ``meta/episodes.jsonl`` disagrees with the
            totals, or the dataset has no frames.
    """
    root = Path(dataset_dir)
    if not root.is_dir():
        raise DatasetError("dataset folder not found", root, code="missing_dataset")
    info_path = root / INFO_PATH
    if not info_path.is_file():
        raise DatasetError(
            f"{INFO_PATH} not found: this is not a converted LeRobot dataset "
            "(convert the recordings first: dpflow export-lerobot MANIFEST -o DIR)",
            info_path,
            code="missing_metadata",
        )
    info = _read_json(info_path, INFO_PATH)
    if not isinstance(info, dict):
        raise DatasetError("must hold a JSON object", info_path, code="bad_metadata")
    version = info.get("codebase_version")
    if version != expected_version:
        raise DatasetError(
            f"codebase_version is {version!r}, expected {expected_version!r} "
            f"(re-export the dataset with dpflow export-lerobot, or ask for {version!r} explicitly)",
            info_path,
            code="version_mismatch",
        )
    for key, kind in (("features", dict), ("data_path", str), ("chunks_size", int), ("total_episodes", int), ("total_frames", int)):
        if not isinstance(info.get(key), kind) or isinstance(info.get(key), bool):
            raise DatasetError(f"field {key!r} is missing or not a {kind.__name__}", info_path, code="bad_metadata")
    if info["chunks_size"] <= 0:
        raise DatasetError(f"field 'chunks_size' is {info['chunks_size']}, must be positive", info_path, code="bad_metadata")
    features = info["features"]
    keys, dims = {}, {}
    for norm_key, candidates in OPENPI_NORM_KEYS.items():
        found = next((c for c in candidates if c in features), None)
        if found is None:
            raise DatasetError(
                f"features has none of {list(candidates)} (needed for {norm_key!r}); features are {sorted(features)}",
                info_path,
                code="inconsistent_features",
            )
        ft = features[found] if isinstance(features[found], dict) else {}
        shape = ft.get("shape")
        if ft.get("dtype") not in ("float32", "float64"):
            raise DatasetError(
                f"feature {found!r} has dtype {ft.get('dtype')!r}, expected float32 or float64",
                info_path,
                code="inconsistent_features",
            )
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 0):
            raise DatasetError(f"feature {found!r} has shape {shape!r}, expected [D] with D > 0", info_path, code="inconsistent_features")
        names = ft.get("names")
        if isinstance(names, list) and len(names) != shape[0]:
            raise DatasetError(f"feature {found!r} has shape {shape} but {len(names)} names", info_path, code="inconsistent_features")
        keys[norm_key], dims[norm_key] = found, shape[0]
    if info["total_episodes"] <= 0 or info["total_frames"] <= 0:
        raise DatasetError(
            f"dataset is empty: total_episodes {info['total_episodes']}, total_frames {info['total_frames']}",
            info_path,
            code="empty_dataset",
        )
    episodes_path = root / EPISODES_PATH
    if not episodes_path.is_file():
        raise DatasetError(f"{EPISODES_PATH} not found", episodes_path, code="missing_metadata")
    lengths: dict[int, int] = {}
    for line_no, line in enumerate(episodes_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ep, length = record["episode_index"], record["length"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DatasetError(f"line {line_no} is not an episode record: {exc}", episodes_path, code="bad_metadata") from exc
        if not isinstance(ep, int) or not isinstance(length, int) or length < 0 or ep in lengths:
            raise DatasetError(f"line {line_no}: bad or repeated episode_index/length {ep!r}/{length!r}", episodes_path, code="bad_metadata")
        lengths[ep] = length
    if len(lengths) != info["total_episodes"] or sum(lengths.values()) != info["total_frames"]:
        raise DatasetError(
            f"{len(lengths)} episodes with {sum(lengths.values())} frames, but {INFO_PATH} says "
            f"total_episodes {info['total_episodes']}, total_frames {info['total_frames']}",
            episodes_path,
            code="inconsistent_metadata",
        )
    return LeRobotLayout(root=root, info=info, lengths=dict(sorted(lengths.items())), keys=keys, dims=dims)


def _vectors(arr: pa.Array, col: str, d: int, rows: int, where: Path) -> np.ndarray:
    """(rows, d) float64 from a list column, or DatasetError naming ``where``."""
    if not (pa.types.is_list(arr.type) or pa.types.is_fixed_size_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DatasetError(f"column {col!r} has type {arr.type}, expected a list of floats", where, code="inconsistent_data")
    if arr.null_count:
        raise DatasetError(f"column {col!r} has {arr.null_count} null rows", where, code="inconsistent_data")
    sizes = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if rows and np.any(sizes != d):
        raise DatasetError(
            f"column {col!r} holds vectors of length {sorted(set(sizes.tolist()))}, feature shape is [{d}]",
            where,
            code="inconsistent_data",
        )
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(rows, d)


def _read_lowdim_per_file(layout: LeRobotLayout) -> dict[str, np.ndarray]:
    """The careful path: one file at a time, so an error names the file."""
    columns = list(layout.keys.values())
    parts: dict[str, list[np.ndarray]] = {k: [] for k in layout.keys}
    for ep, length in layout.lengths.items():
        path = layout.data_file(ep)
        try:
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=columns + (["episode_index"] if "episode_index" in names else []))
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise DatasetError(f"cannot read columns {columns}: {exc}", path, code="bad_data") from exc
        if table.num_rows != length:
            raise DatasetError(f"{table.num_rows} rows, but {EPISODES_PATH} says length {length}", path, code="inconsistent_data")
        if "episode_index" in table.column_names:
            found = set(table.column("episode_index").to_pylist())
            if found - {ep}:
                raise DatasetError(f"episode_index column holds {sorted(found)}, expected {ep}", path, code="inconsistent_data")
        for norm_key, col in layout.keys.items():
            parts[norm_key].append(_vectors(table.column(col).combine_chunks(), col, layout.dims[norm_key], length, path))
    return {k: np.concatenate(v, axis=0) for k, v in parts.items()}


def read_lowdim(layout: LeRobotLayout) -> dict[str, np.ndarray]:
    """The state and action columns of every frame, from the parquet files only.

    All files are read in one multi-threaded pyarrow dataset scan; the
    ``episode_index`` column must then equal each episode's index repeated
    ``length`` times (order, row counts and identity in one check). When
    anything does not match, the files are read again one by one so that the
    error names the file at fault.

    Args:
        layout: a validated dataset (:func:`validate_lerobot_dataset`).

    Returns:
        openpi norm key -> (total_frames, D) float64, episodes in index order.

    Raises:
        DatasetError: when a parquet file is missing or unreadable, lacks a
            column, has a row count other than its episode's length or another
            episode's rows, or holds vectors of another length than the feature's shape.
    """
    paths = [layout.data_file(ep) for ep in layout.lengths]
    for ep, path in zip(layout.lengths, paths):
        if not path.is_file():
            raise DatasetError(f"parquet file of episode {ep} not found", path, code="missing_data")
    columns = list(layout.keys.values())
    expected = np.repeat(np.fromiter(layout.lengths.keys(), dtype=np.int64), np.fromiter(layout.lengths.values(), dtype=np.int64))
    try:
        table = pads.dataset([str(p) for p in paths], format="parquet").to_table(columns=[*columns, "episode_index"])
        episode_index = table.column("episode_index").to_numpy()
        if not np.array_equal(episode_index, expected):
            raise ValueError("episode_index does not match meta/episodes.jsonl")
        return {
            k: _vectors(table.column(col).combine_chunks(), col, layout.dims[k], len(expected), layout.root)
            for k, col in layout.keys.items()
        }
    except (pa.ArrowException, OSError, KeyError, ValueError, DatasetError):
        result = _read_lowdim_per_file(layout)
        if sum(len(v) for v in result.values()) != len(expected) * len(result):
            raise DatasetError("parquet rows do not match meta/episodes.jsonl", layout.root, code="inconsistent_data")
        return result
