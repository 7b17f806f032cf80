"""GPU choice: which GPUs a run may use.

Takes the current ``nvidia-smi`` inventory (:class:`~dpflow_core.server.GpuInventory`); gives the free
GPU indices (no compute process, at most :data:`FREE_GPU_MAX_USED_MIB` MiB used) and their used memory (MiB).
"""

from __future__ import annotations

from typing import Sequence

from dpflow_core.errors import RunError
from dpflow_core.server import GpuInventory


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


def choose_gpus(inventory: GpuInventory, num_processes: int) -> list[int]:
    """GPU ids for a run from the current inventory: ``num_processes`` free GPUs (0 = all free ones).

    Returns [] when the server has no GPU (the run then uses one CPU process).

    Raises:
        RunError: ``no_free_gpu`` when GPUs exist but too few are free (naming what runs on them).
    """
    if inventory.status != "ok":
        return []
    free = free_gpus(inventory)
    want = len(free) if num_processes == 0 else int(num_processes)
    if want == 0 or len(free) < want:
        busy = "; ".join(
            f"GPU {g.index}: {g.memory_used_mib} MiB used, processes "
            + (", ".join(f"{p.pid} {p.process_name}" for p in inventory.processes_on(g.uuid)) or "none")
            for g in inventory.gpus if g.index not in free
        )
        raise RunError(
            f"{len(free)} free GPU(s) of {len(inventory.gpus)}, {want or 'at least 1'} needed ({busy})",
            code="no_free_gpu",
        )
    return free[:want]


def gpu_memory(inventory: GpuInventory, indices: Sequence[int]) -> dict[int, int | None]:
    """Memory in use (MiB) of the given GPUs."""
    by_index = {g.index: g for g in inventory.gpus}
    return {i: (by_index[i].memory_used_mib if i in by_index else None) for i in indices}
