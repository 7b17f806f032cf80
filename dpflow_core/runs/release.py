"""Release: after a run, check that its processes are gone and its GPUs' memory is back.

Takes a server, a :class:`~dpflow_core.runs.state.RunHandle` and the GPU memory (MiB) before launch;
gives a :class:`ReleaseReport`, saved as ``release.json`` beside the launch state.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import time
from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.server import GpuServer
from dpflow_core.runs.gpus import gpu_memory
from dpflow_core.runs.processes import CleanupReport, cleanup_run, describe_process, run_processes
from dpflow_core.runs.spec import CPU_RUN_NOTE, RELEASE_NAME
from dpflow_core.runs.state import RunHandle


#: Memory a GPU may still show above its pre-run level and count as released.
GPU_RELEASE_TOLERANCE_MIB = 128


# --------------------------------------------------------------------- release check


@dataclass(frozen=True)
class ReleaseReport:
    """The "released" check after a run (rule 7).

    Attributes:
        passed: no process of the run was left and every GPU it used is back to its
            pre-run memory (within :data:`GPU_RELEASE_TOLERANCE_MIB`). A CPU run that left
            nothing is ``passed`` with ``warning`` set: its :attr:`verdict` is ``warn``.
        leftovers: processes of the run found alive (``describe_process`` strings).
        leftover_pids: their PIDs.
        gpu_status: ``ok``, ``no_gpu`` (then memory was not checked: "no GPU present") or ``error``.
        gpus: per GPU used: index, memory before and after (MiB), released.
        gpu_processes: compute processes still on those GPUs (``pid name MiB``).
        message: one line for humans.
        cleanup: what was signalled afterwards, when cleanup was asked for.
        warning: :data:`CPU_RUN_NOTE` when the run used no GPU (its memory was not checked).
    """

    passed: bool
    leftovers: tuple[str, ...]
    leftover_pids: tuple[int, ...]
    gpu_status: str
    gpus: tuple[dict[str, Any], ...]
    gpu_processes: tuple[str, ...]
    message: str
    cleanup: CleanupReport | None = None
    warning: str | None = None

    @property
    def verdict(self) -> str:
        """``fail`` (something was left), ``warn`` (a CPU run: GPU release not checked) or ``pass``."""
        if not self.passed:
            return "fail"
        return "warn" if self.warning else "pass"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ReleaseReport":
        values = dict(data)
        cleanup = values.pop("cleanup", None)
        for key in ("leftovers", "leftover_pids", "gpus", "gpu_processes"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values, cleanup=CleanupReport(**{k: tuple(v) for k, v in cleanup.items()}) if cleanup else None)

    def metadata(self) -> dict[str, Any]:
        """Flat values for check metadata."""
        out: dict[str, Any] = {
            "verdict": self.verdict,
            "leftover_processes": "; ".join(self.leftovers) or "none",
            "gpu_status": self.gpu_status,
            "gpu": self.warning or (
                "; ".join(f"GPU {g['index']}: {g['before_mib']} -> {g['after_mib']} MiB" for g in self.gpus) or "none used"),
        }
        if self.gpu_processes:
            out["gpu_processes"] = "; ".join(self.gpu_processes)
        if self.cleanup is not None:
            out["cleanup_terminated"] = "; ".join(self.cleanup.terminated) or "none"
            out["cleanup_killed"] = "; ".join(self.cleanup.killed) or "none"
            out["cleanup_remaining"] = "; ".join(self.cleanup.remaining) or "none"
        return out


def check_released(
    server: GpuServer,
    handle: RunHandle,
    *,
    wait_s: float = 10.0,
    poll_s: float = 0.5,
    tolerance_mib: int = GPU_RELEASE_TOLERANCE_MIB,
    cleanup: bool = False,
) -> ReleaseReport:
    """Prove that a finished run left nothing behind (processes, GPU memory).

    Waits up to ``wait_s`` for stragglers and for the driver to release memory,
    then reports what is left. With ``cleanup``, leftovers are then ended with
    :func:`cleanup_run` (the check still fails: the run did leave them).
    """
    deadline = time.monotonic() + wait_s
    while True:
        procs = run_processes(server, handle)
        inventory = server.gpu_inventory() if handle.gpu_ids else None
        gpus_ok = True
        gpu_rows: list[dict[str, Any]] = []
        if inventory is not None and inventory.status == "ok":
            after = gpu_memory(inventory, handle.gpu_ids)
            for index in handle.gpu_ids:
                before = handle.gpu_memory_before_mib.get(index)
                now = after.get(index)
                released = now is not None and (before is None or now <= before + tolerance_mib)
                gpus_ok &= released
                gpu_rows.append({"index": index, "before_mib": before, "after_mib": now, "released": released})
        if (not procs and gpus_ok) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)

    gpu_procs: list[str] = []
    warning = None
    if inventory is None:
        gpu_status = "no_gpu" if handle.gpu_status != "error" else "error"
        warning = CPU_RUN_NOTE
        gpu_note = f"{CPU_RUN_NOTE} (" + (
            "no GPU present)" if gpu_status == "no_gpu" else "nvidia-smi failed at launch, the run used the CPU)"
        )
    else:
        gpu_status = inventory.status
        if inventory.status == "ok":
            uuids = {g.uuid: g.index for g in inventory.gpus if g.index in handle.gpu_ids}
            gpu_procs = [
                f"pid {p.pid} {p.process_name} {p.used_memory_mib} MiB on GPU {uuids[p.gpu_uuid]}"
                for p in inventory.processes if p.gpu_uuid in uuids
            ]
            gpu_note = "; ".join(
                f"GPU {r['index']} {'released' if r['released'] else 'NOT released'} ({r['before_mib']} -> {r['after_mib']} MiB)"
                for r in gpu_rows
            )
        else:
            gpus_ok = False
            gpu_note = f"nvidia-smi now: {inventory.status}: {inventory.message}"
    leftovers = tuple(describe_process(p) for p in procs)
    passed = not procs and gpus_ok
    parts = [gpu_note] if warning else []
    parts.append(("leftover processes: " + "; ".join(leftovers)) if leftovers else "no process of the run is left")
    if not warning:
        parts.append(gpu_note)
    if gpu_procs and not gpus_ok:
        parts.append("compute processes on the run's GPUs: " + "; ".join(gpu_procs))
    report = ReleaseReport(
        passed=passed, leftovers=leftovers, leftover_pids=tuple(p.pid for p in procs), gpu_status=gpu_status,
        gpus=tuple(gpu_rows), gpu_processes=tuple(gpu_procs), message="; ".join(parts), warning=warning,
    )
    if cleanup and procs:
        report = dataclasses.replace(report, cleanup=cleanup_run(server, handle))
    return report


def save_release_report(server: GpuServer, handle: RunHandle, report: ReleaseReport) -> str:
    """Store the report next to the launch state (``release.json``); return its path."""
    return server.write_text(posixpath.join(handle.state_dir, RELEASE_NAME), json.dumps(report.to_dict(), indent=2) + "\n")


def load_release_report(server: GpuServer, handle: RunHandle) -> ReleaseReport | None:
    """The report stored by :func:`save_release_report`, or None."""
    path = posixpath.join(handle.state_dir, RELEASE_NAME)
    if not server.size(path):
        return None
    return ReleaseReport.from_dict(json.loads(server.read_text(path)))
