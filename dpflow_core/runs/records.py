"""Records: the checkpoint probe and the reproducibility record of a launch.

Takes a server and a :class:`~dpflow_core.runs.state.RunHandle`; gives what a checkpoint file holds
(probed on the server, without loading torch here) and the launch's ``record.json`` (git state, pip
freeze, GPUs, start and end times in UTC ISO 8601).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dpflow_core.server.preflight import repo_state
from dpflow_core.server import GpuInventory, GpuServer
from dpflow_core.runs.spec import RECORD_NAME, TOKEN_ENV, _run_env, utc_now
from dpflow_core.runs.state import RunHandle


# ---------------------------------------------------------------- checkpoint probe

_CKPT_PROBE = r"""
import json, sys, zipfile
p = sys.argv[1]
out = {"path": p}
try:
    with zipfile.ZipFile(p) as z:
        bad = z.testzip()
    out["zip_ok"] = bad is None
    if bad is not None:
        out["error"] = "member %s fails its CRC" % bad
except Exception as exc:
    out["zip_ok"] = False
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
if out["zip_ok"]:
    try:
        import torch
        payload = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:
        payload = None
        out["format"] = "foreign"
        out["note"] = "not loadable with weights_only=True (%s); zip integrity verified only" % type(exc).__name__
    if isinstance(payload, dict):
        out["format"] = str(payload.get("format", "foreign"))
        for k in ("epoch", "global_step", "batch_in_epoch", "num_processes"):
            v = payload.get(k)
            if isinstance(v, int):
                out[k] = v
        if payload.get("format") == "dpflow-train-checkpoint":
            try:
                from dpflow_core.train.checkpoint import missing_checkpoint_entries
                out["missing"] = missing_checkpoint_entries(payload)
            except ImportError:
                out["missing"] = [k for k in ("model", "ema", "optimizer", "lr_scheduler", "epoch", "global_step", "rank_states") if k not in payload]
print("DPFLOW_CKPT " + json.dumps(out))
"""


@dataclass(frozen=True)
class CheckpointProbe:
    """Whether a checkpoint file on the server is complete and loadable.

    Attributes:
        path: the file.
        exists: the file is there.
        size_bytes: its size.
        zip_ok: the torch zip container reads and every member passes its CRC.
        format: ``dpflow-train-checkpoint``, or ``foreign`` (another trainer's file,
            checked for container integrity only).
        epoch, global_step: what a dpflow checkpoint says it holds.
        missing: entries a dpflow checkpoint lacks to resume exactly.
        error: why it is not loadable.
    """

    path: str
    exists: bool
    size_bytes: int | None = None
    zip_ok: bool = False
    format: str | None = None
    epoch: int | None = None
    global_step: int | None = None
    missing: tuple[str, ...] = ()
    error: str | None = None
    note: str | None = None

    @property
    def loadable(self) -> bool:
        """True when the file exists, its container is intact and nothing needed is missing."""
        return self.exists and self.zip_ok and not self.missing and self.error is None

    def describe(self) -> str:
        if not self.exists:
            return f"{self.path}: missing"
        if not self.loadable:
            why = self.error or ("missing entries: " + ", ".join(self.missing))
            return f"{self.path} ({self.size_bytes} bytes): not loadable: {why}"
        return f"{self.path} ({self.size_bytes} bytes): loadable, format {self.format}, epoch {self.epoch}, global_step {self.global_step}"


def probe_checkpoint(server: GpuServer, path: str, timeout_s: float = 600.0) -> CheckpointProbe:
    """Check a checkpoint on the server with its own Python: zip CRCs, ``torch.load(weights_only=True)``,
    and for dpflow checkpoints the entries needed to resume (no code from the file runs)."""
    full = server.abspath(path)
    size = server.size(full)
    if size is None:
        return CheckpointProbe(full, False)
    result = server.run(server.python_command(["-c", _CKPT_PROBE, full]), timeout_s=timeout_s)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DPFLOW_CKPT ")), None)
    if line is None:
        why = (result.stderr or result.stdout).strip()[-400:]
        return CheckpointProbe(full, True, size, error=f"probe failed (exit {result.exit_code}): {why}")
    data = json.loads(line.split(" ", 1)[1])
    return CheckpointProbe(
        path=full, exists=True, size_bytes=size, zip_ok=bool(data.get("zip_ok")), format=data.get("format"),
        epoch=data.get("epoch"), global_step=data.get("global_step"), missing=tuple(data.get("missing", ())),
        error=data.get("error"), note=data.get("note"),
    )


# ------------------------------------------------------------------------ records


def _pip_freeze(server: GpuServer) -> list[str] | str:
    result = server.run(server.python_command(["-m", "pip", "freeze", "--all"]), timeout_s=180)
    if not result.ok:
        return f"pip freeze failed (exit {result.exit_code}): {(result.stderr or result.stdout).strip()[-300:]}"
    return [line for line in result.stdout.splitlines() if line.strip()]


def reproducibility_record(server: GpuServer, handle: RunHandle, inventory: GpuInventory) -> dict[str, Any]:
    """The run's reproducibility record at launch (rule 12).

    Repository branch, commit and dirty files (``git`` in the server's ``repo_path``),
    dataset path and SHA-256, the GPU inventory (``nvidia-smi``), installed packages
    (``pip freeze`` of the training interpreter), the full command and overrides,
    the launch time. :func:`finalize_record` adds the end time and exit status.
    """

    repo = repo_state(server, server.config.repo_path)
    host = server.run("uname -n").stdout.strip()
    return {
        "run_name": handle.name,
        "kind": handle.spec.kind,
        "server": server.config.describe(),
        "hostname": host,
        "run_dir": handle.run_dir,
        "launch_index": handle.launch_index,
        "repo": dataclasses.asdict(repo),
        "dataset": {"path": handle.spec.dataset_path, "sha256": handle.spec.dataset_sha256, "frequency_hz": handle.spec.frequency_hz},
        "gpu_ids": list(handle.gpu_ids),
        "nvidia_smi": inventory.to_dict(),
        "pip_freeze": _pip_freeze(server),
        "python": server.config.python,
        "command": handle.command,
        "train_command_template": handle.spec.train_command,
        "overrides": list(handle.overrides),
        "environment": {k: v for k, v in _run_env(handle.run_dir, handle.token, handle.spec).items() if k != TOKEN_ENV},
        "started_at": handle.started_at,
        "ended_at": None,
        "exit_code": None,
    }


def finalize_record(server: GpuServer, handle: RunHandle) -> dict[str, Any]:
    """Add the end time (the exit-status file's mtime) and exit status to the run's record; return it."""
    path = posixpath.join(handle.state_dir, RECORD_NAME)
    record = json.loads(server.read_text(path))
    status = server.detached_status(handle.detached)
    if status.exit_code is not None and record.get("exit_code") is None:
        mtime = server.run(["stat", "-c", "%Y", "--", handle.detached.exit_path])
        ended = (
            datetime.fromtimestamp(int(mtime.stdout.strip()), timezone.utc).isoformat(timespec="seconds")
            if mtime.ok and mtime.stdout.strip().isdigit() else utc_now()
        )
        record.update(exit_code=status.exit_code, ended_at=ended)
        server.write_text(path, json.dumps(record, indent=2) + "\n")
    return record
