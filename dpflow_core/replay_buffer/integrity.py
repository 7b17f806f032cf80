"""Integrity of a dataset archive from its own bytes: every member's CRC-32, with no sidecar needed.

A zip records, for each member, a CRC-32 of its uncompressed bytes twice: in the member's local
header and in the central directory (PKWARE APPNOTE 6.3, sections 4.3.7 and 4.3.12; ZIP64 sizes in
the extra field of 4.5.3). :func:`check_archive` reads the file once, front to back, and from the
same bytes gives its SHA-256 and, per member, the CRC-32 of the stored data, compared with the
recorded one; the local header must also agree with the central directory on the name, method,
flags, time, CRC and sizes. So a flipped byte anywhere in a member (its ``.npy`` header, its data
or its local header) is found and named, whether or not a ``dataset.json`` recorded the file's
SHA-256. What the CRCs do not cover (the central directory's own attributes, bytes outside every
member) only the recorded SHA-256 can catch: :func:`dpflow_core.dataset.check_recorded_sha256`.

Compressed members (a ``.zarr.zip`` or an ``np.savez_compressed`` file) are checked through
:mod:`zipfile`, which inflates them and compares the CRC-32 of the result.
"""

from __future__ import annotations

import hashlib
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"
_ZIP64_EXTRA_ID = 0x0001
_BLOCK = 8 << 20


@dataclass(frozen=True)
class MemberDamage:
    """One member whose bytes disagree with what the archive recorded for it.

    Attributes:
        member: the member's name without ``.npy`` (``data__camera0_rgb``), as the reader names it.
        reason: what disagrees, with both values (e.g. the CRC-32 recorded and the one computed).
    """

    member: str
    reason: str


@dataclass(frozen=True)
class ArchiveCheck:
    """What :func:`check_archive` found.

    Attributes:
        path: the file read.
        size_bytes: its size; sha256: SHA-256 (hex) of all its bytes (None when it could not be read).
        members: the members checked (names without ``.npy``), in central-directory order.
        damaged: members whose CRC-32 or local header disagree with the archive's record.
        error: why the file is no readable zip at all (no central directory, unreadable), else None.
    """

    path: Path
    size_bytes: int
    sha256: str | None
    members: tuple[str, ...] = ()
    damaged: tuple[MemberDamage, ...] = field(default_factory=tuple)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the file is a zip and every member's bytes match their CRC-32 and headers."""
        return self.error is None and not self.damaged

    def describe(self) -> str:
        """One sentence: the members checked, or each damaged member with its reason."""
        if self.error is not None:
            return f"not a readable zip archive: {self.error}"
        if self.damaged:
            parts = "; ".join(f"member {d.member!r}: {d.reason}" for d in self.damaged)
            return f"{len(self.damaged)} of {len(self.members)} members damaged: {parts}"
        return f"CRC-32 of all {len(self.members)} members intact ({self.size_bytes} bytes read)"


def _member_name(info: zipfile.ZipInfo) -> str:
    return info.filename.removesuffix(".npy")


def _local_header_problem(raw: bytes, extra_at: int, f, info: zipfile.ZipInfo) -> tuple[str | None, int]:
    """Why the local header ``raw`` (30 bytes read at ``info.header_offset``) disagrees with the
    central directory's ``info``, or None; and the offset of the member's data."""
    if len(raw) != _LOCAL.size or raw[:4] != _LOCAL_SIGNATURE:
        return f"no local file header signature at byte {info.header_offset}", -1
    (_sig, _version, flags, method, mtime, mdate, crc, csize, usize, name_len, extra_len) = _LOCAL.unpack(raw)
    f.seek(extra_at)
    name_bytes = f.read(name_len)
    extra = f.read(extra_len)
    data_at = extra_at + name_len + extra_len
    central_name = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace")
    if name_bytes != central_name:
        return f"local header names {name_bytes!r}, the central directory {central_name!r}", data_at
    if method != info.compress_type:
        return f"local header says method {method}, the central directory {info.compress_type}", data_at
    if (flags & ~0x8) != (info.flag_bits & ~0x8):
        return f"local header flags {flags:#06x}, the central directory {info.flag_bits:#06x}", data_at
    dos_time = (info.date_time[3] << 11) | (info.date_time[4] << 5) | (info.date_time[5] // 2)
    dos_date = ((info.date_time[0] - 1980) << 9) | (info.date_time[1] << 5) | info.date_time[2]
    if (mtime, mdate) != (dos_time, dos_date):
        return f"local header time {mdate:#06x}/{mtime:#06x}, the central directory {dos_date:#06x}/{dos_time:#06x}", data_at
    if flags & 0x8:
        return None, data_at  # a data descriptor follows the data: the local fields are zero by design
    if crc != info.CRC:
        return f"local header records CRC-32 {crc:08x}, the central directory {info.CRC:08x}", data_at
    if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF:
        usize, csize = _zip64_sizes(extra, usize, csize)
    if (usize, csize) != (info.file_size, info.compress_size):
        return (f"local header records {usize}/{csize} bytes (uncompressed/stored), the central directory "
                f"{info.file_size}/{info.compress_size}"), data_at
    return None, data_at


def _zip64_sizes(extra: bytes, usize: int, csize: int) -> tuple[int, int]:
    """The sizes of a local header's ZIP64 extra field (APPNOTE 4.5.3): uncompressed, then compressed,
    each present only when its 32-bit field is 0xFFFFFFFF."""
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + n]
        if tag == _ZIP64_EXTRA_ID:
            k = 0
            if usize == 0xFFFFFFFF and k + 8 <= len(body):
                (usize,), k = struct.unpack_from("<Q", body, k), k + 8
            if csize == 0xFFFFFFFF and k + 8 <= len(body):
                (csize,) = struct.unpack_from("<Q", body, k)
            break
        at += 4 + n
    return usize, csize


def check_archive(path: str | Path) -> ArchiveCheck:
    """Check every member of a zip archive (``dataset.npz``, a ``.zarr.zip``) against its own CRC-32.

    Method: the central directory is read with :mod:`zipfile`; each member's local header is
    compared with its central-directory entry (:class:`ArchiveCheck` lists what must agree); then
    the file is read once, in 8 MiB blocks, feeding the SHA-256 of the whole file and the CRC-32
    (:func:`zlib.crc32`) of each stored member's data range, compared with the recorded CRC-32.
    Compressed members are inflated by :mod:`zipfile`, which checks their CRC-32 itself.
    Cost: one sequential read of the file (about the time of :func:`~dpflow_core.files.sha256_file`).

    Returns:
        The check; never raises for a damaged or non-zip file (``error`` / ``damaged`` say why).

    Raises:
        OSError: the file cannot be opened or read (the error names the path).
    """
    path = Path(path)
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        from dpflow_core.files import sha256_file

        return ArchiveCheck(path, size, sha256_file(path), error=str(exc) or type(exc).__name__)
    damaged: dict[int, str] = {}
    ranges: list[tuple[int, int, zipfile.ZipInfo]] = []
    inflated: list[zipfile.ZipInfo] = []
    with open(path, "rb") as f:
        for info in infos:
            f.seek(info.header_offset)
            raw = f.read(_LOCAL.size)
            problem, data_at = _local_header_problem(raw, info.header_offset + _LOCAL.size, f, info)
            if problem is not None:
                damaged[id(info)] = problem
            elif data_at + info.compress_size > size:
                damaged[id(info)] = f"data runs to byte {data_at + info.compress_size}, past the end of the file ({size})"
            elif info.compress_type == zipfile.ZIP_STORED:
                ranges.append((data_at, data_at + info.compress_size, info))
            else:
                inflated.append(info)
        crcs = {id(info): 0 for _a, _b, info in ranges}
        digest = hashlib.sha256()
        f.seek(0)
        at = 0
        ranges.sort(key=lambda r: r[0])
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            view = memoryview(block)
            digest.update(view)
            end = at + len(block)
            for a, b, info in ranges:
                if b <= at or a >= end:
                    continue
                crcs[id(info)] = zlib.crc32(view[max(a, at) - at : min(b, end) - at], crcs[id(info)])
            at = end
    for _a, _b, info in ranges:
        if crcs[id(info)] != info.CRC:
            damaged[id(info)] = (f"CRC-32 of its {info.compress_size} bytes is {crcs[id(info)]:08x}, "
                                      f"the archive records {info.CRC:08x}")
    if inflated:
        with zipfile.ZipFile(path) as zf:
            for info in inflated:
                try:
                    with zf.open(info) as src:
                        while src.read(_BLOCK):
                            pass
                except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                    damaged[id(info)] = str(exc)
    return ArchiveCheck(
        path, size, digest.hexdigest(), tuple(_member_name(i) for i in infos),
        tuple(MemberDamage(_member_name(i), damaged[id(i)]) for i in infos if id(i) in damaged),
    )
