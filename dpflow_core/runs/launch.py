"""Launching: start a run (new or resumed) detached in tmux, or attach to the one already running.

Takes a server and a :class:`~dpflow_core.runs.spec.RunSpec`; gives the launch's
:class:`~dpflow_core.runs.state.RunHandle`. A new run refuses an existing directory; a resume first
verifies that ``latest.ckpt`` is complete.
"""

from __future__ import annotations

import json
import logging
import posixpath
import uuid
from typing import Literal

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.server import GpuInventory, GpuServer
from dpflow_core.runs.command import MachineRank, build_command
from dpflow_core.runs.gpus import choose_gpus, gpu_memory, require_gpus
from dpflow_core.runs.processes import describe_process, run_processes
from dpflow_core.runs.records import probe_checkpoint, reproducibility_record
from dpflow_core.runs.spec import (
    CHECKPOINT_DIR, HANDLE_NAME, LATEST_CKPT, OUTPUT_LOG, RECORD_NAME, RunSpec, run_environment, run_dir_for, utc_now,
)
from dpflow_core.runs.state import RunHandle, launch_indices, launch_state_dir, load_handle, mkdir_exclusive


log = logging.getLogger(__name__)


def _verify_dataset(server: GpuServer, spec: RunSpec) -> None:
    path = server.abspath(spec.dataset_path)
    if server.size(path) is None:
        raise DatasetError("dataset not found on the server", path=path, code="not_found")


def launch_run(
    server: GpuServer,
    spec: RunSpec,
    *,
    method: Literal["auto", "tmux", "setsid"] = "auto",
    record: bool = True,
    inventory: GpuInventory | None = None,
    machine: MachineRank | None = None,
    extra_env: dict[str, str] | None = None,
) -> RunHandle:
    """Start a run detached on the server (new run, or an explicit resume).

    A new run creates its run directory exclusively (an existing one is refused);
    a resume requires the directory, no live process of an earlier launch, and a
    complete ``latest.ckpt`` (:func:`probe_checkpoint`). GPUs are chosen from
    ``nvidia-smi`` now (:func:`choose_gpus`; a smoke run takes one, ``spec.gpu_ids``
    must all be free); a server that must have a GPU and has none usable is refused
    first (:func:`require_gpus`), before the run directory exists. The handle and
    the reproducibility record are written to ``<run_dir>/dpflow/launch-<k>/``.
    ``machine`` makes this launch one machine of a multi-machine run
    (:mod:`~dpflow_core.runs.multihost`); ``extra_env`` adds environment variables (such as
    ``GLOO_SOCKET_IFNAME``, or the Dagster Pipes bootstrap variables), exported by the
    wrapper script with shell quoting (:meth:`GpuServer.start_detached`).

    Raises:
        RunError: ``run_exists``, ``checkpoint_incomplete``, ``already_running``,
            ``gpu_unavailable``, ``no_free_gpu``, ``gpu_busy``, ``gpu_absent``, ``bad_template``;
            DatasetError when the dataset is missing.
    """
    run_dir = run_dir_for(server, spec.name)
    _verify_dataset(server, spec)
    # GPU ids come from nvidia-smi of this launch; a server that must have a GPU refuses before anything is created.
    inventory = inventory if inventory is not None else server.gpu_inventory()
    require_gpus(server, inventory)
    gpu_ids = choose_gpus(inventory, 1 if spec.kind == "smoke" else spec.num_processes, spec.gpu_ids)
    if spec.resume:
        if not server.exists(run_dir):
            raise RunError("resume requested but the run directory does not exist", path=run_dir, code="run_not_found")
        probe = probe_checkpoint(server, posixpath.join(run_dir, CHECKPOINT_DIR, LATEST_CKPT))
        if not probe.loadable:
            raise RunError(f"cannot resume: {probe.describe()}", path=probe.path, code="checkpoint_incomplete")
        indices = launch_indices(server, run_dir)
        if indices:
            try:
                previous = load_handle(server, spec.name, indices[-1])
            except RunError:
                previous = None
            if previous is not None:
                alive = run_processes(server, previous)
                if alive:
                    raise RunError(
                        f"run {spec.name!r} still has processes from launch {previous.launch_index}: "
                        + ", ".join(describe_process(p) for p in alive),
                        path=run_dir, code="already_running",
                    )
        index = (indices[-1] + 1) if indices else 0
        state_dir = launch_state_dir(run_dir, index)
        if not mkdir_exclusive(server, state_dir):
            raise RunError("another launch of this run is being prepared", path=state_dir, code="already_running")
    else:
        if not mkdir_exclusive(server, run_dir):
            raise RunError(
                "the run directory exists already: choose a new run name, or resume explicitly",
                path=run_dir, code="run_exists",
            )
        index = 0
        state_dir = launch_state_dir(run_dir, index)
        server.mkdir(state_dir)

    command, overrides, num_processes = build_command(server, spec, run_dir, gpu_ids, machine)
    token = f"{spec.name}.{uuid.uuid4().hex[:16]}"
    env = run_environment(run_dir, token, spec) | dict(extra_env or {})
    if machine is not None and not gpu_ids:
        env["ACCELERATE_USE_CPU"] = "true"
    cwd = server.config.repo_path or run_dir
    before = gpu_memory(inventory, gpu_ids)
    started_at = utc_now()
    detached = server.start_detached(
        spec.name, command, state_dir=state_dir, cwd=cwd, env=env,
        log_path=posixpath.join(state_dir, OUTPUT_LOG), method=method,
    )
    handle = RunHandle(
        spec=spec, run_dir=run_dir, state_dir=state_dir, launch_index=index, token=token, gpu_ids=tuple(gpu_ids),
        gpu_memory_before_mib=before, gpu_status=inventory.status, num_processes=num_processes, command=command,
        overrides=tuple(overrides), started_at=started_at, detached=detached,
    )
    server.write_text(posixpath.join(state_dir, HANDLE_NAME), json.dumps(handle.to_dict(), indent=2) + "\n")
    if record:
        rec = reproducibility_record(server, handle, inventory)
        server.write_text(posixpath.join(state_dir, RECORD_NAME), json.dumps(rec, indent=2) + "\n")
    log.info("launched %s (%s, pid %d) in %s: %s", spec.name, detached.method, detached.pid, run_dir, command)
    return handle


def attachable_handle(server: GpuServer, spec: RunSpec) -> RunHandle | None:
    """The launch of run ``spec.name`` that :func:`launch_or_attach` would attach to, else None.

    That is the latest launch when it still runs, or (without ``spec.resume``) when it ended.

    Raises:
        RunError: ``run_name_in_use``: that run was launched on another dataset (another SHA-256 when both
            are known, else another path): attaching would hand back a run of the wrong data as this one's.
    """
    run_dir = run_dir_for(server, spec.name)
    if not server.exists(run_dir):
        return None
    try:
        handle = load_handle(server, spec.name)
    except RunError:
        return None
    old = handle.spec
    both_hashed = bool(old.dataset_sha256 and spec.dataset_sha256)
    if (old.dataset_sha256 != spec.dataset_sha256) if both_hashed else (old.dataset_path != spec.dataset_path):
        what = lambda s: f"{s.dataset_path}" + (f" (sha256 {s.dataset_sha256[:12]})" if s.dataset_sha256 else "")  # noqa: E731
        raise RunError(f"run {spec.name!r} was launched on {what(old)}, not {what(spec)}: a run name belongs to one "
                       "dataset; choose another run name", code="run_name_in_use")
    status = server.detached_status(handle.detached)
    running = not status.finished and not status.vanished
    return handle if running or not spec.resume else None


def launch_or_attach(server: GpuServer, spec: RunSpec, **kwargs) -> tuple[RunHandle, bool]:
    """Attach to run ``spec.name`` when it was launched already, else launch it.

    A re-materialization (after the orchestrator died or the SSH connection
    dropped) finds the launch record and follows the running session instead of
    starting a second one. With ``spec.resume`` a finished earlier launch is
    resumed; a running one is attached to (:func:`attachable_handle`).

    Returns:
        (handle, attached): ``attached`` is True when nothing was launched.
    """
    handle = attachable_handle(server, spec)
    if handle is not None:
        return handle, True
    return launch_run(server, spec, **kwargs), False
