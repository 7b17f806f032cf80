"""Exact pairing of Matrix Studio outputs into a manifest of episodes.

A Matrix Studio task folder (formats.md section 1) holds, per recording, three
files with one exact stem::

    <STEM>.mcap  <STEM>_vio.mcap  <STEM>_vio.json

plus the task-level ``vio_result.json``. :func:`pair_recordings` accepts a stem
only when all three files are present inside the task folder, non-empty, the
status file says success (cross-checked with ``vio_result.json`` when present)
and both MCAP files pass :func:`dpflow_core.recordings.inspect_recording`.
Everything else is listed as rejected with a stable ``code`` and a ``reason``
naming the file; one bad episode never stops the others.

Naming rules (file names directly in the task folder; hidden files ignored):

- ``<STEM>_vio.mcap`` / ``<STEM>_vio.json`` belong to ``<STEM>``; any other
  ``<NAME>.mcap`` is the raw recording of stem ``<NAME>``.
- Dual-arm merged files (a stem containing ``.merge``, e.g. ``X.merge.mcap``)
  are rejected: ``unsupported_multi_arm`` (single-arm only), as is any file carrying
  ``/robotN/...`` topics of a second arm (found by inspection), so no arm is dropped silently.
- Retry duplicates: a stem ``<BASE>_retry<N>``, ``<BASE>-retry<N>`` or
  ``<BASE> (<N>)`` (a copy made by a file manager) whose ``<BASE>`` also has
  files in the folder is rejected: ``retry_duplicate``; exact pairing uses
  ``<BASE>``'s files. To use a retry instead, list it in an explicit manifest.
- ``.mcap`` files in subfolders of the task folder belong to another task or
  run: ``other_task``; so do stems whose ``_vio.json`` (keys ``task_name`` or
  ``task``) or ``vio_result.json`` (``task_name``) name a different task.
- A lone ``<NAME>.mcap`` (no ``_vio`` partners) whose summary section lacks
  the camera or gripper topic is another kind of MCAP (e.g. a ROS 2 bag):
  ``missing_topics``, "not a Matrix Studio recording: missing topics ...";
  otherwise it is a raw recording waiting for VIO: ``missing_partner``.
- A file that is a symbolic link resolving outside the task folder, or an
  explicit-manifest path with ``..`` leading outside it: ``path_escapes_root``.

Reject codes: ``path_escapes_root``, ``unsupported_multi_arm``, ``unreadable`` (an OS
error, or a directory/FIFO where a file was expected), ``invalid_stem``,
``retry_duplicate``, ``missing_partner``, ``missing_file``, ``empty_file``,
``unparseable_status``, ``other_task``, ``failed_status``,
``status_not_final``, ``unknown_status``, ``status_conflict``,
``duplicate_stem``, ``invalid_manifest_entry``, ``duplicate_episode`` (a later copy
of an accepted episode: same ``_vio.mcap`` SHA-256, or the same camera payload
re-muxed; or a byte copy of an earlier episode in a sibling task folder, both paths named:
:mod:`~dpflow_core.pairing.across`), ``status_stem_mismatch`` (the ``_vio.json`` names another stem), and the error codes of
:func:`~dpflow_core.recordings.inspect_recording` (``truncated_mcap``,
``missing_closing_magic``, ``corrupt_mcap``, ``unknown_encoding``, ...).

The result is a :class:`Manifest`, written as JSON by :func:`write_manifest`
and read back by :func:`load_manifest` (the conversion stage's input).

Modules, in the order a task folder meets them:

- :mod:`~dpflow_core.pairing.tasks`: which folder is a task folder (the CLI, the sensor and the
  Dagster partitions share these rules);
- :mod:`~dpflow_core.pairing.watch`: the recordings sensor's incremental scan for finished,
  stable recordings (unchanged task folders skipped by mtime, a bounded cursor);
- :mod:`~dpflow_core.pairing.naming`: which file belongs to which stem;
- :mod:`~dpflow_core.pairing.explicit`: the explicit manifest, for naming schemes that differ;
- :mod:`~dpflow_core.pairing.status`: the ``_vio.json`` and ``vio_result.json`` status files;
- :mod:`~dpflow_core.pairing.checks`: the checks each stem goes through, in order;
- :mod:`~dpflow_core.pairing.across`: copies of an episode in the other task folders of the same output root;
- :mod:`~dpflow_core.pairing.pair`: :func:`pair_recordings`, the entry point;
- :mod:`~dpflow_core.pairing.manifest`: the manifest's types, and how it is written, named and read.

The public names are re-exported here and imported from their module on first use (PEP 562),
so the sensor's scan does not load the MCAP reader.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "MANIFEST_VERSION": "manifest",
    "ROLES": "manifest",
    "AcceptedEpisode": "manifest",
    "FileEntry": "manifest",
    "Manifest": "manifest",
    "PairedEpisodes": "manifest",
    "PairingReject": "manifest",
    "load_manifest": "manifest",
    "manifest_from_dict": "manifest",
    "manifest_path_for": "manifest",
    "read_manifest_json": "manifest",
    "reject_summary": "manifest",
    "save_manifest": "manifest",
    "topic_map_from_dict": "manifest",
    "topic_map_to_dict": "manifest",
    "write_manifest": "manifest",
    "split_name": "naming",
    "parse_vio_status": "status",
    "pair_recordings": "pair",
    "load_source": "pair",
    "manifest_file_for": "pair",
    "holds_recordings": "tasks",
    "resolve_task_folder": "tasks",
    "task_folder": "tasks",
    "task_folders": "tasks",
})

__all__ = [
    "MANIFEST_VERSION", "ROLES", "AcceptedEpisode", "FileEntry", "Manifest", "PairedEpisodes", "PairingReject",
    "load_manifest", "load_source", "manifest_file_for", "manifest_from_dict", "manifest_path_for", "pair_recordings", "parse_vio_status",
    "read_manifest_json", "reject_summary", "save_manifest", "split_name", "topic_map_from_dict",
    "topic_map_to_dict", "write_manifest", "holds_recordings", "resolve_task_folder", "task_folder", "task_folders",
]
