"""The dataset's metadata document (``meta__info_json`` and ``dataset.json``), from the episodes a conversion kept.

Takes the conversion's inputs, the kept parts' summaries, the rejects and settings; gives the dict
:func:`~dpflow_core.conversion.dataset_npz.convert` writes (its layout: docs/formats.md).
"""

from __future__ import annotations

import av
import numpy as np

from dpflow_core import __version__
from dpflow_core.conversion.align import CONVERTER_VERSION
from dpflow_core.offsets import offset_warnings, task_offsets

#: Schema version of the metadata JSON (``meta__info_json`` member and sidecar).
METADATA_VERSION = 1


def derived_from(curation: dict | None) -> dict:
    """``{"derived_from": {...}}`` for an input that is a trimmed copy (a curated manifest's
    ``validation["curation"]["trim"]``, :func:`dpflow_core.curation.apply.trim_recording`), else ``{}``.

    The record names what the copy was made from and which of its stretches it holds: ``role``
    (``vio_mcap``), ``path``, ``size_bytes`` and ``sha256`` of the source recording, ``by``
    (``dpflow curate``), ``cut_s`` (``[start_s, end_s)`` stretches left out) and ``kept_s`` (the spans kept),
    both in seconds from the source's first camera frame.
    """
    trim = (curation or {}).get("trim")
    if not isinstance(trim, dict) or "source" not in trim:
        return {}
    return {"derived_from": {
        "role": "vio_mcap", "path": trim["source"], "size_bytes": trim.get("source_size_bytes"),
        "sha256": trim.get("source_sha256"), "by": "dpflow curate (idle stretches trimmed)",
        "cut_s": [[c.get("start_s"), c.get("end_s")] for c in trim.get("cuts", [])], "kept_s": trim.get("kept_s"),
    }}


def dataset_metadata(inputs, ok: list[dict], rejected: list[dict], options: dict, key: str, frequency_hz: float,
                     members: list, stamp, stale: list[str]) -> dict:
    """The dataset's metadata document (layout: docs/formats.md), with the run-only and the hash fields
    (``workers``, ``timings_s``, ``wall_time_s``, ``sha256``, ``size_bytes``) still None.

    Args:
        inputs: the conversion's :class:`~dpflow_core.conversion.inputs.ConversionInputs`.
        ok: the kept parts' summaries, in dataset order (``stem``, ``n`` frames, ``report``, ``ranges``,
            ``cached``, ``seconds``, ``peak_rss_mb``, ``start_ts_ns``).
        rejected: the episodes left out, ``{stem, stage, path, code, reason}`` each.
        options: the settings as recorded (:meth:`~dpflow_core.conversion.settings.ConversionSettings.options`;
            its ``image_size`` is the dataset's, (W, H) pixels).
        key: the dataset key (64 hex digits).
        frequency_hz: the dataset's measured frequency, Hz.
        members: the npz members (:class:`~dpflow_core.replay_buffer.writer.NpzMember`: name, shape, dtype).
        stamp: the creation time (an aware ``datetime``).
        stale: names of stale temporaries the conversion removed.
    """
    lengths = np.array([r["n"] for r in ok], dtype=np.int64)
    ranges: dict[str, dict] = {}
    for r in ok:
        for k, v in r["ranges"].items():
            if k not in ranges:
                ranges[k] = {"min": v["min"], "max": v["max"]}
            else:
                ranges[k]["min"] = np.minimum(ranges[k]["min"], v["min"]).tolist()
                ranges[k]["max"] = np.maximum(ranges[k]["max"], v["max"]).tolist()
    by_stem = {e.stem: e for e in inputs.episodes}
    episodes, start = [], 0
    for r in ok:
        rep = r["report"]
        episodes.append({
            "stem": r["stem"],
            "start": start,
            "length": r["n"],
            "start_ts_ns": r.get("start_ts_ns"),
            "frequency_hz": rep["frequency_hz"],
            "duration_s": rep["duration_s"],
            "trimmed_s": rep["trimmed_s"],
            "coverage": rep["coverage"],
            "gaps": rep["gaps"],
            "long_gaps": rep["long_gaps"],
            "segment": rep.get("segment"),
            "resampled": rep.get("resampled"),
            "pose_gaps": rep["pose_gaps"],
            "pose_invalid": rep["pose_invalid"],
            "plausibility": {k: v for k, v in (rep.get("plausibility") or {}).items() if k != "options"},
            **(rep.get("offsets") or {}),
            "short_episode": rep.get("short_episode") or [],
            "leading_undecodable_packets": rep["leading_undecodable_packets"],
            "undecodable_packets": rep["undecodable_packets"],
            "damaged_frames": rep.get("damaged_frames") or [],
            "cached": r["cached"],
            "convert_seconds": round(r["seconds"], 3),
            "worker_peak_rss_mb": round(r["peak_rss_mb"], 1),
            # a curated manifest's decision (a person's keep or the automatic one) travels into the dataset
            **({"curation": by_stem[r["stem"]].curation} if by_stem[r["stem"]].curation else {}),
        })
        start += r["n"]
    offsets = task_offsets(episodes)
    return {
        "metadata_version": METADATA_VERSION,
        "format": "replay_buffer_npz",
        "converter": {"name": "dpflow.conversion", "version": CONVERTER_VERSION, "dpflow_version": __version__,
                      "pyav": av.__version__, "numpy": np.__version__},
        "created_at": stamp.isoformat(timespec="seconds"),
        "task": inputs.task,
        "dataset_key": key,
        "n_episodes": int(len(lengths)),
        "total_steps": int(lengths.sum()),
        "episode_lengths": {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())},
        "frequency_hz": frequency_hz,
        "image_size": list(options["image_size"]),
        "pose": "camera0 optical centre from VIO; position in m, rotation vector in rad (norm <= pi)",
        "timestamp": "seconds from each episode's first frame (camera header.timestamp)",
        "keys": {m.name: {"shape": list(m.shape), "dtype": str(m.dtype)} for m in members},
        "value_ranges": ranges,
        "episodes": episodes,
        "inputs": {
            "manifests": inputs.manifests,
            "root": inputs.root,
            # a dataset of mixed tasks (convert(..., mixed_tasks=True)) says which task each episode is
            "episodes": [{"stem": stem, **({"task": by_stem[stem].task} if inputs.task is None and by_stem[stem].task
                                           else {}),
                          "files": by_stem[stem].files, **derived_from(by_stem[stem].curation)}
                         for stem in dict.fromkeys(r["stem"] for r in ok)],
        },
        "rejected": rejected,
        "options": options,
        "offsets": offsets,
        "stale_files_removed": stale,
        "warnings": _mixed_tasks_warning(inputs, [by_stem[stem] for stem in dict.fromkeys(r["stem"] for r in ok)])
                    + offset_warnings(offsets) + [{"stem": stem, **w} for stem in dict.fromkeys(r["stem"] for r in ok)
                                                  for w in by_stem[stem].pairing_warnings]
                    + [{"stem": stem, "code": code, "reason": reason} for stem, code, reason in dict.fromkeys(
                        (r["stem"], d["code"], d["reason"]) for r in ok for d in r["report"].get("damaged_frames") or [])],
        "workers": None,
        "timings_s": None,
        "wall_time_s": None,
        "sha256": None,
        "size_bytes": None,
    }


def _mixed_tasks_warning(inputs, converted: list) -> list[dict]:
    """A ``mixed_tasks`` warning when the ``converted`` episodes (their ``EpisodeInput``) come from manifests of
    different tasks (mixed on purpose: ``convert(..., mixed_tasks=True)``), naming the tasks and how many episodes
    of each the dataset holds; else none."""
    counts: dict[str, int] = {}
    for e in converted:
        if e.task:
            counts[e.task] = counts.get(e.task, 0) + 1
    if inputs.task is not None or len(counts) < 2:
        return []
    named = ", ".join(f"{task} ({n})" for task, n in counts.items())
    return [{"code": "mixed_tasks", "reason": f"episodes of {len(counts)} tasks in one dataset: {named}; each episode's "
                                              "task is in inputs.episodes[].task, inputs.root is the first manifest's"}]
