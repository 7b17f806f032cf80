"""Validation of a LeRobot dataset folder (v3.0 or v2.1), and its low-dimensional columns.

Takes a dataset folder; gives a :class:`LeRobotLayout` once ``meta/info.json``, the episode index
(``meta/episodes.jsonl`` in v2.1, ``meta/episodes/*/*.parquet`` in v3.0), ``meta/stats.json`` (v3.0)
and the files agree (else a :class:`~dpflow_core.errors.DatasetError` naming the file and the
field), and the state and action columns (``(N, D)``) read from the parquet files only.
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
from dpflow_core.export.features import (
    EPISODES_PATH, FORMATS, INFO_PATH, OPENPI_NORM_KEYS, STATS_PATH, V30_EPISODES_DIR, V30_TASKS_PATH, V30_VERSION,
)


# --------------------------------------------------------------------------- norm stats


@dataclass(frozen=True)
class LeRobotLayout:
    """The parts of a LeRobot dataset's metadata that norm stats rely on.

    Attributes:
        root: the dataset folder.
        info: ``meta/info.json`` as parsed.
        lengths: episode index -> number of frames (the episode index of the format).
        keys: openpi norm key (``state``, ``actions``) -> LeRobot feature key.
        dims: openpi norm key -> vector length D.
        files: v3.0: episode index -> (chunk_index, file_index) of its data file; empty for v2.1.
    """

    root: Path
    info: dict
    lengths: dict[int, int]
    keys: dict[str, str]
    dims: dict[str, int]
    files: dict[int, tuple[int, int]] = None  # type: ignore[assignment]

    @property
    def version(self) -> str:
        """``codebase_version`` of ``meta/info.json``."""
        return self.info["codebase_version"]

    def data_file(self, episode_index: int) -> Path:
        """The parquet file of an episode (``data_path`` template of ``info.json``)."""
        if self.version == V30_VERSION:
            chunk, file = self.files[episode_index]
            return self.root / self.info["data_path"].format(chunk_index=chunk, file_index=file)
        chunk = episode_index // int(self.info["chunks_size"])
        return self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=episode_index)


def read_metadata_json(path: Path, what: str):
    """The JSON document in ``path``; ``what`` names it in the error (``"meta/info.json"``).

    Raises:
        DatasetError: ``bad_metadata`` when it is not valid JSON (OSError passes on).
    """
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{what} is not valid JSON: {exc}", path, code="bad_metadata") from exc


def validate_lerobot_dataset(dataset_dir: str | Path, expected_version: str | None = None) -> LeRobotLayout:
    """Check a LeRobot dataset's metadata before anything is computed from it.

    Reads only local metadata: ``meta/info.json``, and ``meta/episodes.jsonl`` (v2.1) or
    ``meta/episodes/*/*.parquet``, ``meta/stats.json`` and ``meta/tasks.parquet`` (v3.0).

    Args:
        dataset_dir: the dataset folder (the one holding ``meta/``).
        expected_version: the ``codebase_version`` required; None accepts any of :data:`FORMATS`.

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
    info = read_metadata_json(info_path, INFO_PATH)
    if not isinstance(info, dict):
        raise DatasetError("must hold a JSON object", info_path, code="bad_metadata")
    version = info.get("codebase_version")
    if version != expected_version if expected_version is not None else version not in FORMATS:
        wanted = repr(expected_version) if expected_version is not None else " or ".join(map(repr, FORMATS))
        raise DatasetError(
            f"codebase_version is {version!r}, expected {wanted} "
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
    if version == V30_VERSION:
        lengths, files, episodes_path = _v30_episodes(root)
        _check_v30_stats(root, keys, dims)
        if not (root / V30_TASKS_PATH).is_file():
            raise DatasetError(f"{V30_TASKS_PATH} not found", root / V30_TASKS_PATH, code="missing_metadata")
    else:
        lengths, files, episodes_path = _v21_episodes(root), {}, root / EPISODES_PATH
    if len(lengths) != info["total_episodes"] or sum(lengths.values()) != info["total_frames"]:
        raise DatasetError(
            f"{len(lengths)} episodes with {sum(lengths.values())} frames, but {INFO_PATH} says "
            f"total_episodes {info['total_episodes']}, total_frames {info['total_frames']}",
            episodes_path,
            code="inconsistent_metadata",
        )
    return LeRobotLayout(root=root, info=info, lengths=dict(sorted(lengths.items())), keys=keys, dims=dims, files=files)


def _v30_episodes(root: Path) -> tuple[dict[int, int], dict[int, tuple[int, int]], Path]:
    """Lengths and data files of the v3.0 episode index ``meta/episodes/chunk-*/file-*.parquet``."""
    folder = root / V30_EPISODES_DIR
    paths = sorted(folder.glob("*/*.parquet"))
    if not paths:
        raise DatasetError(f"{V30_EPISODES_DIR}/chunk-*/file-*.parquet not found (no episode index)", folder, code="missing_metadata")
    needed = ("episode_index", "length", "data/chunk_index", "data/file_index", "dataset_from_index", "dataset_to_index")
    lengths: dict[int, int] = {}
    files: dict[int, tuple[int, int]] = {}
    for path in paths:
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"episode index is not a readable parquet file: {exc}", path, code="bad_metadata") from exc
        missing = [c for c in needed if c not in table.column_names]
        if missing:
            raise DatasetError(f"episode index lacks the columns {missing}", path, code="bad_metadata")
        cols = {c: table.column(c).to_pylist() for c in needed}
        for row in range(table.num_rows):
            ep, length = cols["episode_index"][row], cols["length"][row]
            values = [cols[c][row] for c in needed]
            if not all(isinstance(v, int) and v >= 0 for v in values) or ep in lengths:
                raise DatasetError(f"row {row}: bad or repeated episode_index/length {ep!r}/{length!r} or a null index",
                                   path, code="bad_metadata")
            if cols["dataset_to_index"][row] - cols["dataset_from_index"][row] != length:
                raise DatasetError(f"row {row} (episode {ep}): dataset_to_index - dataset_from_index differs from length {length}",
                                   path, code="inconsistent_metadata")
            lengths[ep] = length
            files[ep] = (cols["data/chunk_index"][row], cols["data/file_index"][row])
    return lengths, files, folder


def _check_v30_stats(root: Path, keys: dict[str, str], dims: dict[str, int]) -> None:
    """``meta/stats.json`` must hold, for the state and the action, every statistic with the feature's shape."""
    path = root / STATS_PATH
    if not path.is_file():
        raise DatasetError(f"{STATS_PATH} not found", path, code="missing_metadata")
    stats = read_metadata_json(path, STATS_PATH)
    for norm_key, feature in keys.items():
        entry = stats.get(feature) if isinstance(stats, dict) else None
        if not isinstance(entry, dict):
            raise DatasetError(f"no statistics for feature {feature!r}", path, code="bad_metadata")
        for name in ("min", "max", "mean", "std", "count"):
            value = entry.get(name)
            want = 1 if name == "count" else dims[norm_key]
            if not (isinstance(value, list) and len(value) == want and all(isinstance(x, (int, float)) for x in value)):
                raise DatasetError(f"field {feature}.{name} is missing or not a list of {want} numbers", path, code="bad_metadata")


def _v21_episodes(root: Path) -> dict[int, int]:
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
    return lengths


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
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(rows, d)


def _read_lowdim_per_file(layout: LeRobotLayout) -> dict[str, np.ndarray]:
    """The careful path: one file at a time (its episodes in index order), so an error names the file."""
    columns = list(layout.keys.values())
    by_file: dict[Path, list[int]] = {}
    for ep in layout.lengths:
        by_file.setdefault(layout.data_file(ep), []).append(ep)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in layout.keys}
    for path, eps in by_file.items():
        lengths = [layout.lengths[ep] for ep in eps]
        what = f"{EPISODES_PATH} says length {lengths[0]}" if len(eps) == 1 else f"the episode index says {sum(lengths)} for episodes {eps}"
        try:
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=columns + (["episode_index"] if "episode_index" in names else []))
        except (pa.ArrowInvalid, OSError, KeyError) as exc:
            raise DatasetError(f"cannot read columns {columns}: {exc}", path, code="bad_data") from exc
        if table.num_rows != sum(lengths):
            raise DatasetError(f"{table.num_rows} rows, but {what}", path, code="inconsistent_data")
        if "episode_index" in table.column_names:
            found = table.column("episode_index").to_numpy()
            if not np.array_equal(found, np.repeat(eps, lengths)):
                raise DatasetError(f"episode_index column holds {sorted(set(found.tolist()))}, expected {eps} in order",
                                   path, code="inconsistent_data")
        for norm_key, col in layout.keys.items():
            parts[norm_key].append(_vectors(table.column(col).combine_chunks(), col, layout.dims[norm_key], sum(lengths), path))
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
        openpi norm key -> (total_frames, D) in the column's dtype (float32 as dpflow writes it), episodes in index order.

    Raises:
        DatasetError: when a parquet file is missing or unreadable, lacks a
            column, has a row count other than its episode's length or another
            episode's rows, or holds vectors of another length than the feature's shape.
    """
    paths = list(dict.fromkeys(layout.data_file(ep) for ep in layout.lengths))
    for ep in layout.lengths:
        if not layout.data_file(ep).is_file():
            raise DatasetError(f"parquet file of episode {ep} not found", layout.data_file(ep), code="missing_data")
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
