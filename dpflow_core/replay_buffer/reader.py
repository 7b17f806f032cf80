"""The replay buffer in ``dataset.npz``: the one reader of that file in dpflow.

Layout (``formats.md`` section 2, the layout of the UMI / Diffusion Policy
family): every episode concatenated along time in ``data__<key>`` members,
cumulative episode ends in ``meta__episode_ends``, and a JSON document in
``meta__info_json``. Conversion writes it with :mod:`dpflow_core.replay_buffer.writer` (members stored,
not compressed); validation, norm statistics, the trainer and evaluation all
read it through :class:`ReplayBuffer`.

Why not ``np.load(path, mmap_mode="r")``: for an ``.npz`` numpy ignores
``mmap_mode`` and reads each member into RAM on access. Every accelerate
process would then hold its own copy of the images. Instead each stored member
is located in the zip (local file header, name, extra field, then the ``.npy``
header; PKWARE APPNOTE section 4.3.7 and the NEP 1 ``.npy`` format) and its
payload is mapped with :class:`numpy.memmap`. Opening a buffer therefore reads
headers only: start-up time and resident memory do not grow with the dataset,
and pages touched later live in the shared page cache.
"""

from __future__ import annotations

import ast
import json
import struct
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpflow_core.errors import DatasetError

DATA_PREFIX = "data__"
META_PREFIX = "meta__"
EPISODE_ENDS_MEMBER = "meta__episode_ends"
INFO_MEMBER = "meta__info_json"

#: Expected ``data__`` members: key -> (dtype, shape after the time axis; None = any size).
DATA_SPEC: dict[str, tuple[np.dtype, tuple[int | None, ...]]] = {
    "camera0_rgb": (np.dtype(np.uint8), (None, None, 3)),
    "robot0_eef_pos": (np.dtype(np.float32), (3,)),
    "robot0_eef_rot_axis_angle": (np.dtype(np.float32), (3,)),
    "robot0_gripper_width": (np.dtype(np.float32), (1,)),
    "robot0_demo_start_pose": (np.dtype(np.float32), (6,)),
    "robot0_demo_end_pose": (np.dtype(np.float32), (6,)),
    "timestamp": (np.dtype(np.float64), ()),
}

#: Fields ``meta__info_json`` must hold.
REQUIRED_INFO_FIELDS = ("frequency_hz", "n_episodes", "image_size")

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class MemberLayout:
    """Where one stored ``.npy`` member's array lies inside the ``.npz`` file.

    Attributes:
        name: the zip member name without ``.npy`` (e.g. ``data__camera0_rgb``).
        offset: byte offset of the first array element from the start of the file.
        dtype: the array's dtype.
        shape: the array's shape.
        fortran_order: True when the array is stored column-major.
    """

    name: str
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool


def _npy_layouts(path: Path) -> dict[str, MemberLayout]:
    """Locate every ``.npy`` member of an uncompressed ``.npz``.

    Raises:
        DatasetError: the file is missing or not a zip, a member is compressed,
            or a member's ``.npy`` header is unreadable or holds Python objects.
    """
    if not path.is_file():
        raise DatasetError("dataset file does not exist", path=path, code="dataset_missing")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetError(f"not a readable .npz (zip) file: {exc}", path=path) from exc

    layouts: dict[str, MemberLayout] = {}
    with open(path, "rb") as f:
        for info in infos:
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[: -len(".npy")]
            if info.compress_type != zipfile.ZIP_STORED:
                raise DatasetError(
                    f"member {name!r} is compressed (zip method {info.compress_type}); it cannot be "
                    "memory-mapped: write the dataset with np.savez, not np.savez_compressed",
                    path=path,
                    code="dataset_compressed",
                )
            if info.flag_bits & 0x1:
                raise DatasetError(f"member {name!r} is encrypted", path=path)
            f.seek(info.header_offset)
            raw = f.read(_LOCAL_HEADER.size)
            if len(raw) != _LOCAL_HEADER.size or raw[:4] != _LOCAL_HEADER_SIGNATURE:
                raise DatasetError(f"member {name!r}: bad zip local file header", path=path)
            fields = _LOCAL_HEADER.unpack(raw)
            name_len, extra_len = fields[9], fields[10]
            npy_start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
            f.seek(npy_start)
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    # Version 3.0 only changes the header text encoding (utf-8).
                    f.seek(npy_start + 8)
                    (header_len,) = struct.unpack("<I", f.read(4))
                    header = ast.literal_eval(f.read(header_len).decode("utf-8"))
                    shape, fortran_order = tuple(header["shape"]), bool(header["fortran_order"])
                    dtype = np.lib.format.descr_to_dtype(header["descr"])
            except (ValueError, OSError, KeyError, SyntaxError) as exc:
                raise DatasetError(f"member {name!r}: unreadable .npy header ({exc})", path=path) from exc
            if dtype.hasobject:
                raise DatasetError(f"member {name!r} holds Python objects; only plain arrays are allowed", path=path)
            data_offset = f.tell()
            n_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if data_offset - npy_start + n_bytes != info.file_size:
                raise DatasetError(
                    f"member {name!r}: .npy header says {n_bytes} bytes of data but the zip entry "
                    f"holds {info.file_size - (data_offset - npy_start)}",
                    path=path,
                )
            layouts[name] = MemberLayout(name, data_offset, dtype, tuple(shape), bool(fortran_order))
    return layouts


def _map(path: Path, layout: MemberLayout) -> np.ndarray:
    """Read-only view of one member (a ``np.memmap``; a plain array for empty members)."""
    if int(np.prod(layout.shape, dtype=np.int64)) == 0:
        return np.empty(layout.shape, dtype=layout.dtype)
    return np.memmap(
        path,
        dtype=layout.dtype,
        mode="r",
        offset=layout.offset,
        shape=layout.shape,
        order="F" if layout.fortran_order else "C",
    )


def _decode_info(path: Path, arr: np.ndarray) -> dict[str, Any]:
    """Decode the JSON metadata member (0-d/1-d str, bytes or uint8 array)."""
    if arr.dtype.kind == "U":
        text = str(arr.reshape(-1)[0]) if arr.size == 1 else "".join(arr.reshape(-1).tolist())
    elif arr.dtype.kind == "S":
        text = b"".join(arr.reshape(-1).tolist()).decode("utf-8")
    elif arr.dtype == np.uint8:
        text = np.asarray(arr).tobytes().decode("utf-8")
    else:
        raise DatasetError(
            f"member {INFO_MEMBER!r} has dtype {arr.dtype}; expected a JSON string or uint8 bytes", path=path
        )
    try:
        info = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"member {INFO_MEMBER!r} is not valid JSON: {exc}", path=path) from exc
    if not isinstance(info, dict):
        raise DatasetError(f"member {INFO_MEMBER!r} must hold a JSON object", path=path)
    return info


class ReplayBuffer(Mapping[str, np.ndarray]):
    """Memory-mapped, validated view of a ``dataset.npz`` replay buffer.

    A read-only mapping from data key (``"camera0_rgb"``, ``"robot0_eef_pos"``,
    ...; the ``data__`` prefix removed) to a ``np.memmap`` of shape ``(T, ...)``.
    Opening reads headers only; no array data is loaded.

    Attributes:
        path: the ``.npz`` file.
        episode_ends: ``(E,)`` int64, cumulative exclusive end index of each episode
            (strictly increasing, last == T), loaded into memory.
        metadata: the decoded ``meta__info_json`` document (at least
            ``frequency_hz`` (Hz), ``n_episodes``, ``image_size`` ([W, H] pixels)).

    Raises (from the constructor) :class:`~dpflow_core.errors.DatasetError`,
    naming the file and the member, when the file is missing or not a zip; a
    member is compressed, encrypted or holds objects; a required member is
    missing; a known member has the wrong dtype or per-step shape; members
    disagree on T; ``episode_ends`` is not strictly increasing, starts at 0 or
    does not end at T; or the metadata is missing, not JSON, lacks a required
    field or contradicts the arrays (episode count, image size).
    """

    def __init__(self, path: str | Path, required: tuple[str, ...] | None = None):
        """Open and validate ``path``.

        Args:
            path: the ``dataset.npz`` file.
            required: data keys that must be present (without ``data__``);
                default: every key of :data:`DATA_SPEC`.
        """
        self.path = Path(path)
        layouts = _npy_layouts(self.path)
        required = tuple(DATA_SPEC) if required is None else tuple(required)
        for member in (EPISODE_ENDS_MEMBER, INFO_MEMBER, *(DATA_PREFIX + k for k in required)):
            if member not in layouts:
                raise DatasetError(f"member {member!r} is missing", path=self.path, code="dataset_member_missing")

        ends_layout = layouts[EPISODE_ENDS_MEMBER]
        if ends_layout.dtype.kind not in "iu" or len(ends_layout.shape) != 1:
            raise DatasetError(
                f"member {EPISODE_ENDS_MEMBER!r} must be a 1-d integer array, got {ends_layout.dtype} "
                f"{ends_layout.shape}",
                path=self.path,
            )
        self.episode_ends = np.array(_map(self.path, ends_layout), dtype=np.int64)
        self.metadata = _decode_info(self.path, np.array(_map(self.path, layouts[INFO_MEMBER])))

        self._layouts = {n[len(DATA_PREFIX) :]: lay for n, lay in layouts.items() if n.startswith(DATA_PREFIX)}
        self._arrays: dict[str, np.ndarray] = {}
        self._validate()

    def _validate(self) -> None:
        path = self.path
        for key, layout in self._layouts.items():
            member = DATA_PREFIX + key
            if len(layout.shape) == 0:
                raise DatasetError(f"member {member!r} is 0-d; expected a time axis", path=path)
            if key in DATA_SPEC:
                dtype, tail = DATA_SPEC[key]
                if layout.dtype != dtype:
                    raise DatasetError(f"member {member!r} has dtype {layout.dtype}, expected {dtype}", path=path)
                shape_tail = layout.shape[1:]
                if len(shape_tail) != len(tail) or any(t is not None and t != s for t, s in zip(tail, shape_tail)):
                    want = "(T" + "".join(f", {t if t is not None else '*'}" for t in tail) + ")"
                    raise DatasetError(f"member {member!r} has shape {layout.shape}, expected {want}", path=path)

        lengths = {key: lay.shape[0] for key, lay in self._layouts.items()}
        if not lengths:
            raise DatasetError("no data__ members", path=path)
        n_steps = next(iter(lengths.values()))
        if len(set(lengths.values())) != 1:
            detail = ", ".join(f"{DATA_PREFIX}{k}={v}" for k, v in sorted(lengths.items()))
            raise DatasetError(f"members have inconsistent lengths along time: {detail}", path=path)

        ends = self.episode_ends
        if ends.size == 0:
            raise DatasetError(f"member {EPISODE_ENDS_MEMBER!r} is empty: no episodes", path=path)
        if ends[0] <= 0 or np.any(np.diff(ends) <= 0):
            raise DatasetError(
                f"member {EPISODE_ENDS_MEMBER!r} must be strictly increasing and start above 0 "
                f"(every episode non-empty), got {ends[:8].tolist()}{'...' if ends.size > 8 else ''}",
                path=path,
            )
        if int(ends[-1]) != n_steps:
            raise DatasetError(
                f"member {EPISODE_ENDS_MEMBER!r} ends at {int(ends[-1])} but the data members hold {n_steps} steps",
                path=path,
            )

        info = self.metadata
        for field in REQUIRED_INFO_FIELDS:
            if field not in info:
                raise DatasetError(f"member {INFO_MEMBER!r} lacks the field {field!r}", path=path)
        freq = info["frequency_hz"]
        if not isinstance(freq, (int, float)) or isinstance(freq, bool) or not np.isfinite(freq) or freq <= 0:
            raise DatasetError(f"{INFO_MEMBER}.frequency_hz must be a positive number, got {freq!r}", path=path)
        if info["n_episodes"] != ends.size:
            raise DatasetError(
                f"{INFO_MEMBER}.n_episodes is {info['n_episodes']!r} but {EPISODE_ENDS_MEMBER} lists {ends.size} episodes",
                path=path,
            )
        size = info["image_size"]
        if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) for v in size)):
            raise DatasetError(f"{INFO_MEMBER}.image_size must be [W, H] in pixels, got {size!r}", path=path)
        for key, layout in self._layouts.items():
            if key.endswith("_rgb") and len(layout.shape) == 4 and [layout.shape[2], layout.shape[1]] != list(size):
                raise DatasetError(
                    f"{INFO_MEMBER}.image_size is {list(size)} (W, H) but member {DATA_PREFIX + key!r} holds "
                    f"{layout.shape[2]}x{layout.shape[1]} frames",
                    path=path,
                )

    # Mapping interface -------------------------------------------------------------

    def __getitem__(self, key: str) -> np.ndarray:
        """The ``(T, ...)`` memmap of data key ``key`` (e.g. ``"robot0_eef_pos"``).

        Raises:
            KeyError: when the buffer has no such key.
        """
        if key not in self._layouts:
            raise KeyError(f"{self.path}: no data key {key!r} (has {sorted(self._layouts)})")
        arr = self._arrays.get(key)
        if arr is None:
            arr = self._arrays[key] = _map(self.path, self._layouts[key])
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __getstate__(self) -> dict[str, Any]:
        # Worker processes re-map lazily instead of pickling array views.
        state = self.__dict__.copy()
        state["_arrays"] = {}
        return state

    # Episodes ----------------------------------------------------------------------

    @property
    def n_episodes(self) -> int:
        """Number of episodes E."""
        return int(self.episode_ends.size)

    @property
    def n_steps(self) -> int:
        """Total number of steps T over all episodes."""
        return int(self.episode_ends[-1])

    @property
    def episode_starts(self) -> np.ndarray:
        """``(E,)`` int64 inclusive start index of each episode."""
        return np.concatenate([[0], self.episode_ends[:-1]]).astype(np.int64)

    @property
    def episode_lengths(self) -> np.ndarray:
        """``(E,)`` int64 number of steps of each episode."""
        return np.diff(np.concatenate([[0], self.episode_ends])).astype(np.int64)

    @property
    def frequency_hz(self) -> float:
        """Measured sampling frequency of the buffer (Hz), from the metadata."""
        return float(self.metadata["frequency_hz"])

    def episode_slice(self, episode: int) -> slice:
        """Index range of episode ``episode`` (0-based) along time.

        Raises:
            IndexError: when ``episode`` is outside ``[0, E)``.
        """
        if not 0 <= episode < self.n_episodes:
            raise IndexError(f"episode {episode} outside [0, {self.n_episodes})")
        start = 0 if episode == 0 else int(self.episode_ends[episode - 1])
        return slice(start, int(self.episode_ends[episode]))

    def get_episode(self, episode: int) -> dict[str, np.ndarray]:
        """Memmap views of every data key restricted to one episode."""
        s = self.episode_slice(episode)
        return {key: self[key][s] for key in self}

    def __repr__(self) -> str:
        return f"ReplayBuffer({str(self.path)!r}, n_episodes={self.n_episodes}, n_steps={self.n_steps}, keys={sorted(self)})"
