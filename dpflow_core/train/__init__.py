"""dpflow's built-in Diffusion Policy trainer.

Reads a ``dataset.npz`` replay buffer (``formats.md`` section 2) and writes the
run directory of ``formats.md`` section 3. Run it with
``python -m dpflow_core.train`` (or ``dpflow-train``, or under
``accelerate launch``); see :mod:`dpflow_core.train.app` for the command line.

Modules, in the order data flows:

- :mod:`~dpflow_core.train.data`: what is observed and predicted (the action
  definition), the sequence sampler with padding and latency, the episode split,
  the normaliser statistics;
- :mod:`~dpflow_core.train.sampler`: the resumable, distributed batch order;
- :mod:`~dpflow_core.train.normalizer`, :mod:`~dpflow_core.train.vision`,
  :mod:`~dpflow_core.train.unet`, :mod:`~dpflow_core.train.policy`: the model;
- :mod:`~dpflow_core.train.checkpoint`: what a checkpoint holds, atomic
  writes, top-k, :func:`load_network` (the raw module; robots use dpflow_core.inference);
- :mod:`~dpflow_core.train.workspace`: the training loop;
  :mod:`~dpflow_core.train.logs`: ``logs.json.txt``.

The names below are imported on first use, so ``import dpflow_core.train``
stays cheap (torch is loaded only when needed).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "load_network": "dpflow_core.train.checkpoint",
    "load_checkpoint": "dpflow_core.train.checkpoint",
    "required_checkpoint_entries": "dpflow_core.train.checkpoint",
    "missing_checkpoint_entries": "dpflow_core.train.checkpoint",
    "ObsActionSpec": "dpflow_core.train.data",
    "SequenceDataset": "dpflow_core.train.batches",
    "DiffusionUnetImagePolicy": "dpflow_core.train.policy",
    "read_json_log": "dpflow_core.train.logs",
    "train": "dpflow_core.train.workspace",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dpflow_core.train' has no attribute {name!r}")
