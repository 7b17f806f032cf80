"""The replay buffer writer: arrays in, an uncompressed ``dataset.npz`` out, hashed while it is written.

Takes :class:`NpzMember` entries (in-memory bytes, or pieces of temporary ``.npy`` files copied in
order, so memory stays bounded); gives a new zip (members stored, not compressed, ZIP64) holding
one ``<name>.npy`` per member, in the layout :class:`~dpflow_core.replay_buffer.reader.ReplayBuffer`
maps (formats.md section 2), and its SHA-256 (hex) and size (bytes). The file is created
exclusively (``xb``) and fsynced before this returns. The bytes depend on the members only: every
member carries the fixed time :data:`ZIP_DATE_TIME`.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dpflow_core.errors import ConversionError

#: The modification time of every member: the zip format's earliest date (MS-DOS epoch), so the
#: same members always give the same bytes; when the file was made is recorded in its sidecar.
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


_COPY_CHUNK = 8 << 20
#: Chunks (of up to ``_COPY_CHUNK`` bytes) that may wait for the SHA-256 thread: bounds the memory it holds.
_HASH_QUEUE = 2


class _HashingWriter:
    """Write-only stream that feeds every byte to SHA-256 on its way to the file.

    It cannot seek, so :mod:`zipfile` writes each member's sizes and CRC in a
    data descriptor after the data instead of seeking back into bytes that were
    already hashed. SHA-256 runs on a helper thread, in write order, while the
    calling thread computes the zip's CRC-32 and copies the next bytes (hashlib,
    zlib and file writes release the GIL on large buffers, so the two overlap on
    two cores); at most ``_HASH_QUEUE`` chunks wait for it. Every ``sync_every``
    bytes another thread runs ``fdatasync`` so that the disk writes overlap
    hashing instead of all waiting for the final ``fsync``.
    """

    def __init__(self, raw, sync_every: int = 64 << 20):
        self.raw = raw
        self._sha256 = hashlib.sha256()
        self.pos = 0
        self._sync_every = sync_every
        self._synced_at = 0
        self._sync_thread: threading.Thread | None = None
        self._hash_queue: queue.Queue = queue.Queue(maxsize=_HASH_QUEUE)
        self._hash_thread = threading.Thread(target=self._hash_worker, name="dpflow-npz-sha256", daemon=True)
        self._hash_thread.start()

    def _hash_worker(self) -> None:
        while (chunk := self._hash_queue.get()) is not None:
            self._sha256.update(chunk)

    def write(self, data) -> int:
        # Held until hashed: an immutable copy unless the caller's buffer already is one.
        chunk = data if isinstance(data, bytes) else bytes(data)
        self._hash_queue.put(chunk)
        self.raw.write(chunk)
        self.pos += len(chunk)
        if self.pos - self._synced_at >= self._sync_every and not (self._sync_thread and self._sync_thread.is_alive()):
            self._synced_at = self.pos
            self.raw.flush()
            self._sync_thread = threading.Thread(target=os.fdatasync, args=(self.raw.fileno(),), daemon=True)
            self._sync_thread.start()
        return len(chunk)

    def hexdigest(self) -> str:
        """SHA-256 (hex) of everything written; no write may follow."""
        self._finish_hashing()
        return self._sha256.hexdigest()

    def _finish_hashing(self) -> None:
        if self._hash_thread.is_alive():
            self._hash_queue.put(None)
            self._hash_thread.join()

    def join(self) -> None:
        """Wait for the hashing and a background ``fdatasync`` still running."""
        self._finish_hashing()
        if self._sync_thread is not None:
            self._sync_thread.join()

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        self.raw.flush()


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


def write_npz(path: Path, members: list[NpzMember], progress: Callable | None) -> tuple[str, int]:
    """Stream members into a new uncompressed zip at ``path``; return (sha256 hex, size in bytes).

    Raises:
        FileExistsError: ``path`` exists.
    """
    total = sum(m.nbytes for m in members)
    with open(path, "xb") as f:
        out = _HashingWriter(f)
        try:
            _write_members(out, members, progress, total)
        finally:
            out.join()
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    if size != out.pos:
        raise ConversionError(f"wrote {out.pos} bytes but the file holds {size}", path)
    return out.hexdigest(), size


def _write_members(out: _HashingWriter, members: list[NpzMember], progress: Callable | None, total: int) -> None:
    written = 0
    with zipfile.ZipFile(out, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for m in members:
            info = zipfile.ZipInfo(m.name + ".npy", date_time=ZIP_DATE_TIME)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            with zf.open(info, mode="w", force_zip64=True) as dst:
                dst.write(npy_header(m.shape, m.dtype))
                if m.data is not None:
                    dst.write(m.data)
                    written += len(m.data)
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
                            written += len(chunk)
                            if progress:
                                progress("write", written, total)
                    if drop:
                        # Deleting a copied scratch file drops its dirty pages before they reach the disk.
                        os.unlink(src_path)


def npy_data_offset(path: str) -> int:
    """Byte offset of the array data in a ``.npy`` file (after magic and header, NEP 1 versions 1.0 and 2.0)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()
