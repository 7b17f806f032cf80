"""GPU choice: which GPUs a run may use.

Takes the current ``nvidia-smi`` inventory (:class:`~dpflow_core.server.GpuInventory`) of this launch;
gives the free GPU indices (no compute process, at most :data:`FREE_GPU_MAX_USED_MIB` MiB used) and their
used memory (MiB). :func:`require_gpus` refuses a launch on a server that must have a GPU but has none
usable; :func:`choose_gpus` refuses requested ids that are busy or absent, naming what runs on them.
"""

from __future__ import annotations

from typing import Sequence

from dpflow_core.errors import RunError
from dpflow_core.server import GpuInventory, GpuServer, gpu_problem


#: A GPU counts as free when it has no compute process and at most this much memory in use.
FREE_GPU_MAX_USED_MIB = 1024


# ---------------------------------------------------------------------------- GPUs


def free_gpus(inventory: GpuInventory, max_used_mib: int = FREE_GPU_MAX_USED_MIB) -> list[int]:
    """Indices of GPUs with no compute process and at most ``max_used_mib`` MiB in use (from nvidia-smi)."""
    if inventory.status != "ok":
        return []
    out = []
    for gpu in inventory.gpus:
        if inventory.processes_on(gpu.uuid):
            continue
        if gpu.memory_used_mib is not None and gpu.memory_used_mib > max_used_mib:
            continue
        out.append(gpu.index)
    return out


def require_gpus(server: GpuServer, inventory: GpuInventory) -> None:
    """Refuse to launch on a server that must have a GPU (:attr:`ServerConfig.gpu_expected`) but has none usable.

    Raises:
        RunError: ``gpu_unavailable``, naming the nvidia-smi command, its exit status and output.
    """
    problem = gpu_problem(inventory, server.config.gpu_expected)
    if problem:
        raise RunError(
            f"refusing to start on {server.config.describe()}: {problem} "
            "(fix the driver, or pass --no-expect-gpu / expect_gpu: false to train on its CPU)",
            code="gpu_unavailable",
        )


def _describe_gpu(inventory: GpuInventory, index: int) -> str:
    gpu = next(g for g in inventory.gpus if g.index == index)
    procs = ", ".join(
        f"pid {p.pid} {p.process_name} ({p.used_memory_mib} MiB)" for p in inventory.processes_on(gpu.uuid)
    ) or "no compute process"
    return f"GPU {index}: {gpu.memory_used_mib} MiB used, {procs}"


def choose_gpus(inventory: GpuInventory, num_processes: int, requested: Sequence[int] = ()) -> list[int]:
    """GPU ids for a run from the current inventory.

    Args:
        inventory: nvidia-smi of this launch.
        num_processes: free GPUs wanted (0 = all free ones); ignored when ``requested`` is given.
        requested: explicit GPU indices; each must be listed now and free.

    Returns:
        The indices ([] when the server has no GPU: the run then uses one CPU process).

    Raises:
        RunError: ``no_free_gpu`` when GPUs exist but too few are free, ``gpu_busy`` when a
            requested GPU runs something, ``gpu_absent`` when nvidia-smi does not list it
            (each names what runs on the GPUs).
    """
    free = free_gpus(inventory)
    if requested:
        listed = {g.index for g in inventory.gpus} if inventory.status == "ok" else set()
        absent = [int(i) for i in requested if int(i) not in listed]
        if absent:
            now = "; ".join(_describe_gpu(inventory, i) for i in sorted(listed)) or (inventory.message or "no GPU listed")
            raise RunError(f"requested GPU(s) {absent} not listed by nvidia-smi now ({now})", code="gpu_absent")
        busy = [int(i) for i in requested if int(i) not in free]
        if busy:
            raise RunError(
                f"requested GPU(s) {busy} busy: " + "; ".join(_describe_gpu(inventory, i) for i in busy), code="gpu_busy"
            )
        return [int(i) for i in requested]
    if inventory.status != "ok":
        return []
    want = len(free) if num_processes == 0 else int(num_processes)
    if want == 0 or len(free) < want:
        busy = "; ".join(_describe_gpu(inventory, g.index) for g in inventory.gpus if g.index not in free)
        raise RunError(
            f"{len(free)} free GPU(s) of {len(inventory.gpus)}, {want or 'at least 1'} needed ({busy})",
            code="no_free_gpu",
        )
    return free[:want]


def gpu_memory(inventory: GpuInventory, indices: Sequence[int]) -> dict[int, int | None]:
    """Memory in use (MiB) of the given GPUs."""
    by_index = {g.index: g for g in inventory.gpus}
    return {i: (by_index[i].memory_used_mib if i in by_index else None) for i in indices}
