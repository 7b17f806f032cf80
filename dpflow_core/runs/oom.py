"""OOM advice: recognise CUDA out-of-memory in a run's output and say what to change.

Takes the run's output text and its batch size; gives a one-paragraph advice (smaller batch size,
fewer workers) or ``None``.
"""

from __future__ import annotations

import re

from dpflow_core.server import GpuInventory
from dpflow_core.runs.state import RunHandle


_OOM_PATTERN = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED")


# ------------------------------------------------------------------------ OOM advice


def is_out_of_memory(text: str) -> bool:
    """True when a process output shows a CUDA out-of-memory error."""
    return bool(_OOM_PATTERN.search(text or ""))


def oom_advice(
    handle: RunHandle,
    *,
    batch_size: int | None = None,
    val_batch_size: int | None = None,
    gradient_accumulate_every: int | None = None,
    inventory: GpuInventory | None = None,
) -> list[str]:
    """What to try after a CUDA out-of-memory failure, in the manual's order (rule 9).

    Leftovers on the GPUs first, then a smaller per-process batch, then a smaller
    validation batch, then gradient accumulation to keep the effective batch, then
    image/model size; mixed precision last and only where the loop supports its
    scaler. Values come from the run's resolved config when given.
    """
    steps = []
    if inventory is not None and inventory.status == "ok":
        used = [g for g in inventory.gpus if g.index in handle.gpu_ids]
        others = [p for g in used for p in inventory.processes_on(g.uuid)]
        if others:
            steps.append(
                "1. Leftovers first: the run's GPUs still hold "
                + ", ".join(f"pid {p.pid} {p.process_name} ({p.used_memory_mib} MiB)" for p in others)
                + "; end those proven to be yours (the release check names them) before anything else."
            )
        else:
            steps.append("1. Leftovers first: nvidia-smi shows no other process on GPUs "
                         f"{','.join(map(str, handle.gpu_ids))} now; check that none ran there when the run failed.")
    else:
        steps.append("1. Leftovers first: check nvidia-smi for processes already on the run's GPUs before the launch.")
    b = batch_size or handle.spec.batch_size
    steps.append(
        f"2. Smaller per-process batch: dataloader.batch_size={max(1, b // 2)} (now {b})." if b
        else "2. Smaller per-process batch: halve dataloader.batch_size (it is per process)."
    )
    vb = val_batch_size or b
    steps.append(
        f"3. Smaller validation batch: val_dataloader.batch_size={max(1, vb // 2)} (now {vb})." if vb
        else "3. Smaller validation batch: halve val_dataloader.batch_size."
    )
    g = gradient_accumulate_every or 1
    steps.append(
        f"4. Keep the effective batch with gradient accumulation: training.gradient_accumulate_every={2 * g} "
        "together with the halved batch."
    )
    steps.append("5. Image or model size: convert at a smaller --image-size, or shrink policy.unet.down_dims / policy.obs_encoder.")
    steps.append(
        "6. Mixed precision last, and only where the training loop supports its grad scaler: "
        "training.mixed_precision=bf16 (the built-in trainer saves the fp16 scaler for resume)."
    )
    return steps
