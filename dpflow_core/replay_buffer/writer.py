"""The replay buffer writer: frames appended as episodes finish, an uncompressed ``dataset.npz`` out.

Layout (members stored, not compressed, ZIP64; formats.md section 2 leaves the member order open):
``data__camera0_rgb.npy`` first, then the other members in the order given, then the central
directory. Everything before the first frame, the member's zip local header and its ``.npy`` v1.0
header, has the same length whatever the frame count T (ZIP64 sizes in the local header; numpy pads
the ``.npy`` header so that the first axis can grow to 21 digits), so :class:`NpzStreamWriter`
writes a placeholder of that length when the file is created, appends the frames of each episode
as soon as they exist, and writes the real headers over the placeholder once T is known. The
zip's CRC-32 of the member comes from the CRC-32 of each appended piece, joined without reading the
frames again (:func:`~dpflow_core.files.crc32_combine`); the SHA-256 (hex) is computed from the
finished file. The file is created exclusively (``x+b``: ``FileExistsError`` when it exists) and
fsynced before :meth:`~NpzStreamWriter.finish` returns. The bytes depend on the members only: every
member carries the fixed time :data:`ZIP_DATE_TIME`.

Every zip structure is :mod:`zipfile`'s: the frames' local header is ``ZipInfo.FileHeader``, and
their central-directory entry is written by the ``ZipFile`` that writes the other members, which
gets the frames' ``ZipInfo`` at the head of its member list before it closes.

Readers: :class:`~dpflow_core.replay_buffer.reader.ReplayBuffer`, ``numpy.load`` and :mod:`zipfile`
(including ``testzip``'s CRC check) read the result. Zip structures: PKWARE APPNOTE 6.3 sections
4.3.7 (local header), 4.5.3 (ZIP64 extra field); ``.npy``: NEP 1.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import hashlib
import io
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Iterable

import numpy as np

from dpflow_core.errors import ConversionError
from dpflow_core.files import crc32_combine

#: The modification time of every member: the zip format's earliest date (MS-DOS epoch), so the
#: same members always give the same bytes; when the file was made is recorded in its sidecar.
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
#: The member written first, whose rows are appended while the dataset is written.
FRAMES_MEMBER = "data__camera0_rgb"

_COPY_CHUNK = 8 << 20
#: copy_file_range(2) errors that mean "not between these files": fall back to read and write.
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` version 1.0 header (magic, length, dict) of a C-order array of ``shape`` and ``dtype``."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": tuple(shape)}
    )
    return buf.getvalue()


@dataclass
class NpzMember:
    """One member of the npz: ``name`` (without ``.npy``), its array ``shape`` and ``dtype``, and its
    payload as in-memory ``data`` or as ``pieces`` of files (path, byte offset, byte count, delete once
    copied) concatenated in order."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    # (file, byte offset, byte count, delete the file once copied) pieces in order, or in-memory bytes
    pieces: list[tuple[str, int, int, bool]] = field(default_factory=list)
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data) if self.data is not None else sum(p[2] for p in self.pieces)


@dataclass(frozen=True)
class _Piece:
    tag: Hashable
    offset: int
    nbytes: int
    crc32: int


def _copy_range(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, count: int, src_path: str) -> None:
    """Copy ``count`` bytes between open files at the given offsets, in the kernel (copy_file_range(2):
    no pass through this process) where the files allow it, else by reads and writes."""
    done = 0
    try:
        while done < count:
            n = os.copy_file_range(src_fd, dst_fd, min(count - done, 1 << 30), src_offset + done, dst_offset + done)
            if n == 0:
                raise ConversionError(f"temporary file ended {count - done} bytes early", src_path)
            done += n
        return
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    while done < count:
        chunk = os.pread(src_fd, min(_COPY_CHUNK, count - done), src_offset + done)
        if not chunk:
            raise ConversionError(f"temporary file ended {count - done} bytes early", src_path)
        os.pwrite(dst_fd, chunk, dst_offset + done)
        done += len(chunk)


def _crc32_range(fd: int, offset: int, count: int, path: str) -> int:
    crc, done = 0, 0
    while done < count:
        chunk = os.pread(fd, min(_COPY_CHUNK, count - done), offset + done)
        if not chunk:
            raise ConversionError(f"temporary file ended {count - done} bytes early", path)
        crc = zlib.crc32(chunk, crc)
        done += len(chunk)
    return crc


class NpzStreamWriter:
    """A new ``dataset.npz`` at ``path`` whose ``data__camera0_rgb`` rows are appended piece by piece.

    Create it (the file appears at once, exclusively: ``FileExistsError`` when ``path`` exists),
    :meth:`append` pieces of frame files in dataset order while the rest is still unknown, then
    :meth:`finish` with the pieces to keep and the other members. Frames are uint8 rows of
    ``frame_shape`` (H, W, 3). Not thread-safe: one thread appends (it may be a helper thread; the
    copies release the GIL).

    Args:
        path: the file to create.
        frame_shape: (H, W, 3) of one frame, pixels.
        sync_every: bytes appended between two ``fdatasync`` calls, so that the disk writes overlap
            the appending instead of all waiting for the final ``fsync``. They run on a thread of
            their own: an append never waits for the disk (a disk slower than the appends only
            skips syncs), and an error of one is raised by :meth:`finish`.
    """

    def __init__(self, path: str | Path, frame_shape: tuple[int, ...], sync_every: int = 64 << 20):
        self.path = Path(path)
        self.frame_shape = tuple(int(v) for v in frame_shape)
        self.row_bytes = int(np.prod(self.frame_shape, dtype=np.int64))
        self._info = zipfile.ZipInfo(FRAMES_MEMBER + ".npy", date_time=ZIP_DATE_TIME)
        self._info.compress_type = zipfile.ZIP_STORED
        self._info.external_attr = 0o644 << 16
        placeholder = self._head(0, 0)
        self.head_bytes = len(placeholder)
        self._f = open(self.path, "x+b")  # read back for the SHA-256 and to cut pieces out
        try:
            self._f.write(placeholder)
            self._f.flush()
        except BaseException:
            self._f.close()
            raise
        self.end = self.head_bytes
        self.pieces: list[_Piece] = []
        self._sync_every, self._unsynced = sync_every, 0
        self._syncer = cf.ThreadPoolExecutor(1, thread_name_prefix="dpflow-npz-sync")
        self._syncs: list[cf.Future] = []

    def _head(self, rows: int, frames_crc32: int) -> bytes:
        """The member's zip local header and ``.npy`` header for ``rows`` frames whose CRC-32 is ``frames_crc32``."""
        npy = npy_header((rows, *self.frame_shape), np.uint8)
        self._info.CRC = crc32_combine(zlib.crc32(npy), frames_crc32, rows * self.row_bytes)
        self._info.file_size = self._info.compress_size = len(npy) + rows * self.row_bytes
        return self._info.FileHeader(zip64=True) + npy

    @property
    def rows(self) -> int:
        """Frames appended so far."""
        return (self.end - self.head_bytes) // self.row_bytes

    def append(self, tag: Hashable, src_path: str | Path, offset: int, nbytes: int, crc32: int | None = None,
               drop: bool = False) -> None:
        """Append ``nbytes`` of frames (whole rows) from ``src_path`` at byte ``offset``.

        Args:
            tag: names the piece for :meth:`finish` (e.g. (episode, segment)).
            crc32: the CRC-32 (:func:`zlib.crc32`) of those bytes when the caller has it (computed
                where the frames were made); None reads them to compute it.
            drop: delete ``src_path`` once copied (a scratch file: its pages are dropped unwritten).

        Raises:
            ValueError: ``nbytes`` is not a whole number of rows.
            ConversionError: ``src_path`` holds fewer bytes.
            OSError: reading or writing failed.
        """
        if nbytes % self.row_bytes:
            raise ValueError(f"{nbytes} bytes is not a whole number of {self.row_bytes}-byte frames")
        src = str(src_path)
        with open(src, "rb") as s:
            if crc32 is None:
                crc32 = _crc32_range(s.fileno(), offset, nbytes, src)
            _copy_range(s.fileno(), self._f.fileno(), offset, self.end, nbytes, src)
        self.pieces.append(_Piece(tag, self.end, nbytes, crc32 & 0xFFFFFFFF))
        self.end += nbytes
        if drop:
            os.unlink(src)
        self._unsynced += nbytes
        if self._unsynced >= self._sync_every and not (self._syncs and not self._syncs[-1].done()):
            self._syncs.append(self._syncer.submit(os.fdatasync, self._f.fileno()))
            self._unsynced = 0

    def finish(self, keep: Iterable[Hashable], members: list[NpzMember], rows: int,
               progress: Callable | None = None) -> tuple[str, int]:
        """Complete the file: the frames of the pieces tagged ``keep`` (in the order appended; pieces
        left out are cut out by moving the later frames down), then ``members`` in order, the
        central directory, the real headers over the placeholder; fsync; SHA-256 of the file.

        Args:
            keep: tags of the pieces to keep, a subsequence of the appended ones.
            members: the other members (not ``data__camera0_rgb``).
            rows: T, the frame count the dataset declares; the kept pieces must hold exactly that.
            progress: called as ``progress("write", bytes, bytes)`` once the file is complete.

        Returns:
            (SHA-256 hex, size in bytes) of the file.

        Raises:
            ValueError: ``keep`` names pieces not appended, or out of order.
            ConversionError: the kept frames are not ``rows`` rows, or the header would change length.
        """
        self._syncer.shutdown(wait=True)
        for fut in self._syncs:
            fut.result()
        keep = list(keep)
        wanted = set(keep)
        kept = [p for p in self.pieces if p.tag in wanted]
        if [p.tag for p in kept] != keep:
            raise ValueError(f"keep must be appended pieces in their order: {keep!r}")
        fd = self._f.fileno()
        at, frames_crc = self.head_bytes, 0
        for p in kept:
            if p.offset != at:
                # Frames of a piece left out: move the later ones down over it. dst < src, so the
                # block-by-block forward copy is safe; overlapping ranges of one file are EINVAL to
                # copy_file_range(2), which makes _copy_range read and write instead.
                _copy_range(fd, fd, p.offset, at, p.nbytes, str(self.path))
            frames_crc = crc32_combine(frames_crc, p.crc32, p.nbytes)
            at += p.nbytes
        n_rows = (at - self.head_bytes) // self.row_bytes
        if n_rows != rows:
            raise ConversionError(f"the frames appended hold {n_rows} rows but the dataset declares {rows}", self.path)
        head = self._head(n_rows, frames_crc)
        if len(head) != self.head_bytes:
            raise ConversionError(f"the frames' headers for T={n_rows} take {len(head)} bytes, not the "
                                  f"{self.head_bytes} reserved", self.path)
        self._f.truncate(at)
        self._f.seek(at)
        self._info.header_offset = 0
        with zipfile.ZipFile(self._f, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for m in members:
                _write_member(zf, m)
            # The frames' entry heads the central directory, as its data heads the file.
            zf.filelist.insert(0, self._info)
            zf.NameToInfo[self._info.filename] = self._info
        self._f.flush()
        os.pwrite(fd, head, 0)
        size = os.fstat(fd).st_size
        with cf.ThreadPoolExecutor(1, thread_name_prefix="dpflow-npz-fsync") as pool:
            synced = pool.submit(os.fsync, fd)
            sha256 = _sha256_fd(fd, size)
            synced.result()
        self._f.close()
        if progress:
            progress("write", size, size)
        return sha256, size

    def close(self) -> None:
        """Close the file (after :meth:`finish`, or to give up: the caller removes it)."""
        self._syncer.shutdown(wait=True)
        self._f.close()


def _sha256_fd(fd: int, size: int) -> str:
    """SHA-256 of the first ``size`` bytes of an open file, read in large blocks (page cache, not mapped:
    mapped pages would count in this process's resident memory)."""
    digest = hashlib.sha256()
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    at = 0
    while at < size:
        n = os.preadv(fd, [view[: min(_COPY_CHUNK, size - at)]], at)
        if n == 0:
            raise ConversionError(f"file ended at {at} of {size} bytes while hashing", f"fd {fd}")
        digest.update(view[:n])
        at += n
    return digest.hexdigest()


def _write_member(zf: zipfile.ZipFile, m: NpzMember) -> None:
    info = zipfile.ZipInfo(m.name + ".npy", date_time=ZIP_DATE_TIME)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    with zf.open(info, mode="w", force_zip64=True) as dst:
        dst.write(npy_header(m.shape, m.dtype))
        if m.data is not None:
            dst.write(m.data)
        for src_path, offset, count, drop in m.pieces:
            with open(src_path, "rb") as src:
                src.seek(offset)
                left = count
                while left:
                    chunk = src.read(min(_COPY_CHUNK, left))
                    if not chunk:
                        raise ConversionError(f"temporary file ended {left} bytes early", src_path)
                    dst.write(chunk)
                    left -= len(chunk)
            if drop:
                os.unlink(src_path)


def write_npz(path: Path, members: list[NpzMember], progress: Callable | None) -> tuple[str, int]:
    """Write members into a new uncompressed zip at ``path`` in one go (:class:`NpzStreamWriter` with
    every frame piece known up front); return (SHA-256 hex, size in bytes).

    ``members`` must hold ``data__camera0_rgb`` as ``pieces`` of uint8 frame files (shape (T, H, W, 3));
    it is written first, the others in the order given.

    Raises:
        FileExistsError: ``path`` exists.
        ValueError: no ``data__camera0_rgb`` member given as pieces.
    """
    frames = [m for m in members if m.name == FRAMES_MEMBER]
    if len(frames) != 1 or frames[0].data is not None or np.dtype(frames[0].dtype) != np.uint8:
        raise ValueError(f"write_npz needs one uint8 {FRAMES_MEMBER} member given as file pieces")
    out = NpzStreamWriter(path, frames[0].shape[1:])
    try:
        for k, (src, offset, count, drop) in enumerate(frames[0].pieces):
            out.append(k, src, offset, count, drop=drop)
        return out.finish(range(len(frames[0].pieces)), [m for m in members if m.name != FRAMES_MEMBER],
                          frames[0].shape[0], progress)
    finally:
        out.close()


def npy_data_offset(path: str) -> int:
    """Byte offset of the array data in a ``.npy`` file (after magic and header, NEP 1 versions 1.0 and 2.0)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()
