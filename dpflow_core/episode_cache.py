"""The per-episode conversion cache: an episode's aligned, resized arrays kept by content address.

Takes an alignment job (the ``_vio.mcap`` SHA-256 from the pairing manifest, its stem and every
option that changes the aligned arrays) and gives the cache entry of that episode: the ``.npy``
files a worker wrote (frames, timestamps, low-dimensional members) and the worker's summary
(``result.json``). Adding one episode to a converted task re-aligns only that episode; a changed
option or input gives other keys, so everything is aligned anew. The CLI (``dpflow convert``,
``dpflow cache``) and the ``dataset_npz`` asset use the same folder (:func:`default_cache_dir`).

Layout: ``<root>/<key[:2]>/<key>/`` holding ``result.json`` (paths relative to the entry; its
modification time is the entry's last use), ``input.json`` (the input file's size, mtime and
inode when its SHA-256 was checked) and the arrays. Entries appear by an atomic rename of a
finished ``<root>/.tmp-*`` folder, so a reader sees a whole entry or none. A hit also requires
the input file's size, mtime and inode to be those recorded: a file rewritten in place (even
with its old size) is aligned anew, reading and hashing it again. Pruning removes the least
recently used entries until the total is under the size limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dpflow_core.errors import ConversionError
from dpflow_core.files import install_dir, remove_stale_temporaries, temp_name

#: Size limit when none is given (``DPFLOW_CACHE_MAX_BYTES`` or ``--cache-max-size`` override it).
DEFAULT_MAX_BYTES = 20 << 30
#: The job fields that change an episode's aligned arrays (``frequency_tolerance`` is applied
#: across episodes afterwards, so it is not part of an episode's key).
_KEY_FIELDS = ("stem", "sha256", "size_bytes", "image_size", "topics", "invalid_pose_policy", "min_overlap_fraction",
               "max_gap_s", "gap_policy", "min_segment_frames", "min_pose_score", "content_checks")


def default_cache_dir() -> Path:
    """``$DPFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/dpflow/episodes``, else ``~/.cache/dpflow/episodes``:
    one folder per user, whatever the work folder, so the CLI and the Dagster asset share it."""
    env = os.environ.get("DPFLOW_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dpflow" / "episodes"


def default_max_bytes() -> int:
    """``$DPFLOW_CACHE_MAX_BYTES`` (bytes, or a size such as ``20G``), else :data:`DEFAULT_MAX_BYTES`.

    Raises:
        ConversionError: the variable is not a size (``bad_option``).
    """
    env = os.environ.get("DPFLOW_CACHE_MAX_BYTES")
    return parse_size(env, "DPFLOW_CACHE_MAX_BYTES") if env else DEFAULT_MAX_BYTES


def parse_size(text: str, what: str = "size") -> int:
    """Bytes from ``"123"``, ``"500M"``, ``"20G"``, ``"1T"`` (binary units, K = 1024).

    Raises:
        ConversionError: not a non-negative size (``bad_option``), naming ``what``.
    """
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in units and t[-1:] else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ConversionError(f"{what} must be a size in bytes such as 500M or 20G, got {text!r}", code="bad_option")
    return int(value * units[unit])


def episode_key(job: dict) -> str | None:
    """Content address (64 hex digits) of one alignment job (``alignment_job`` of
    :mod:`dpflow_core.conversion.jobs`): SHA-256 of its ``converter_version`` and
    :data:`_KEY_FIELDS` (the input's SHA-256 and size from the manifest, stem, image size, topics
    and alignment options); None when the manifest records no SHA-256 (nothing to address by)."""
    if not job.get("sha256"):
        return None
    topics = job["topics"]
    doc = {k: job.get(k) for k in _KEY_FIELDS}
    doc["topics"] = {"camera": topics.camera, "pose": topics.pose, "gripper": topics.gripper}
    doc["image_size"] = None if job["image_size"] is None else list(job["image_size"])
    doc["converter_version"] = job["converter_version"]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _file_id(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "dev": st.st_dev}


def _map_paths(result: dict, fn) -> dict:
    """``result`` with every file path of its parts passed through ``fn``."""
    parts = []
    for part in result["parts"]:
        parts.append({**part, "rgb_path": fn(part["rgb_path"]), "files": {k: fn(v) for k, v in part["files"].items()}})
    return {**result, "parts": parts}


@dataclass
class CacheEntry:
    """One cached episode: its ``key``, folder ``path``, size in bytes and last use (Unix time, s)."""

    key: str
    path: Path
    size_bytes: int
    last_used: float


class EpisodeCache:
    """The per-episode conversion cache in folder ``root`` (created on first write), limited to
    ``max_bytes`` by :meth:`prune`. See the module docstring for the layout and the rules of a hit.
    """

    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        if self.max_bytes < 0:
            raise ConversionError(f"cache size limit must be >= 0 bytes, got {self.max_bytes}", code="bad_option")

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def lookup(self, job: dict) -> dict | None:
        """The cached worker summary of ``job`` (absolute paths, ``cached`` True, the report's
        ``path`` set to this job's input), or None when there is no valid entry."""
        key = episode_key(job)
        if key is None:
            return None
        entry = self.entry_dir(key)
        try:
            recorded = json.loads((entry / "input.json").read_text())
            result = json.loads((entry / "result.json").read_text())
            if recorded != _file_id(Path(job["vio_mcap"])):
                return None
            os.utime(entry / "result.json")  # last use, for pruning
        except (OSError, ValueError):
            return None
        result = _map_paths(result, lambda p: str(entry / p))
        if not all(Path(p).is_file() for part in result["parts"] for p in (part["rgb_path"], *part["files"].values())):
            return None
        path = str(job["vio_mcap"])
        result["report"] = {**result["report"], "path": path}
        result["parts"] = [{**part, "report": {**part["report"], "path": path}} for part in result["parts"]]
        return {**result, "cached": True, "seconds": 0.0, "peak_rss_mb": 0.0}

    def new_dir(self) -> Path:
        """A new, empty scratch folder inside the cache for a worker to write one episode into."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / temp_name("")
        path.mkdir()
        return path

    def store(self, job: dict, result: dict, scratch: Path) -> dict:
        """Make the worker's folder ``scratch`` (holding ``result``'s files) the entry of ``job``.

        Returns ``result`` with its paths inside the entry. When another conversion stored the
        same key first, its entry is used and ``scratch`` removed. A job without a key, or a
        rejected episode, is not stored (``result`` is returned as it is).
        """
        key = episode_key(job)
        if key is None or not result.get("ok"):
            return result
        base = str(scratch) + os.sep
        relative = _map_paths(result, lambda p: p.removeprefix(base))
        summary = {k: v for k, v in relative.items() if k not in ("seconds", "peak_rss_mb", "cached")}
        (scratch / "result.json").write_text(json.dumps(summary))
        (scratch / "input.json").write_text(json.dumps(_file_id(Path(job["vio_mcap"]))))
        final = self.entry_dir(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        # not fsynced: the worker would otherwise wait for the episode's frames to reach the disk; the rename
        # keeps every reader from seeing a half-written entry (a power cut before write-back is not covered)
        if not install_dir(scratch, final, durable=False):
            if not (final / "result.json").is_file():
                raise OSError(f"{final}: a cache entry folder without its result.json is in the way")
            shutil.rmtree(scratch, ignore_errors=True)  # another conversion stored the same key first
        return _map_paths(relative, lambda p: str(final / p))

    def entries(self) -> list[CacheEntry]:
        """Every complete entry, least recently used first."""
        out = []
        if not self.root.is_dir():
            return out
        for shard in self.root.iterdir():
            if shard.name.startswith(".") or not shard.is_dir():
                continue
            for entry in shard.iterdir():
                try:
                    used = (entry / "result.json").stat().st_mtime
                except OSError:
                    continue
                size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                out.append(CacheEntry(entry.name, entry, size, used))
        return sorted(out, key=lambda e: (e.last_used, e.key))

    def prune(self, max_bytes: int | None = None) -> list[CacheEntry]:
        """Remove least recently used entries until the total is at most ``max_bytes`` (default:
        this cache's limit; 0 empties it), and the scratch folders of conversions that no longer
        run (named ``.tmp-<pid>-s<start>-*`` by :meth:`new_dir`; left by a killed conversion; a PID
        reused by another process is told apart by its start time). Returns the entries removed."""
        limit = self.max_bytes if max_bytes is None else int(max_bytes)
        entries = self.entries()
        total = sum(e.size_bytes for e in entries)
        removed = []
        for e in entries:
            if total <= limit:
                break
            shutil.rmtree(e.path, ignore_errors=True)
            total -= e.size_bytes
            removed.append(e)
        if self.root.is_dir():
            remove_stale_temporaries(self.root)
        return removed


def resolve_cache(cache) -> EpisodeCache | None:
    """The cache a ``convert(cache=...)`` argument names: True the default one, a folder or an
    :class:`EpisodeCache` that one, False or None none.

    Raises:
        ConversionError: any other value (``bad_option``).
    """
    if cache is None or cache is False:
        return None
    if cache is True:
        return EpisodeCache()
    if isinstance(cache, EpisodeCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return EpisodeCache(cache)
    raise ConversionError(f"cache must be True, False, a folder or an EpisodeCache, got {cache!r}", code="bad_option")
