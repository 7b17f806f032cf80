"""Upload of ``dataset.npz`` to the GPU server, resumable and verified by SHA-256.

The remote path is content-addressed::

    <data_root>/<task>/<sha256[:16]>/dataset.npz

so uploading the same file again is a no-op, and a different dataset never
overwrites one that another run uses. Bytes go to ``dataset.npz.partial``
first; only after the SHA-256 computed on the server (``sha256sum``, or
Python's hashlib where it is absent) equals the local one is it renamed to
its final name. A mismatch keeps the file under
``dataset.npz.quarantine-<UTC time>-<remote sha256[:12]>`` for inspection; it
never gets the final name, so nothing trains on it.

Transfer: rsync with ``--append-verify`` (resume of an interrupted transfer,
whole-file checksum afterwards) when both ends have rsync, over the same SSH
settings as the Fabric connection (``-e "ssh -p PORT -i KEY -o
UserKnownHostsFile=... -o StrictHostKeyChecking=yes -o BatchMode=yes"``);
otherwise a stream over SFTP (or a local file copy for the local transport)
that resumes by size. Resume by size trusts the bytes already there; the
SHA-256 check is what catches a bad prefix.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Literal

from dpflow_core.errors import DatasetError, InvalidNameError, RemoteError
from dpflow_core.names import validate_name
from dpflow_core.files import sha256_file
from dpflow_core.replay_buffer.integrity import check_archive
from dpflow_core.server.gpu_server import GpuServer
from dpflow_core.server.paths import disk_margin_bytes, remote_dataset_name, remote_dataset_path
from dpflow_core.server.preflight import preflight
from dpflow_core.results import StageResult

#: ``progress(done_bytes, total_bytes)``, called during a transfer.
ProgressCallback = Callable[[int, int], None]

_STREAM_CHUNK = 256 * 1024
_RSYNC_PERCENT = re.compile(rb"(\d{1,3})%")


def task_for_dataset(dataset_path: str | Path, sidecar_path: str | Path | None = None) -> str:
    """The task name a dataset belongs to.

    The ``task`` field of the sidecar JSON (``sidecar_path``, else
    ``<dataset>.json`` next to the file) when present; else the dataset's
    folder name when it is a valid name; else ``"dataset"``.

    Raises:
        InvalidNameError: when the sidecar names an unsafe task.
    """
    dataset_path = Path(dataset_path)
    candidates = [Path(sidecar_path)] if sidecar_path else [dataset_path.with_suffix(".json")]
    for sidecar in candidates:
        if sidecar.is_file():
            try:
                task = json.loads(sidecar.read_text()).get("task")
            except (ValueError, AttributeError):
                task = None
            if task:
                return validate_name(str(task), "task")
    folder = dataset_path.resolve().parent.name
    try:
        return validate_name(folder, "task")
    except InvalidNameError:
        return "dataset"


@dataclass(frozen=True)
class Sha256Verification:
    """Local vs remote SHA-256 and size of one file.

    Attributes:
        remote_path: the file that was hashed (before any quarantine rename).
        local_sha256, local_size: what the file must be (hex digest, bytes).
        remote_sha256, remote_size: what the server has (None when the file is missing).
        quarantine_path: where a mismatching file was moved, if it was.
    """

    remote_path: str
    local_sha256: str
    local_size: int
    remote_sha256: str | None
    remote_size: int | None
    quarantine_path: str | None = None

    @property
    def match(self) -> bool:
        """True when both hashes and both sizes are equal."""
        return self.remote_sha256 == self.local_sha256 and self.remote_size == self.local_size

    def describe(self) -> str:
        """One line with both values."""
        moved = f"; kept as {self.quarantine_path}" if self.quarantine_path else ""
        return (
            f"local sha256={self.local_sha256} size={self.local_size}, "
            f"remote sha256={self.remote_sha256} size={self.remote_size} ({self.remote_path}){moved}"
        )


def quarantine_path_for(final_path: str, remote_sha256: str | None) -> str:
    """``<final>.quarantine-<UTC YYYYmmddTHHMMSSZ>-<sha256[:12] or 'missing'>``."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{final_path}.quarantine-{stamp}-{(remote_sha256 or 'missing')[:12]}"


def verify_remote_file(
    server: GpuServer,
    remote_path: str,
    expected_sha256: str,
    expected_size: int,
    *,
    quarantine: bool = True,
    quarantine_as: str | None = None,
) -> Sha256Verification:
    """Hash ``remote_path`` on the server and compare it with the expected digest and size.

    Args:
        quarantine: move a mismatching file to a quarantine name (see
            :func:`quarantine_path_for`, based on ``quarantine_as`` or ``remote_path``).

    Returns:
        The comparison; ``remote_sha256`` is None when the file does not exist.
    """
    full = server.abspath(remote_path)
    size = server.size(full)
    if size is None:
        return Sha256Verification(full, expected_sha256, expected_size, None, None)
    digest = server.sha256(full)
    result = Sha256Verification(full, expected_sha256, expected_size, digest, size)
    if not result.match and quarantine:
        target = quarantine_path_for(quarantine_as or full, digest)
        server.rename(full, target)
        result = Sha256Verification(full, expected_sha256, expected_size, digest, size, target)
    return result


@dataclass(frozen=True)
class RemoteDataset(StageResult):
    """A dataset on the GPU server whose SHA-256 there equals the local one: the value of the
    ``remote_dataset`` asset, what runs are launched on (``to_dict``/``from_dict``).

    :class:`UploadResult` reports one transfer (method, bytes sent, preflight); this is the file
    the later stages use, whatever transfer put it there.

    Attributes:
        remote_path: the content-addressed file on the server.
        sha256: its SHA-256 (hex), equal on both machines; size_bytes: its size in bytes.
        host: the server's host (None for the local machine).
        frequency_hz: the dataset's measured frequency, Hz (``task.dataset_frequeny`` of its runs).
        local_path: the same dataset here (evaluation reads it).
        remote_paths: each machine's copy in rank order, when uploaded to several (``gpu_server.hosts``)
            or through a cluster's login node; empty: ``remote_path`` alone (and values stored before).
    """

    remote_path: str
    sha256: str
    size_bytes: int
    host: str | None
    frequency_hz: float
    local_path: str
    remote_paths: tuple[str, ...] = ()


@dataclass(frozen=True)
class UploadResult:
    """What :func:`upload_dataset` did.

    Attributes:
        local_path, remote_path: the dataset here and its content-addressed path there.
        sha256, size_bytes: the local file's SHA-256 (hex) and size (bytes).
        host: the server's host (None for the local transport).
        task: the task folder on the server.
        method: ``rsync``, ``sftp``, ``copy`` (local stream), or ``none`` (already there).
        already_present: the verified file was there before; nothing was sent.
        resumed_from_bytes: bytes of an earlier partial upload that were kept.
        bytes_sent: bytes this call sent (for rsync: file size minus the resumed part).
        duration_s: wall-clock seconds of the whole upload, hashing included.
        verification: the SHA-256 comparison on the server.
        quarantined: earlier files moved aside (a corrupted final file found on arrival,
            or this upload's mismatching result).
        preflight: the preflight report taken before the transfer, when requested.
        recorded_sha256: the SHA-256 recorded before the upload (at conversion) that the local file
            was checked against; None when nothing recorded one.
        archive_crc32_checked: the local file's members were checked against their own CRC-32s.
    """

    local_path: str
    remote_path: str
    sha256: str
    size_bytes: int
    host: str | None
    task: str
    method: str
    already_present: bool
    resumed_from_bytes: int
    bytes_sent: int
    duration_s: float
    verification: Sha256Verification
    quarantined: tuple[str, ...] = ()
    preflight: object | None = field(default=None, repr=False)
    recorded_sha256: str | None = None
    archive_crc32_checked: bool = False

    @property
    def verified(self) -> bool:
        """True when the remote file's SHA-256 and size equal the local ones."""
        return self.verification.match

    @property
    def provenance_verified(self) -> bool:
        """True when the copy is verified and the local file equals a SHA-256 recorded before the
        upload: only then is the file on the server known to be what conversion wrote."""
        return self.verified and self.recorded_sha256 == self.sha256

    def summary(self) -> str:
        """One line for people: ``verified sha256 <hex>`` only when :attr:`provenance_verified`;
        otherwise ``copied sha256 <hex> (unverified: ...)`` saying what was and was not checked."""
        if self.provenance_verified:
            return f"verified sha256 {self.sha256}"
        if not self.verified:
            return f"MISMATCH sha256 {self.sha256}: {self.verification.describe()}"
        checked = "its members' own CRC-32s are intact" if self.archive_crc32_checked else "its contents were not checked"
        return (f"copied sha256 {self.sha256} (unverified: no SHA-256 was recorded for this file before the upload; "
                f"the copy equals the local file and {checked})")

    def to_remote_dataset(self, frequency_hz: float) -> "RemoteDataset":
        """The dataset as it now sits, verified, on the server (``frequency_hz``: its measured frequency, Hz)."""
        return RemoteDataset(
            remote_path=self.remote_path, sha256=self.sha256, size_bytes=self.size_bytes, host=self.host,
            frequency_hz=float(frequency_hz), local_path=self.local_path,
        )

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form (the preflight report as its own dict)."""
        data = asdict(self)
        data["preflight"] = self.preflight.to_dict() if self.preflight is not None else None
        data["verified"] = self.verified
        data["provenance_verified"] = self.provenance_verified
        return data


def ssh_command_for_rsync(server: GpuServer) -> list[str]:
    """The ``ssh`` command rsync uses: same port, key and known_hosts as the Fabric connection.

    Host keys are checked strictly (``StrictHostKeyChecking=yes``, the known_hosts file
    only, no ssh config file); ``BatchMode=yes`` so nothing ever waits for a prompt.
    """
    cfg = server.config
    cmd = ["ssh", "-F", "/dev/null", "-p", str(cfg.port)]
    if cfg.key_filename:
        cmd += ["-i", os.path.expanduser(cfg.key_filename), "-o", "IdentitiesOnly=yes"]
    cmd += [
        "-o", f"UserKnownHostsFile={cfg.known_hosts_path}",
        "-o", "GlobalKnownHostsFile=/dev/null",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "BatchMode=yes",
        "-o", f"ConnectTimeout={max(1, int(cfg.connect_timeout_s))}",
    ]
    return cmd


def rsync_available(server: GpuServer) -> bool:
    """True when rsync can be used: installed here and on the server, and no key passphrase."""
    if shutil.which("rsync") is None or server.config.key_passphrase:
        return False
    return server.transport == "local" or server.has_command("rsync")


def _rsync_upload(
    server: GpuServer, local: Path, remote: str, total: int,
    bwlimit_kbps: int | None, progress: ProgressCallback | None,
) -> None:
    cmd = ["rsync", "--append-verify", "--inplace", "--no-motd", "--info=progress2", "--chmod=F644"]
    if bwlimit_kbps:
        cmd.append(f"--bwlimit={int(bwlimit_kbps)}")
    if server.transport == "ssh":
        cfg = server.config
        user = f"{cfg.user}@" if cfg.user else ""
        # --protect-args: the remote path travels inside the rsync protocol, never through a shell.
        cmd += ["--protect-args", "-e", shlex.join(ssh_command_for_rsync(server)), str(local), f"{user}{cfg.host}:{remote}"]
    else:
        cmd += [str(local), remote]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "LC_ALL": "C"},
    )
    tail = b""
    assert proc.stdout is not None
    while True:
        block = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
        if not block:
            break
        tail = (tail + block)[-4000:]
        if progress is not None:
            percents = _RSYNC_PERCENT.findall(block)
            if percents:
                progress(min(total, total * int(percents[-1]) // 100), total)
    code = proc.wait()
    if code != 0:
        text = tail.decode("utf-8", "replace").replace("\r", "\n").strip()
        raise RemoteError(f"rsync exited with status {code}: {text[-800:]}", path=remote, code="transfer_failed")


def _stream_upload(
    server: GpuServer, local: Path, remote: str, offset: int, total: int,
    bwlimit_kbps: int | None, progress: ProgressCallback | None,
) -> int:
    sent = 0
    started = time.monotonic()
    rate = bwlimit_kbps * 1024 if bwlimit_kbps else None
    with open(local, "rb") as src, server.open(remote, "ab") as dst:
        src.seek(offset)
        while block := src.read(_STREAM_CHUNK if rate is None else min(_STREAM_CHUNK, 64 * 1024)):
            dst.write(block)
            sent += len(block)
            if progress is not None:
                progress(offset + sent, total)
            if rate is not None:
                ahead = sent / rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
    return sent


def upload_dataset(
    server: GpuServer,
    dataset_path: str | Path,
    *,
    task: str | None = None,
    expected_sha256: str | None = None,
    sidecar_path: str | Path | None = None,
    method: Literal["auto", "rsync", "stream"] = "auto",
    bwlimit_kbps: int | None = None,
    progress: ProgressCallback | None = None,
    with_preflight: bool = False,
    check_archive_crc: bool = True,
) -> UploadResult:
    """Upload ``dataset_path`` to its content-addressed path and verify it by SHA-256.

    Steps: hash the local file (and compare with ``expected_sha256``, the hash
    recorded at conversion); if the final remote file exists and matches, stop
    (no-op); a final file that does not match is quarantined. Check free disk
    (dataset minus what a partial upload already holds, plus
    :func:`disk_margin_bytes`); transfer to ``.partial`` (resuming); hash on the
    server; rename to the final name on a match, quarantine otherwise.

    Args:
        server: the GPU server.
        dataset_path: the local ``dataset.npz``.
        task: folder under the data root (default: :func:`task_for_dataset`).
        expected_sha256: the SHA-256 recorded when the dataset was written.
        method: ``rsync``, ``stream`` (SFTP / local copy, resume by size) or ``auto``
            (rsync when :func:`rsync_available`).
        bwlimit_kbps: bandwidth limit in KiB/s (None: unlimited).
        progress: called with (bytes done, total bytes) during the transfer.
        with_preflight: run :func:`dpflow_core.server.preflight.preflight` first and attach
            the report (it also refuses when the dataset does not fit).
        check_archive_crc: read the local file as a zip archive and check every member against its
            own CRC-32 (:func:`~dpflow_core.replay_buffer.integrity.check_archive`, in the same read
            as the SHA-256), so a damaged file is refused even when no SHA-256 was recorded for it.

    Returns:
        UploadResult; ``result.verified`` is False on a SHA-256 mismatch (the file
        is then quarantined, never at ``remote_path``). Callers must treat that as failure.

    Raises:
        DatasetError: the local file is missing (``dataset_missing``), its SHA-256 differs from
            ``expected_sha256`` (``sha256_changed``), it is no readable zip (``archive_unreadable``)
            or a member's bytes disagree with its CRC-32 (``archive_damaged``, naming the member).
        InvalidNameError: unsafe task name (before anything connects).
        RemoteError: ``insufficient_disk`` when the dataset does not fit with margin;
            ``transfer_failed`` when rsync or SFTP fails; connection errors.
    """
    started = time.monotonic()
    local = Path(dataset_path).resolve()
    task = validate_name(task, "task") if task is not None else task_for_dataset(local, sidecar_path)
    if method not in ("auto", "rsync", "stream"):
        raise RemoteError(f"unknown upload method {method!r} (auto, rsync or stream)", code="bad_config")
    if not local.is_file():
        raise DatasetError("dataset file does not exist", path=local, code="dataset_missing")
    size = local.stat().st_size
    if check_archive_crc:
        try:
            archive = check_archive(local)
        except OSError as exc:
            raise DatasetError(f"cannot read the dataset: {exc.strerror or exc}", path=local, code="unreadable") from exc
        digest = archive.sha256
    else:
        archive, digest = None, sha256_file(local)
    if expected_sha256 is not None and digest != expected_sha256:
        damage = f"; {archive.describe()}" if archive is not None and not archive.ok else ""
        raise DatasetError(
            f"SHA-256 of the dataset is {digest}, but {expected_sha256} was recorded when it was "
            f"written: the file changed since conversion{damage}",
            path=local, code="sha256_changed",
        )
    if archive is not None and not archive.ok:
        raise DatasetError(
            f"{archive.describe()}; the file is damaged, nothing was uploaded"
            + ("" if expected_sha256 is not None else " (no SHA-256 was recorded for it: its own CRC-32s caught this)"),
            path=local, code="archive_damaged" if archive.error is None else "archive_unreadable",
        )
    report = None
    if with_preflight:
        report = preflight(server, dataset_size_bytes=size, dataset_sha256=digest, task=task)
    final = remote_dataset_path(server, task, digest, remote_dataset_name(local.name))
    partial = final + ".partial"
    folder = server.mkdir(posixpath.dirname(final))
    quarantined: list[str] = []

    def result(**kw) -> UploadResult:
        return UploadResult(
            local_path=str(local), remote_path=final, sha256=digest, size_bytes=size, host=server.host,
            task=task, duration_s=time.monotonic() - started, quarantined=tuple(quarantined),
            preflight=report, recorded_sha256=expected_sha256, archive_crc32_checked=archive is not None, **kw,
        )

    if server.size(final) is not None:
        existing = verify_remote_file(server, final, digest, size, quarantine=True)
        if existing.match:
            return result(method="none", already_present=True, resumed_from_bytes=0, bytes_sent=0,
                          verification=existing)
        quarantined.append(existing.quarantine_path)

    offset = server.size(partial) or 0
    if offset > size:
        server.remove(partial)
        offset = 0
    needed = size - offset + disk_margin_bytes(size)
    free = server.free_disk(folder)
    if free < needed:
        raise RemoteError(
            f"dataset does not fit: {size - offset} bytes to upload plus a margin of "
            f"{disk_margin_bytes(size)} bytes, but only {free} bytes are free",
            path=folder, code="insufficient_disk",
        )

    if method == "auto":
        method = "rsync" if rsync_available(server) else "stream"
    if method == "rsync":
        if not rsync_available(server):
            raise RemoteError("rsync is not installed on both ends", code="transfer_failed")
        _rsync_upload(server, local, partial, size, bwlimit_kbps, progress)
        used, sent = "rsync", size - offset
    else:
        try:
            sent = _stream_upload(server, local, partial, offset, size, bwlimit_kbps, progress)
        except OSError as exc:
            raise RemoteError(f"upload failed: {exc}", path=partial, code="transfer_failed") from exc
        used = "sftp" if server.transport == "ssh" else "copy"

    check = verify_remote_file(server, partial, digest, size, quarantine=True, quarantine_as=final)
    if check.match:
        server.rename(partial, final)
        check = Sha256Verification(final, digest, size, check.remote_sha256, check.remote_size)
    else:
        quarantined.append(check.quarantine_path)
    return result(method=used, already_present=False, resumed_from_bytes=offset, bytes_sent=sent,
                  verification=check)
