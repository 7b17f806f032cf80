"""Training batches: the torch ``Dataset`` that cuts samples out of a replay buffer and gathers their frames.

What a sample holds (its keys, times and representation) is :mod:`dpflow_core.train.data`'s;
this module is how batches of them are built fast: frames copied once from the memory map
into a preallocated batch buffer, and, in DataLoader workers, shared-memory buffers reused
batch after batch. The trainer, :mod:`dpflow_core.inference` and the benchmarks use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train.data import (
    ObsActionSpec,
    encode_action,
    encode_obs,
    lowdim_arrays,
    obs_positions,
    read_raw,
    sequence_index,
)


def gather_frames(frames: np.ndarray, steps: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Frames ``steps`` of an image array, copied once, straight into ``out``.

    Args:
        frames: ``(T, H, W, 3)`` uint8, typically a memory-mapped replay-buffer member.
        steps: ``(N, To)`` int buffer steps, each in ``[0, T)``.
        out: ``(N, To, H, W, 3)`` uint8 C-contiguous destination (a preallocated batch
            buffer, e.g. shared memory); None allocates one.

    Returns:
        ``out``, filled: ``out[n, k] == frames[steps[n, k]]``. Each frame is copied
        exactly once, from the memory map into ``out`` (fancy indexing followed by
        ``np.stack`` would copy it twice).

    Raises:
        ValueError: ``out`` has the wrong shape or dtype, or is not C-contiguous.
    """
    steps = np.asarray(steps, dtype=np.int64)
    shape = steps.shape + tuple(frames.shape[1:])
    if out is None:
        out = np.empty(shape, dtype=frames.dtype)
    elif out.shape != shape or out.dtype != frames.dtype or not out.flags.c_contiguous:
        raise ValueError(
            f"batch buffer must be a C-contiguous {frames.dtype} array of shape {shape}, "
            f"got {out.dtype} {out.shape}"
        )
    flat = out.reshape((-1,) + tuple(frames.shape[1:]))
    src = np.asarray(frames)  # a plain view: indexing a np.memmap makes a memmap object per frame
    for j, step in enumerate(steps.reshape(-1).tolist()):
        flat[j] = src[step]
    return out


def _shared_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in shared memory (as ``torch.utils.data.default_collate`` makes them in a worker)."""
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
    return torch.empty(0, dtype=dtype).new(storage).view(shape)


def pass_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """``collate_fn`` for a DataLoader over :class:`SequenceDataset`: the batch is already built.

    With a ``batch_sampler`` the DataLoader calls :meth:`SequenceDataset.__getitems__` once
    per batch (``torch.utils.data._utils.fetch``) and hands its result to ``collate_fn``.
    """
    return batch


class SequenceDataset(Dataset):
    """Training samples over a replay buffer: observation history plus action horizon, as the network sees them.

    ``dataset[i]`` is ``{"obs": {rgb_key: (To, H, W, 3) uint8 tensor, lowdim_key:
    (To, D') float32 tensor}, "action": (H, 10) float32 tensor}`` in the
    spec's representation (see the module docstring). Images stay uint8 so that
    worker processes send 4x less data; the policy converts them on the device.
    The low-dimensional arrays are read into memory once (they are small).

    A DataLoader builds whole batches with :meth:`__getitems__`: pass a
    ``batch_sampler`` and ``collate_fn=pass_batch``. Each batch holds the same values
    a per-sample ``dataset[i]`` plus ``default_collate`` gives, but its frames are
    gathered straight into one preallocated buffer per image key.

    In a DataLoader worker those buffers are shared-memory tensors that the worker
    allocates once and then cycles through, ``worker_buffers`` of them: a fresh
    shared-memory batch costs a page fault per 4 KiB page (on a 2-vCPU VM, 40-100 ms
    for the 19 MB of a 64 x 2 x 224 x 224 x 3 batch, more than gathering it), and
    the main process's ``torch.multiprocessing`` receive cache maps a reused buffer
    once. A buffer is written again ``worker_buffers`` batches of the same worker
    later; the DataLoader keeps at most ``prefetch_factor`` batches per worker in
    flight, so with ``worker_buffers >= prefetch_factor + 2`` (the default 4 for the
    default ``prefetch_factor`` 2) a batch stays intact while the consumer uses it and
    while it takes the next one. A consumer that keeps batches longer must copy them
    (``pin_memory`` does: it copies each batch on arrival).

    Args:
        buffer: the replay buffer (memory-mapped; safe to pass to worker processes).
        spec: what to observe and predict.
        episode_mask: ``(E,)`` bool, the episodes this dataset draws from.
        worker_buffers: image batch buffers each worker cycles through (>= 2).

    Raises:
        ValueError: ``worker_buffers`` below 2.
    """

    def __init__(
        self, buffer: ReplayBuffer, spec: ObsActionSpec, episode_mask: np.ndarray, worker_buffers: int = 4
    ):
        if int(worker_buffers) < 2:
            raise ValueError(f"worker_buffers must be >= 2, got {worker_buffers}")
        self.buffer = buffer
        self.spec = spec
        self.index = sequence_index(buffer.episode_ends, np.asarray(episode_mask, dtype=bool), spec)
        self.lowdim = lowdim_arrays(buffer, spec)
        self.worker_buffers = int(worker_buffers)
        self._ring: dict[str, list[torch.Tensor]] = {}  # per process: filled in a worker, after the fork
        self._turn = 0

    def __len__(self) -> int:
        return len(self.index)

    def samples(self, indices: Sequence[int], rgb_out: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Samples ``indices`` stacked: ``{"obs": {key: (N, To, ...)}, "action": (N, H, 10), "base": (N, 4, 4)}``.

        numpy arrays; ``base`` is the current TCP pose of each sample (float64, dataset
        world frame), what :func:`decode_action` needs to make predictions absolute.
        ``rgb_out``: per image key, a preallocated ``(N, To, H, W, 3)`` uint8 buffer the
        frames are gathered into (:func:`gather_frames`); missing keys are allocated.
        """
        rows = self.index[np.asarray(indices, dtype=np.int64)]
        raw = read_raw(self.lowdim, self.spec, rows)
        obs, base = encode_obs(raw, self.spec)
        for key in self.spec.rgb_keys:
            steps = obs_positions(self.spec, key, rows).astype(np.int64)
            obs[key] = gather_frames(self.buffer[key], steps, None if rgb_out is None else rgb_out.get(key))
        return {"obs": obs, "action": encode_action(raw["action"], base, self.spec), "base": base}

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples([i])
        return {
            "obs": {k: torch.from_numpy(np.ascontiguousarray(v[0])) for k, v in s["obs"].items()},
            "action": torch.from_numpy(s["action"][0]),
        }

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        """One batch of samples ``indices``, the layout of a default-collated DataLoader batch.

        ``{"obs": {rgb_key: (N, To, H, W, 3) uint8, lowdim_key: (N, To, D') float32},
        "action": (N, H, 10) float32}`` tensors. The frames are copied once, from the
        memory map into the batch tensor; in a DataLoader worker that tensor is one of
        the worker's reused shared-memory buffers (see the class docstring).
        """
        n, to = len(indices), self.spec.n_obs_steps
        in_worker = torch.utils.data.get_worker_info() is not None
        rgb = {}
        for key in self.spec.rgb_keys:
            shape = (n, to) + tuple(self.buffer[key].shape[1:])
            rgb[key] = self._worker_buffer(key, shape) if in_worker else torch.empty(shape, dtype=torch.uint8)
        self._turn += 1
        s = self.samples(indices, rgb_out={k: t.numpy() for k, t in rgb.items()})
        obs = {k: rgb[k] if k in rgb else torch.from_numpy(v) for k, v in s["obs"].items()}
        return {"obs": obs, "action": torch.from_numpy(s["action"])}

    def _worker_buffer(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """This worker's next shared-memory buffer for ``key``, viewed as ``shape`` (grown when too small)."""
        ring = self._ring.setdefault(key, [])
        slot = self._turn % self.worker_buffers
        size = math.prod(shape)
        if slot >= len(ring):
            ring.append(_shared_tensor((size,), torch.uint8))
        elif ring[slot].numel() < size:
            ring[slot] = _shared_tensor((size,), torch.uint8)
        return ring[slot][:size].view(shape)

    def collate(self, indices: Sequence[int]) -> dict[str, Any]:
        """One batch built in this process from sample ``indices`` (same layout as a DataLoader batch)."""
        return self.__getitems__(indices)
