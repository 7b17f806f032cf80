"""Conversion of paired episodes into the ``dataset.npz`` replay buffer.

Two levels:

* :func:`align_episode` decodes one ``<STEM>_vio.mcap`` camera stream (PyAV,
  FFmpeg's H.264 decoder), resizes the frames with area averaging, and aligns
  pose and gripper width on the camera capture times (``header.timestamp``):
  position linearly, orientation by spherical linear interpolation (scipy
  ``Slerp``), gripper width linearly. Streams are trimmed to their overlap and
  ``pose_valid == false`` stretches are trimmed or rejected; every camera packet
  is decoded and a frame repeating a capture time dropped after decoding; camera
  holes longer than ``max_gap_s`` are never bridged (the episode is split into
  segments, :func:`split_segments`, or rejected). The LeRobot export reuses this
  function (with the ``reject`` gap policy).
* :func:`convert` runs :func:`align_episode` over the accepted episodes of a
  pairing manifest in worker processes and appends each episode's frames to one
  uncompressed ``.npz`` (layout: formats.md section 2, ``data__camera0_rgb``
  first) as soon as it and the episodes before it are aligned, then writes the
  other members, hashes the file and writes the ``dataset.json`` sidecar and
  ``norm_stats.json``.

The output is never overwritten: it is written to ``.<name>.partial-<pid>-s<start>`` in
the destination folder, fsynced and linked into place (``os.link`` fails when
the name exists), so a kill at any moment leaves no new file or a complete one.
Workers exit when the converting process dies (``PR_SET_PDEATHSIG`` and a watch
of its PID), and a conversion removes, and names, the ``partial`` / ``work`` (and any
``tmp``) leftovers of runs no longer running in its output folder
(:func:`dpflow_core.files.remove_stale_temporaries`: the name records the owner's PID and start time).

Modules: :mod:`~dpflow_core.conversion.settings` (:class:`ConversionSettings`: every option that decides a
dataset's content, declared once, with its CLI flag and Dagster config field),
:mod:`~dpflow_core.conversion.align` (one episode; :mod:`~dpflow_core.conversion.trim`: which of its frames are
kept), :mod:`~dpflow_core.conversion.decode`
(H.264 to resized RGB, streamed to a scratch file), :mod:`~dpflow_core.conversion.gaps` (camera holes),
:mod:`~dpflow_core.conversion.inputs` (manifest in, episodes and keys out), :mod:`~dpflow_core.conversion.jobs` (the job runner),
:mod:`~dpflow_core.conversion.install` (outputs into place), :mod:`~dpflow_core.conversion.rates` (an episode
at another rate: resampled, its own dataset, or rejected), :mod:`~dpflow_core.conversion.metadata` and
:mod:`~dpflow_core.conversion.dataset_npz` (:func:`convert`);
the zip writer lives beside the reader in :mod:`dpflow_core.replay_buffer`, the per-episode cache in
:mod:`dpflow_core.episode_cache` (outside this package, so ``dpflow cache`` starts without the decoding stack). The names other code
uses are re-exported here, each loaded on first use.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

# Names are imported from their module on first use (PEP 562): importing one submodule, or this package, does
# not load the others and their dependencies (``dpflow convert --help`` reads the settings without NumPy).
__getattr__, __dir__ = lazy_exports(__name__, {
    "CONVERTER_VERSION": "align",
    "DEFAULT_MAX_GAP_S": "settings",
    "DEFAULT_MIN_SEGMENT_FRAMES": "settings",
    "GAP_POLICIES": "settings",
    "INVALID_POSE_POLICIES": "settings",
    "LOWDIM_KEYS": "align",
    "METADATA_VERSION": "metadata",
    "SWS_FLAGS": "decode",
    "AlignedEpisode": "align",
    "ConversionInputs": "inputs",
    "ConversionResult": "dataset_npz",
    "ConversionSettings": "settings",
    "EpisodeInput": "inputs",
    "align_episode": "align",
    "align_job_episode": "jobs",
    "alignment_job": "jobs",
    "convert": "dataset_npz",
    "split_segments": "align",
    "dataset_key": "inputs",
    "dataset_path_in": "inputs",
    "load_inputs": "inputs",
    "norm_stats_path_for": "inputs",
    "sidecar_path_for": "inputs",
})

__all__ = [
    "CONVERTER_VERSION", "DEFAULT_MAX_GAP_S", "DEFAULT_MIN_SEGMENT_FRAMES", "GAP_POLICIES", "INVALID_POSE_POLICIES",
    "LOWDIM_KEYS", "METADATA_VERSION", "SWS_FLAGS", "AlignedEpisode", "ConversionInputs", "ConversionResult",
    "ConversionSettings", "EpisodeInput", "align_episode", "align_job_episode", "alignment_job", "convert",
    "split_segments", "dataset_key", "dataset_path_in", "load_inputs", "norm_stats_path_for", "sidecar_path_for",
]
