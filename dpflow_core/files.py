"""Small file helpers shared by every stage: the work folder, content hashes and atomic output.

Every file the core writes goes through :func:`atomic_path` (or :func:`atomic_output` and
:func:`write_text_atomic` on top of it): the bytes go to a temporary name in the destination's
own folder, the file and then the folder are fsynced, and a rename puts it in place, so a reader
sees either the old file or the complete new one, never a part. An output that is a folder of
files is written to a temporary sibling folder and put in place by :func:`install_dir`. The
content hash of a file is :func:`sha256_file`; :func:`crc32_combine` joins the zip CRC-32s of two
byte strings without reading them.

Temporary names follow one scheme, :func:`temp_name`: ``.<name>.<kind>-<pid>-s<start>[-<random>][<suffix>]``
(``kind`` ``tmp``, ``partial`` or ``work``), where ``<start>`` is the owning process's start time
(:func:`process_start_time`), so a later run can tell a killed run's leftover from a live run's file even when
the PID was reused: :func:`stale_temporaries` lists them, :func:`remove_stale_temporaries` removes them (every
stage that writes into a folder calls it first; ``dpflow clean`` on demand).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator


def default_workdir() -> Path:
    """The work folder (manifests, datasets, reports, checkpoints): ``$DPFLOW_WORKDIR``, else ``<cwd>/outputs``."""
    env = os.environ.get("DPFLOW_WORKDIR")
    return Path(env) if env else Path.cwd() / "outputs"


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 (64 lowercase hex digits) of a local file, read in ``chunk_bytes`` blocks (hashlib).

    Raises:
        OSError: when the file cannot be read.
    """
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk_bytes), b""):
            digest.update(block)
    return digest.hexdigest()


class _HashingRaw(io.RawIOBase):
    """Raw stream over a file descriptor that feeds every byte it reads to SHA-256."""

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self.digest = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._fh.readinto(buffer)
        if n:
            self.digest.update(memoryview(buffer)[:n])
            self.bytes_read += n
        return n

    def tell(self) -> int:
        return self.bytes_read


class HashingReader(io.BufferedReader):
    """A buffered binary reader that computes the SHA-256 of a file while a parser reads it,
    so a file that is both parsed and hashed is read once.

    Every byte leaves the file exactly once, through the hash; :meth:`sha256` reads what the
    parser left unread (up to the end of the file) and returns the digest of the whole file,
    equal to :func:`sha256_file`. Use it as a context manager (it closes the file).
    Only sequential reads are supported (seeking would skip or repeat bytes of the hash).

    Raises:
        OSError: when the file cannot be opened or read.
    """

    def __init__(self, path: str | Path, buffer_size: int = 1 << 20):
        self._raw = _HashingRaw(open(path, "rb", buffering=0))
        super().__init__(self._raw, buffer_size=buffer_size)

    def seekable(self) -> bool:
        return False

    def sha256(self) -> str:
        """Read the rest of the file and return the SHA-256 (hex) of all its bytes."""
        while self.read(1 << 20):
            pass
        return self._raw.digest.hexdigest()

    @property
    def bytes_read(self) -> int:
        """Bytes taken from the file so far (what the hash has seen)."""
        return self._raw.bytes_read

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw._fh.close()


def fsync_dir(folder: str | Path) -> None:
    """fsync a directory so a rename inside it survives a crash; silently a no-op where unsupported."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path_for(path: str | Path, suffix: str = "") -> Path:
    """A new, unused temporary name beside ``path``: ``.<name>.tmp-<pid>-s<start>-<random><suffix>`` (created empty;
    :func:`temp_name`).

    The leading dot hides it from globbing readers; ``suffix`` keeps an extension a writer needs
    (``".png"`` for matplotlib, ``".npz"``). Created with ``O_EXCL`` and mode 0666 less the umask,
    the permissions a plain ``open(path, "w")`` would give.

    Raises:
        FileNotFoundError: the folder of ``path`` does not exist.
    """
    path = Path(path)
    while True:
        tmp = path.with_name(temp_name(path.name, suffix=suffix))
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


#: The kinds of temporary a stage writes: a file on its way to its name (``tmp``), a conversion's growing
#: output (``partial``) and its scratch folder (``work``).
TEMP_KINDS = ("tmp", "partial", "work")
# ".<target>.<kind>-<pid>[-s<start>][-<hex>][.ext...]"; names without "-s<start>" are those written before
# start times were recorded (only a dead PID makes them stale).
_TEMP_RE = re.compile(r"^\.(?:(?P<target>.+)\.)?(?P<kind>tmp|partial|work)-(?P<pid>\d+)(?:-s(?P<start>\d+))?"
                      r"(?:-[0-9a-f]+)?(?:\.[A-Za-z0-9]+)*$")
_START_TIMES: dict[int, int | None] = {}


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot (field 22, ``starttime``, of ``/proc/<pid>/stat``,
    proc(5)); None when it cannot be read (no such process, or no ``/proc``). Two processes that share a PID at
    different times have different start times, which is how a reused PID is told from the original."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after the last one.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19])  # fields[0] is field 3
    except (IndexError, ValueError):
        return None


def _own_start_time() -> int | None:
    pid = os.getpid()  # per PID: a forked worker has its own
    if pid not in _START_TIMES:
        _START_TIMES[pid] = process_start_time(pid)
    return _START_TIMES[pid]


def temp_name(name: str, kind: str = "tmp", *, unique: bool = True, suffix: str = "") -> str:
    """The temporary name of this process for the output ``name``: ``.<name>.<kind>-<pid>-s<start>-<random><suffix>``.

    ``<start>`` is this process's :func:`process_start_time` (left out where there is no ``/proc``);
    ``unique=False`` leaves out ``-<random>`` (one such name per output and process: a conversion's
    ``partial`` and ``work``). ``name`` "" gives ``.<kind>-<pid>-...`` (a folder's own scratch entries).

    Raises:
        ValueError: ``kind`` is not one of :data:`TEMP_KINDS`.
    """
    if kind not in TEMP_KINDS:
        raise ValueError(f"temporary kind must be one of {TEMP_KINDS}, got {kind!r}")
    start = _own_start_time()
    owner = f"{os.getpid()}" + (f"-s{start}" if start is not None else "")
    rand = f"-{secrets.token_hex(4)}" if unique else ""
    return f".{name + '.' if name else ''}{kind}-{owner}{rand}{suffix}"


@dataclass(frozen=True)
class Temporary:
    """A file or folder named by :func:`temp_name` (or the older ``-<pid>`` form without a start time).

    Attributes:
        path: where it is.
        target: the output it was becoming (``""`` for a folder's own scratch entries).
        kind: one of :data:`TEMP_KINDS`.
        pid: the process that made it.
        start_time: that process's start time (clock ticks after boot), None when the name records none.
    """

    path: Path
    target: str
    kind: str
    pid: int
    start_time: int | None

    @property
    def owner_running(self) -> bool:
        """Whether the process that made it still runs: its PID is alive and, when the name records a start
        time and the PID's own can be read, they are equal (else the PID was reused by another process)."""
        if not pid_alive(self.pid):
            return False
        if self.start_time is None:
            return True
        now = process_start_time(self.pid)
        return now is None or now == self.start_time


def parse_temp_name(path: str | Path) -> Temporary | None:
    """The :class:`Temporary` a path names, or None when its name is not a temporary's."""
    path = Path(path)
    m = _TEMP_RE.match(path.name)
    if m is None:
        return None
    start = m.group("start")
    return Temporary(path, m.group("target") or "", m.group("kind"), int(m.group("pid")),
                     None if start is None else int(start))


def stale_temporaries(folder: str | Path, *, recursive: bool = False) -> list[Temporary]:
    """The temporaries in ``folder`` (and, ``recursive``, its sub-folders; symbolic links are not followed)
    whose process no longer runs (:attr:`Temporary.owner_running`), sorted by path. A live run's are never
    listed; nor is anything inside a temporary folder. A folder that cannot be listed gives none."""
    found = []
    for top, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            t = parse_temp_name(Path(top, name))
            if t is not None and not t.owner_running:
                found.append(t)
        dirs[:] = [] if not recursive else sorted(d for d in dirs if parse_temp_name(d) is None)
    return sorted(found, key=lambda t: str(t.path))


def remove_stale_temporaries(folder: str | Path, *, recursive: bool = False, dry_run: bool = False) -> list[Temporary]:
    """Remove :func:`stale_temporaries` of ``folder`` (files unlinked, folders removed with their contents);
    each removal is logged (warning, logger ``dpflow.files``) with its owner's PID. ``dry_run`` removes
    nothing. Returns what was (or would be) removed; one that vanished meanwhile or cannot be removed is
    logged and left out.
    """
    log = logging.getLogger("dpflow.files")
    removed = []
    for t in stale_temporaries(folder, recursive=recursive):
        if not dry_run:
            try:
                if t.path.is_dir() and not t.path.is_symlink():
                    shutil.rmtree(t.path)
                else:
                    t.path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("cannot remove stale %s: %s", t.path, exc.strerror or exc)
                continue
            log.warning("removed %s: left by process %s, which is no longer running", t.path, t.pid)
        removed.append(t)
    return removed


@contextlib.contextmanager
def os_errors_named(path: str | Path, doing: str) -> Iterator[None]:
    """Turn an ``OSError`` (with an errno: disk full, permission denied, read-only file system, ...) raised inside
    the block into :class:`dpflow_core.errors.StorageError` naming ``path`` and what was being done
    (:func:`dpflow_core.errors.storage_error`); the block's own clean-up has run by then. dpflow's own errors,
    and an ``OSError`` with no errno (a timeout), pass unchanged."""
    from dpflow_core.errors import storage_error

    try:
        yield
    except OSError as exc:
        if exc.errno is None:
            raise
        raise storage_error(exc, path, doing) from exc


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, overwrite: bool = True, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success put what was written there at ``path``.

    On leaving the block normally: the temporary file is fsynced, renamed to ``path``
    (``os.replace``; with ``overwrite=False`` a hard link, which fails when ``path`` exists,
    then the temporary name is removed) and the folder is fsynced. On an exception inside the
    block the temporary file is removed and ``path`` is left as it was.

    Args:
        path: the final file. Its folder must exist.
        overwrite: replace an existing ``path``; when false an existing file is an error.
        suffix: extension kept on the temporary name (see :func:`temp_path_for`).

    Raises:
        FileExistsError: ``overwrite`` is false and ``path`` exists (checked before the block
            runs and again, race-free, at the link).
        FileNotFoundError: the folder of ``path`` does not exist.
    """
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path}: exists and overwrite is false")
    tmp = temp_path_for(path, suffix)
    try:
        yield tmp
        _fsync_file(tmp)
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            tmp.unlink()
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "wb", *, overwrite: bool = True, suffix: str = "",
                  encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing (``mode`` ``"wb"`` or ``"w"``); install it on success.

    The same guarantees as :func:`atomic_path`: on an exception inside the block nothing is
    installed and no temporary file remains. Text mode defaults to UTF-8.

    Raises:
        ValueError: ``mode`` is not a write mode (``"w"``, ``"wb"``).
        FileExistsError, FileNotFoundError: as :func:`atomic_path`.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output mode must be 'w' or 'wb', got {mode!r}")
    if "b" not in mode and encoding is None:
        encoding = "utf-8"
    with atomic_path(path, overwrite=overwrite, suffix=suffix) as tmp:
        with open(tmp, mode, encoding=encoding) as fh:
            yield fh
            fh.flush()


def install_dir(tmp: str | Path, final: str | Path, *, durable: bool = True) -> bool:
    """Put the folder ``tmp``, written completely, in place as ``final``; never replace an existing ``final``.

    The folder counterpart of :func:`atomic_path`, for outputs that are several files (a downloaded
    checkpoint with its config and log, a LeRobot dataset, a conversion cache entry): every file
    under ``tmp`` and every folder is fsynced, ``tmp`` is renamed to ``final`` (same file system;
    ``tmp`` must be a sibling of ``final``) and the parent is fsynced, so a reader sees no folder
    or the complete one.

    ``durable=False`` skips the fsyncs (the rename stays atomic): for a cache whose entries are
    made again when missing, where waiting for the disk would cost every conversion its frames'
    write-back time.

    Returns:
        True when ``tmp`` became ``final``; False when ``final`` existed already (an empty or
        complete folder another writer put there): ``tmp`` is then left to the caller.

    Raises:
        OSError: the rename failed for another reason (``tmp`` left as it was).
    """
    tmp, final = Path(tmp), Path(final)
    for folder, _dirs, files in os.walk(tmp) if durable else ():
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):
                _fsync_file(Path(folder, name))
        fsync_dir(folder)
    if final.exists():
        return False
    try:
        os.rename(tmp, final)  # refuses a non-empty final (ENOTEMPTY/EEXIST): another writer was first
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    if durable:
        fsync_dir(final.parent)
    return True


def write_text_atomic(path: str | Path, text: str, *, overwrite: bool = True) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_output`; return ``path``."""
    with atomic_output(path, "w", overwrite=overwrite) as fh:
        fh.write(text)
    return Path(path)


def display_name(text: str | Path) -> str:
    """``text`` (a file name or path) as it can be printed and written as UTF-8.

    A name whose bytes are not valid UTF-8 reaches Python with each bad byte as a lone surrogate
    (PEP 383, ``surrogateescape``), which no UTF-8 writer accepts; those bytes are shown as ``\\xNN``
    (``b"ep\\xff3"`` -> ``ep\\xff3``). Any other lone surrogate (from JSON) as ``\\udNNN``. Valid
    text is returned unchanged.
    """
    text = str(text)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def path_kind(path: str | Path) -> str:
    """What a path that is not a regular file is, for messages: "a directory", "a FIFO (named
    pipe)", "a socket", "a character device", "a block device", "not a regular file", or
    "not readable (<OS error>)" when it cannot be stat'ed."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"not readable ({exc.strerror})"
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (signal 0; a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------- CRC-32 arithmetic

#: The CRC-32 polynomial of zip and zlib, bit-reflected (x^0 is the top bit of a 32-bit word).
_CRC32_POLY = 0xEDB88320


def _gf2_mul(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC-32 polynomial, both as reflected 32-bit words."""
    product = 0
    for bit in range(31, -1, -1):  # bit 31 of ``a`` is x^0, bit 30 is x^1, ...
        if a >> bit & 1:
            product ^= b
        b = (b >> 1) ^ _CRC32_POLY if b & 1 else b >> 1  # b(x) * x
    return product


#: ``_X_POW2[k]`` is x^(2^k) modulo the polynomial (x^1 is 1 << 30), for k < 67 (lengths below 2^64 bytes).
_X_POW2 = [1 << 30]
for _ in range(66):
    _X_POW2.append(_gf2_mul(_X_POW2[-1], _X_POW2[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 (zip's, as :func:`zlib.crc32`) of ``A + B`` from ``crc1`` = CRC of ``A``, ``crc2`` = CRC
    of ``B`` and ``len2`` = ``len(B)`` in bytes (0 up to 2^64 - 1), without reading either.

    The CRC of ``A + B`` is ``crc1`` multiplied by x^(8 * len2) modulo the polynomial, plus ``crc2``
    (arithmetic over GF(2)): the method of zlib's ``crc32_combine`` (zlib 1.2.12 and later,
    ``crc32.c``: ``multmodp`` and ``x2nmodp``), which Python's :mod:`zlib` does not expose. Since
    that is linear in both CRCs, ``crc32_combine(crc_of(P), crc_of(P + B), len(B))`` is the CRC
    of ``B`` alone: a slice's CRC from two prefix CRCs.

    Raises:
        ValueError: ``len2`` is negative or not below 2^64.
    """
    if not 0 <= len2 < 1 << 64:
        raise ValueError(f"len2 must be 0..2^64-1 bytes, got {len2}")
    shift = 1 << 31  # x^0
    nbits, k = len2, 3  # x^(8 * len2): the product of x^(2^(j + 3)) over the set bits j of len2
    while nbits:
        if nbits & 1:
            shift = _gf2_mul(_X_POW2[k], shift)
        nbits >>= 1
        k += 1
    return _gf2_mul(shift, crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)
