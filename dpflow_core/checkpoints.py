"""Choosing, downloading and verifying a run's checkpoint, with its reproducibility record.

:func:`download_checkpoint` picks ``latest.ckpt`` or the best top-k file of a run
on the GPU server, waits until its size is stable (a save in progress writes a
hidden temporary file and renames it, but a copy or a foreign trainer may
not), hashes it on the server, downloads it with the run's ``.hydra/``
config, ``logs.json.txt``, normaliser file(s) and the reproducibility record
(:func:`dpflow_core.runs.reproducibility_record`, completed with the end time,
exit status and the checkpoint's hashes), and hashes it again here.

Local layout (content-addressed: a different checkpoint never overwrites one
already downloaded)::

    <checkpoint_root>/<run_name>/<remote sha256[:16]>/
        <checkpoint file>           latest.ckpt or epoch=...-train_loss=....ckpt
        .hydra/config.yaml, hydra.yaml, overrides.yaml
        logs.json.txt
        normalizer.json             from the checkpoint's ``normalizer`` entry (dpflow checkpoints)
        run_record.json             the reproducibility record

Everything is written into a temporary folder next to it and renamed at the end.
"""

from __future__ import annotations

import json
import posixpath
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from dpflow_core.errors import RemoteError, RunError
from dpflow_core.names import validate_name
from dpflow_core.files import default_workdir, install_dir, sha256_file
from dpflow_core.results import StageResult
from dpflow_core.server import GpuServer
from dpflow_core.runs import (
    CHECKPOINT_DIR,
    LATEST_CKPT,
    LOG_NAME,
    RECORD_NAME,
    RunHandle,
    finalize_record,
    list_checkpoints,
    load_handle,
)

RECORD_FILE = "run_record.json"
NORMALIZER_FILE = "normalizer.json"
_METRIC_IN_NAME = re.compile(r"(?:^|-)(?P<key>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>[-+0-9.eE]+|nan|inf)(?=-|\.ckpt$)")
_NORMALIZER_NAMES = re.compile(r"^(normalizer|norm_stats)[A-Za-z0-9_.-]*\.(json|pt|pkl|npz)$")


def default_checkpoint_root() -> Path:
    """``$DPFLOW_WORKDIR/checkpoints`` when set, else ``<cwd>/outputs/checkpoints``."""
    return default_workdir() / "checkpoints"


def metrics_from_name(name: str) -> dict[str, float]:
    """``{"epoch": 10.0, "train_loss": 0.012}`` from ``epoch=0010-train_loss=0.012.ckpt``."""
    out = {}
    for m in _METRIC_IN_NAME.finditer(name):
        try:
            out[m.group("key")] = float(m.group("value"))
        except ValueError:
            continue
    return out


def choose_checkpoint(
    names: list[str],
    choose: Literal["latest", "best"] = "latest",
    monitor_key: str = "train_loss",
    mode: Literal["min", "max"] = "min",
) -> str:
    """Pick a checkpoint file name from a ``checkpoints/`` listing.

    ``latest``: ``latest.ckpt``. ``best``: the top-k file whose ``monitor_key`` (parsed
    from its name, as the trainer's ``format_str`` writes it) is lowest (``min``) or
    highest (``max``); ties go to the later epoch. Note that top-k on ``train_loss``
    ranks fit to the training data, not generalisation.

    Raises:
        RunError: ``checkpoint_missing`` when there is no such file.
    """
    if choose == "latest":
        if LATEST_CKPT not in names:
            raise RunError(f"no {LATEST_CKPT} among {names or 'no files'}", code="checkpoint_missing")
        return LATEST_CKPT
    if choose != "best":
        raise RunError(f"choose must be 'latest' or 'best', got {choose!r}", code="bad_config")
    ranked = []
    for name in names:
        metrics = metrics_from_name(name)
        if monitor_key in metrics and metrics[monitor_key] == metrics[monitor_key]:
            ranked.append((metrics[monitor_key] if mode == "min" else -metrics[monitor_key], -metrics.get("epoch", 0), name))
    if not ranked:
        raise RunError(
            f"no top-k checkpoint named with {monitor_key}=... among {names or 'no files'} (was checkpoint.topk.k 0?)",
            code="checkpoint_missing",
        )
    return sorted(ranked)[0][2]


def wait_until_stable(
    server: GpuServer,
    path: str,
    *,
    interval_s: float = 2.0,
    stable_checks: int = 2,
    timeout_s: float = 600.0,
) -> int:
    """Wait until ``path``'s size stays the same for ``stable_checks`` polls ``interval_s`` apart
    and no temporary file of a save is next to it; return the size (bytes).

    Raises:
        RunError: ``checkpoint_missing`` when the file does not exist; ``checkpoint_unstable``
            when it still changes after ``timeout_s``.
    """
    folder, base = posixpath.split(path)
    deadline = time.monotonic() + timeout_s
    last = server.size(path)
    if last is None:
        raise RunError("checkpoint does not exist on the server", path=path, code="checkpoint_missing")
    same = 0
    while True:
        time.sleep(interval_s)
        size = server.size(path)
        if size is None:
            raise RunError("checkpoint disappeared while waiting for it", path=path, code="checkpoint_missing")
        saving = any(n.startswith(f".{base}.tmp-") for n in server.listdir(folder))
        same = same + 1 if size == last and not saving else 0
        last = size
        if same >= stable_checks:
            return size
        if time.monotonic() > deadline:
            raise RunError(f"checkpoint size still changes after {timeout_s:.0f} s", path=path, code="checkpoint_unstable")


@dataclass(frozen=True)
class DownloadedCheckpoint(StageResult):
    """A checkpoint downloaded from the GPU server; the value of the ``checkpoint`` asset.

    Attributes:
        run_name: the run.
        choice: ``latest`` or ``best``.
        remote_path: the file on the server; remote_sha256, size_bytes: its SHA-256 (hex) and size in bytes, measured there.
        local_path: the file here; local_sha256: hashed here after the download.
        local_dir: the folder with the checkpoint, config, log, normaliser and record.
        hydra_dir, log_path, normalizer_path, record_path: the companions (None when absent).
        run_finished: the run had ended (exit status recorded) when it was downloaded.
        exit_code: the run's exit status, when recorded.
        already_present: the same checkpoint (same remote SHA-256) was downloaded before.
        dataset_local_path: the dataset it was trained on, here (None when not known).

    ``to_dict`` adds ``match`` (hashes the local file's size now); ``from_dict`` also reads what the
    ``checkpoint`` asset stored before its value was typed (``path`` and ``sha256`` for the local
    file, no ``hydra_dir``, ``run_finished``, ``exit_code``, ``already_present``: None, None, None, False).
    """

    run_name: str
    choice: str
    remote_path: str
    remote_sha256: str
    size_bytes: int
    local_path: str
    local_sha256: str
    local_dir: str
    hydra_dir: str | None
    log_path: str | None
    normalizer_path: str | None
    record_path: str
    run_finished: bool | None
    exit_code: int | None
    already_present: bool = False
    dataset_local_path: str | None = None

    @property
    def match(self) -> bool:
        """True when both hashes are equal and the local size is the remote one."""
        return self.local_sha256 == self.remote_sha256 and Path(self.local_path).stat().st_size == self.size_bytes

    def to_dict(self) -> dict[str, Any]:
        """Every field (JSON-safe) and ``match``."""
        return {**super().to_dict(), "match": self.match}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DownloadedCheckpoint":
        """The checkpoint ``data`` describes: :meth:`to_dict`'s form or the earlier asset value (see above).

        Raises:
            ResultError: a field is missing or of the wrong kind (the message names it).
        """
        if isinstance(data, Mapping) and "local_path" not in data and "path" in data:
            data = {
                "hydra_dir": None, "run_finished": None, "exit_code": None, **data,
                "local_path": data["path"], "local_sha256": data.get("sha256"),
            }
        return super().from_dict(data)


def _get(server: GpuServer, remote: str, local: Path) -> Path | None:
    if server.size(remote) is None:
        return None
    return server.get(remote, local)


def _write_normalizer(ckpt_path: Path, out: Path) -> Path | None:
    """Extract a dpflow checkpoint's normaliser statistics to JSON (None for foreign files)."""
    try:
        from dpflow_core.train.checkpoint import load_checkpoint

        payload = load_checkpoint(ckpt_path, require_complete=False)
    except RunError:
        return None
    stats = payload.get("normalizer")
    if not isinstance(stats, dict):
        return None
    data = {k: {s: v.tolist() if hasattr(v, "tolist") else v for s, v in st.items()} for k, st in stats.items()}
    out.write_text(json.dumps({"source": ckpt_path.name, "normalizer": data}, indent=2) + "\n")
    return out


def trained_representation(ckpt_path: Path) -> dict[str, Any] | None:
    """What a dpflow checkpoint was trained with, for the run record (None for foreign files).

    ``{"tx_cam_tcp": 4x4 list, "obs_pose_repr", "action_pose_repr", "dataset_sha256"}``.
    """
    try:
        from dpflow_core.train.checkpoint import load_checkpoint

        payload = load_checkpoint(ckpt_path, require_complete=False)
    except RunError:
        return None
    spec = payload.get("spec")
    if not isinstance(spec, dict) or "tx_cam_tcp" not in spec:
        return None
    return {
        "tx_cam_tcp": [list(r) for r in spec["tx_cam_tcp"]],
        "obs_pose_repr": spec.get("obs_pose_repr"),
        "action_pose_repr": spec.get("action_pose_repr"),
        "dataset_sha256": (payload.get("dataset") or {}).get("sha256"),
    }


def download_checkpoint(
    server: GpuServer,
    run_name: str,
    *,
    choose: Literal["latest", "best"] = "latest",
    dest_root: str | Path | None = None,
    stable_interval_s: float = 2.0,
    stable_checks: int = 2,
    stable_timeout_s: float = 600.0,
) -> DownloadedCheckpoint:
    """Download the chosen checkpoint of run ``run_name`` with its companions (see the module docstring).

    On a Slurm cluster (``scheduler: slurm``) the run's job record (``slurm.json``) stands in for its
    launch record: the run has ended when Slurm reports a final state; the job's ``record.json``
    (:func:`~dpflow_core.runs.slurm.slurm_record`, completed with the final state) comes with it.

    Raises:
        RunError: ``run_not_found``, ``checkpoint_missing``, ``checkpoint_unstable``.
        RemoteError: a transfer or the hash on the server failed.
    """
    validate_name(run_name, "run name")
    handle, finished = _launch(server, run_name)
    ckpt_dir = posixpath.join(handle.run_dir, CHECKPOINT_DIR)
    name = choose_checkpoint(list_checkpoints(server, handle.run_dir), choose)
    remote = posixpath.join(ckpt_dir, name)
    size = wait_until_stable(server, remote, interval_s=stable_interval_s, stable_checks=stable_checks, timeout_s=stable_timeout_s)
    remote_sha = server.sha256(remote)
    on_server = _OnServer(handle, choose, remote, remote_sha, size, finished)

    root = Path(dest_root) if dest_root is not None else default_checkpoint_root()
    final = root / run_name / remote_sha[:16]
    if (final / name).is_file() and (final / RECORD_FILE).is_file():
        rec = json.loads((final / RECORD_FILE).read_text())
        local_sha = sha256_file(final / name)
        return _result(on_server, final, name, local_sha, rec, already=True)

    tmp = final.parent / f".partial-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        server.get(remote, tmp / name)
        local_sha = sha256_file(tmp / name)
        hydra_remote = posixpath.join(handle.run_dir, ".hydra")
        for entry in server.listdir(hydra_remote):
            _get(server, posixpath.join(hydra_remote, entry), tmp / ".hydra" / entry)
        _get(server, posixpath.join(handle.run_dir, LOG_NAME), tmp / LOG_NAME)
        for entry in server.listdir(handle.run_dir):
            if _NORMALIZER_NAMES.match(entry):
                _get(server, posixpath.join(handle.run_dir, entry), tmp / entry)
        if not (tmp / NORMALIZER_FILE).exists() and local_sha == remote_sha:
            _write_normalizer(tmp / name, tmp / NORMALIZER_FILE)
        if isinstance(handle, RunHandle):
            try:
                record = finalize_record(server, handle)
            except RemoteError:
                record = {"run_name": run_name, "note": f"no {RECORD_NAME} for launch {handle.launch_index}"}
        else:
            from dpflow_core.runs.slurm import finalize_slurm_record

            record = finalize_slurm_record(server, handle) or {
                "run_name": run_name, "slurm_job_id": handle.job_id,
                "note": f"Slurm job {handle.job_id} (launch {handle.launch_index}) was submitted before dpflow kept its "
                        f"{RECORD_NAME}"}
        record = dict(record)
        record["checkpoint"] = {
            "file": name, "choice": choose, "remote_path": remote, "remote_sha256": remote_sha, "local_sha256": local_sha,
            "size_bytes": size, "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "run_finished": finished,
        }
        if local_sha == remote_sha:
            trained = trained_representation(tmp / name)
            if trained is not None:
                record["trained_with"] = trained
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if local_sha != remote_sha:
            # Never under the final, content-addressed name: kept aside for inspection.
            final = final.parent / f"{final.name}.mismatch-{local_sha[:12]}-{uuid.uuid4().hex[:6]}"
        if not install_dir(tmp, final):
            shutil.rmtree(tmp)  # the same content-addressed download is already there
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _result(on_server, final, name, local_sha, record)


def _launch(server: GpuServer, run_name: str):
    """The run's latest launch record, and whether it has ended: its :class:`RunHandle` on a server, or
    its :class:`~dpflow_core.runs.slurm.SlurmJob` (ended: Slurm reports a final state) on a cluster."""
    try:
        handle = load_handle(server, run_name)
    except RunError as exc:
        if server.config.scheduler != "slurm":
            raise
        from dpflow_core.runs.slurm import job_state, load_job

        try:
            job = load_job(server, run_name)
        except RunError:
            raise exc from None
        state = job_state(server, job.job_id)
        return job, state is None or state.finished
    return handle, server.detached_status(handle.detached).finished


@dataclass(frozen=True)
class _OnServer:
    """What the server holds of the chosen checkpoint: the run's handle, the choice, the file's path,
    SHA-256 and size (bytes), and whether the run had finished."""

    handle: Any
    choose: str
    path: str
    sha256: str
    size: int
    finished: bool


def _result(on: _OnServer, folder: Path, name: str, local_sha: str, record, already: bool = False) -> DownloadedCheckpoint:
    hydra = folder / ".hydra"
    normalizers = sorted(p for p in folder.iterdir() if _NORMALIZER_NAMES.match(p.name))
    return DownloadedCheckpoint(
        run_name=on.handle.name, choice=on.choose, remote_path=on.path, remote_sha256=on.sha256, size_bytes=on.size,
        local_path=str(folder / name), local_sha256=local_sha, local_dir=str(folder),
        hydra_dir=str(hydra) if hydra.is_dir() else None,
        log_path=str(folder / LOG_NAME) if (folder / LOG_NAME).is_file() else None,
        normalizer_path=str(normalizers[0]) if normalizers else None,
        record_path=str(folder / RECORD_FILE), run_finished=on.finished,
        exit_code=record.get("exit_code") if isinstance(record, dict) else None, already_present=already,
    )


def _zip_error(path: Path) -> str | None:
    """Why the torch zip container at ``path`` is damaged (every member's CRC is read), or None."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        return f"damaged file ({type(exc).__name__}: {exc})"
    return None if bad is None else f"member {bad} fails its CRC"


@dataclass(frozen=True)
class CheckpointVerification:
    """The blocking checkpoint check.

    Attributes:
        passed: local SHA-256 == remote SHA-256 (as hashed on the server), same size, and
            the local file loads (dpflow checkpoints: every resume entry present).
        local_sha256, remote_sha256: the hashes compared (local one computed now).
        local_size, remote_size: bytes.
        loadable: the local file loads; load_error why not.
        remote_now_sha256: the server file's hash now, when asked for (None otherwise / gone).
        problems: one line per failed condition.
    """

    passed: bool
    local_path: str
    local_sha256: str | None
    remote_sha256: str
    local_size: int | None
    remote_size: int
    loadable: bool
    load_error: str | None
    remote_now_sha256: str | None
    problems: tuple[str, ...]

    def metadata(self) -> dict[str, Any]:
        out = {
            "local_sha256": self.local_sha256 or "(missing)", "remote_sha256": self.remote_sha256,
            "local_size_bytes": self.local_size if self.local_size is not None else -1,
            "remote_size_bytes": self.remote_size, "loadable": self.loadable,
        }
        if self.remote_now_sha256:
            out["remote_sha256_now"] = self.remote_now_sha256
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        return out


def verify_checkpoint(
    local_path: str | Path,
    remote_sha256: str,
    remote_size: int,
    *,
    server: GpuServer | None = None,
    remote_path: str | None = None,
) -> CheckpointVerification:
    """Hash the local checkpoint now and compare with the server's hash; check it loads.

    With ``server`` and ``remote_path`` the server file is hashed again as well (a
    difference is reported, and fails the check only when the local file also differs
    from the recorded hash: ``latest.ckpt`` may legitimately move on while a run continues).
    """
    local_path = Path(local_path)
    problems = []
    local_sha = local_size = None
    if not local_path.is_file():
        problems.append(f"{local_path} does not exist")
    else:
        local_size = local_path.stat().st_size
        local_sha = sha256_file(local_path)
        if local_sha != remote_sha256:
            problems.append(f"SHA-256 differs: local {local_sha}, server {remote_sha256}")
        if local_size != remote_size:
            problems.append(f"size differs: local {local_size} bytes, server {remote_size} bytes")
    loadable, load_error = False, None
    if local_sha is not None:
        zip_error = _zip_error(local_path)
        if zip_error is not None:
            load_error = zip_error
            problems.append(f"not loadable: {zip_error}")
        else:
            try:
                from dpflow_core.train.checkpoint import load_checkpoint

                load_checkpoint(local_path, require_complete=True)
                loadable = True
            except RunError as exc:
                if exc.code in ("checkpoint_foreign", "checkpoint_unreadable"):
                    # Another trainer's file (e.g. pickled objects torch will not load safely):
                    # its container is intact, which with the SHA-256 is all that can be checked.
                    loadable, load_error = True, f"not a dpflow checkpoint; container intact ({exc.reason[:200]})"
                else:
                    load_error = exc.reason
                    problems.append(f"not loadable: {exc.reason}")
    remote_now = None
    if server is not None and remote_path is not None and server.size(remote_path) is not None:
        remote_now = server.sha256(remote_path)
    return CheckpointVerification(
        passed=not problems, local_path=str(local_path), local_sha256=local_sha, remote_sha256=remote_sha256,
        local_size=local_size, remote_size=int(remote_size), loadable=loadable, load_error=load_error,
        remote_now_sha256=remote_now, problems=tuple(problems),
    )


__all__ = [
    "CheckpointVerification", "DownloadedCheckpoint", "choose_checkpoint", "default_checkpoint_root",
    "download_checkpoint", "metrics_from_name", "verify_checkpoint", "wait_until_stable",
]
