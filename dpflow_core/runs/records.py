"""Records: the checkpoint probe and the reproducibility record of a launch.

Takes a server and a :class:`~dpflow_core.runs.state.RunHandle`; gives what a checkpoint file holds
(loaded on the server by the server's Python, never here: dpflow's own format or an upstream
Diffusion Policy / UMI workspace checkpoint) and the launch's ``record.json`` (git state, pip
freeze, GPUs, start and end times in UTC ISO 8601).
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from dpflow_core.server.preflight import repo_state
from dpflow_core.server import GpuInventory, GpuServer
from dpflow_core.runs.spec import CPU_RUN_NOTE, RECORD_NAME, TOKEN_ENV, RunSpec, run_environment, utc_now
from dpflow_core.runs.state import RunHandle


# ---------------------------------------------------------------- checkpoint probe

_CKPT_PROBE = r"""
import json, os, sys, zipfile
p = sys.argv[1]
out = {"path": p}
# The lab's classes (pickled in an upstream-style checkpoint) import from its repository.
if len(sys.argv) > 2 and sys.argv[2]:
    sys.path.insert(0, sys.argv[2])
try:
    with zipfile.ZipFile(p) as z:
        bad = z.testzip()
    out["zip_ok"] = bad is None
    if bad is not None:
        out["error"] = "member %s fails its CRC" % bad
except Exception as exc:
    out["zip_ok"] = False
    out["error"] = "%s: %s" % (type(exc).__name__, exc)
payload = None
if out["zip_ok"]:
    import torch
    try:
        payload = torch.load(p, map_location="cpu", weights_only=True)
        out["loaded_with"] = "torch.load(weights_only=True)"
    except Exception:
        try:  # upstream workspaces pickle with dill (torch.save(..., pickle_module=dill))
            try:
                import dill as pickle_module
            except ImportError:
                import pickle as pickle_module
            payload = torch.load(p, map_location="cpu", weights_only=False, pickle_module=pickle_module)
            out["loaded_with"] = "torch.load(pickle_module=%s)" % pickle_module.__name__
        except Exception as exc:
            out["error"] = "cannot be loaded with the server's Python: %s: %s" % (type(exc).__name__, str(exc)[:300])
if isinstance(payload, dict):
    out["entries"] = sorted(str(k) for k in payload)
    if payload.get("format") == "dpflow-train-checkpoint":
        out["format"] = "dpflow-train-checkpoint"
        for k in ("epoch", "global_step", "batch_in_epoch", "num_processes"):
            v = payload.get(k)
            if isinstance(v, int):
                out[k] = v
        try:
            from dpflow_core.train.checkpoint import missing_checkpoint_entries
            out["missing"] = missing_checkpoint_entries(payload)
        except ImportError:
            out["missing"] = [k for k in ("model", "ema", "optimizer", "lr_scheduler", "epoch", "global_step", "rank_states") if k not in payload]
    elif isinstance(payload.get("state_dicts"), dict):
        out["format"] = "upstream-workspace"
        state_dicts = payload["state_dicts"]
        pickles = payload.get("pickles") if isinstance(payload.get("pickles"), dict) else {}
        out["state_dicts"] = sorted(str(k) for k in state_dicts)
        out["pickles"] = sorted(str(k) for k in pickles)
        out["missing"] = [k for k in ("model", "ema_model", "optimizer") if not state_dicts.get(k)]
        if "cfg" not in payload:
            out["missing"].append("cfg")
        try:
            import dill as unpickler
        except ImportError:
            import pickle as unpickler
        for k in ("epoch", "global_step"):
            try:
                v = unpickler.loads(pickles[k]) if isinstance(pickles.get(k), bytes) else pickles.get(k)
            except Exception:
                v = None
            if isinstance(v, int):
                out[k] = v
    else:
        out["format"] = "unknown"
        out["error"] = "neither a dpflow checkpoint nor an upstream workspace checkpoint (no 'state_dicts'); top-level keys: %s" % out["entries"][:20]
elif payload is not None:
    out["format"] = "unknown"
    out["error"] = "the checkpoint holds a %s, not a dict" % type(payload).__name__
print("DPFLOW_CKPT " + json.dumps(out))
"""


@dataclass(frozen=True)
class CheckpointProbe:
    """What a checkpoint file on the server holds, as the server's own Python loads it.

    Attributes:
        path: the file.
        exists: the file is there.
        size_bytes: its size.
        zip_ok: the torch zip container reads and every member passes its CRC.
        format: ``dpflow-train-checkpoint`` (the built-in trainer), ``upstream-workspace``
            (Diffusion Policy / UMI ``BaseWorkspace.save_checkpoint``: ``{'cfg', 'state_dicts',
            'pickles'}``) or ``unknown``.
        epoch, global_step: what the checkpoint says it holds (upstream: its ``pickles``).
        missing: entries needed to resume that it lacks (upstream: ``model``, ``ema_model``,
            ``optimizer`` state dicts, ``cfg``).
        entries: its top-level keys; state_dicts, pickles: an upstream checkpoint's entries.
        loaded_with: how the server loaded it (``torch.load(weights_only=True)``, or with dill).
        error: why it is not loadable (including a file the server's Python cannot load).
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
    entries: tuple[str, ...] = ()
    state_dicts: tuple[str, ...] = ()
    pickles: tuple[str, ...] = ()
    loaded_with: str | None = None

    @property
    def loadable(self) -> bool:
        """True when the file exists, loads on the server and holds everything needed to resume."""
        return self.exists and self.zip_ok and not self.missing and self.error is None

    def describe(self) -> str:
        if not self.exists:
            return f"{self.path}: missing"
        held = f" (state_dicts: {', '.join(self.state_dicts) or 'none'})" if self.format == "upstream-workspace" else ""
        if not self.loadable:
            why = self.error or ("missing entries: " + ", ".join(self.missing))
            return f"{self.path} ({self.size_bytes} bytes): not loadable: {why}{held}"
        # the trainer's checkpoint counts what is done (epoch 1, global_step 5 after epoch 0's last step 4):
        # said so, beside the log's last epoch and step, which count from 0
        done = (f"saved after {self.epoch} epoch(s), {self.global_step} step(s)" if self.format == "dpflow-train-checkpoint"
                else f"epoch {self.epoch}, global_step {self.global_step}")
        return f"{self.path} ({self.size_bytes} bytes): loadable, format {self.format}{held}, {done}"


def probe_checkpoint(server: GpuServer, path: str, timeout_s: float = 600.0) -> CheckpointProbe:
    """Load a checkpoint on the server with the server's Python and report what it holds.

    Runs there (in the training repository, whose classes an upstream checkpoint pickles):
    zip CRCs; ``torch.load(weights_only=True)``, else a full ``torch.load`` with dill (how
    Diffusion Policy / UMI workspaces save); then the entries needed to resume: dpflow's own
    (:func:`dpflow_core.train.checkpoint.missing_checkpoint_entries`) or an upstream
    workspace's ``model``, ``ema_model`` and ``optimizer`` state dicts. A file that does not
    load there, or that is neither format, is not loadable.

    Returns:
        CheckpointProbe (never raises for a bad file; ``exists`` False when it is absent).
    """
    full = server.abspath(path)
    size = server.size(full)
    if size is None:
        return CheckpointProbe(full, False)
    repo = server.abspath(server.config.repo_path) if server.config.repo_path else ""
    repo = repo if repo and server.exists(repo) else ""
    command = server.python_command(["-c", _CKPT_PROBE, full, repo])
    result = server.run(command, timeout_s=timeout_s, cwd=repo or None)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("DPFLOW_CKPT ")), None)
    if line is None:
        why = (result.stderr or result.stdout).strip()[-400:]
        return CheckpointProbe(full, True, size, error=f"probe failed (exit {result.exit_code}): {why}")
    data = json.loads(line.split(" ", 1)[1])
    return CheckpointProbe(
        path=full, exists=True, size_bytes=size, zip_ok=bool(data.get("zip_ok")), format=data.get("format"),
        epoch=data.get("epoch"), global_step=data.get("global_step"), missing=tuple(data.get("missing", ())),
        error=data.get("error"), note=data.get("note"), entries=tuple(data.get("entries", ())),
        state_dicts=tuple(data.get("state_dicts", ())), pickles=tuple(data.get("pickles", ())),
        loaded_with=data.get("loaded_with"),
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

    return {
        **launch_record(server, handle.spec, run_dir=handle.run_dir, launch_index=handle.launch_index,
                        command=handle.command, overrides=handle.overrides, started_at=handle.started_at),
        "gpu_ids": list(handle.gpu_ids),
        "gpu_release": "checked after the run" if handle.gpu_ids else CPU_RUN_NOTE,
        "nvidia_smi": inventory.to_dict(),
        "environment": {k: v for k, v in run_environment(handle.run_dir, handle.token, handle.spec).items() if k != TOKEN_ENV},
    }


def launch_record(server: GpuServer, spec: RunSpec, *, run_dir: str, launch_index: int, command: str,
                  overrides: Sequence[str], started_at: str) -> dict[str, Any]:
    """What every launch's record holds, on one server or a cluster: the run, the server and its host name,
    the repository's git state (``repo_path``), the dataset (path, SHA-256, frequency in Hz), ``pip
    freeze`` of the training interpreter, the command and overrides, the start time (UTC ISO 8601);
    ``ended_at`` and ``exit_code`` None until the run is finalized."""
    return {
        "run_name": spec.name,
        "kind": spec.kind,
        "server": server.config.describe(),
        "hostname": server.run("uname -n").stdout.strip(),
        "run_dir": run_dir,
        "launch_index": launch_index,
        "repo": dataclasses.asdict(repo_state(server, server.config.repo_path)),
        "dataset": {"path": spec.dataset_path, "sha256": spec.dataset_sha256, "frequency_hz": spec.frequency_hz},
        "pip_freeze": _pip_freeze(server),
        "python": server.config.python,
        "command": command,
        "train_command_template": spec.train_command,
        "overrides": list(overrides),
        "started_at": started_at,
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
