"""Batch order that depends only on (seed, epoch) and resumes mid-epoch.

Each epoch's order is a permutation drawn from
``numpy.random.default_rng([seed, epoch])``, so it is the same in a run that
was interrupted and resumed as in one that ran straight through, independent
of any other random state. Under ``accelerate launch`` the permutation is
padded by wrapping to a multiple of the process count (as
``torch.utils.data.DistributedSampler`` does) and process ``r`` takes
positions ``r, r + N, ...``, so every process sees the same number of batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler


class EpochBatchSampler(Sampler[list[int]]):
    """Batches of sample indices for one process, resumable at any batch.

    Args:
        n_samples: dataset length (> 0).
        batch_size: samples per batch for this process.
        shuffle: draw a new permutation per epoch (else keep dataset order).
        seed: base seed of the permutations.
        num_replicas: number of processes.
        rank: this process's index in ``[0, num_replicas)``.
        max_batches: cap on batches per epoch (``training.max_train_steps``); None: no cap.
        drop_last: drop the last, incomplete batch.

    Raises:
        ValueError: for an empty dataset or inconsistent arguments.
    """

    def __init__(
        self,
        n_samples: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        max_batches: int | None = None,
        drop_last: bool = False,
    ):
        if n_samples <= 0:
            raise ValueError("the dataset has no samples")
        if batch_size < 1 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"bad batch_size={batch_size}, num_replicas={num_replicas}, rank={rank}")
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 or None, got {max_batches}")
        self.n_samples = int(n_samples)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.max_batches = None if max_batches is None else int(max_batches)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.start_batch = 0

    @property
    def samples_per_replica(self) -> int:
        return math.ceil(self.n_samples / self.num_replicas)

    def batches_per_epoch(self) -> int:
        """Batches each process runs per epoch (after ``max_batches``)."""
        n = self.samples_per_replica
        full = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return full if self.max_batches is None else min(full, self.max_batches)

    def epoch_indices(self, epoch: int) -> np.ndarray:
        """This process's sample order for ``epoch``: ``(samples_per_replica,)`` int64."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, int(epoch)]).permutation(self.n_samples)
        else:
            order = np.arange(self.n_samples)
        total = self.samples_per_replica * self.num_replicas
        if total > self.n_samples:
            order = np.resize(order, total)  # wraps around
        return order[self.rank :: self.num_replicas].astype(np.int64)

    def batch(self, epoch: int, batch_index: int) -> list[int]:
        """Sample indices of batch ``batch_index`` of ``epoch`` for this process."""
        idx = self.epoch_indices(epoch)
        return idx[batch_index * self.batch_size : (batch_index + 1) * self.batch_size].tolist()

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch the next iteration runs, starting at batch ``start_batch``."""
        if not 0 <= start_batch <= self.batches_per_epoch():
            raise ValueError(f"start_batch {start_batch} outside [0, {self.batches_per_epoch()}]")
        self.epoch = int(epoch)
        self.start_batch = int(start_batch)

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.epoch_indices(self.epoch)
        for b in range(self.start_batch, self.batches_per_epoch()):
            yield idx[b * self.batch_size : (b + 1) * self.batch_size].tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch() - self.start_batch

    def state_dict(self) -> dict[str, Any]:
        """Everything that fixes the data order (plain Python values)."""
        return {
            "n_samples": self.n_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "max_batches": self.max_batches,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "start_batch": self.start_batch,
        }

    def order_differences(self, state: dict[str, Any]) -> list[str]:
        """Settings in ``state`` (from a checkpoint) that would change the data order here."""
        keys = ("n_samples", "batch_size", "shuffle", "seed", "num_replicas", "max_batches", "drop_last")
        return [
            f"{k}: checkpoint {state.get(k)!r}, now {getattr(self, k)!r}"
            for k in keys
            if state.get(k) != getattr(self, k)
        ]
