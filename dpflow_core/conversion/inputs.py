"""Conversion inputs and keys: a pairing manifest (or paths) in, the episodes to convert and their content key out.

Takes a manifest, a dict, a manifest path, a task folder or a list of them; gives
:class:`ConversionInputs` (accepted episodes with file SHA-256, rejected ones with reasons), the
topic map, the ``dataset_key`` of inputs plus settings, and the sidecar and norm-stats paths beside
an output.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dpflow_core.conversion.align import CONVERTER_VERSION
from dpflow_core.conversion.jobs import EDITED
from dpflow_core.conversion.settings import ConversionSettings, check_image_size
from dpflow_core.errors import ConversionError, DpflowError
from dpflow_core.files import display_name
from dpflow_core.names import validate_name
from dpflow_core.pairing import load_source
from dpflow_core.pairing.manifest import Manifest, manifest_from_dict, pairing_warnings
from dpflow_core.pairing.naming import rule_stems
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class EpisodeInput:
    """One accepted episode of a pairing manifest.

    Attributes:
        stem: the episode's stem.
        vio_mcap: the ``<STEM>_vio.mcap`` to convert.
        size_bytes: its size recorded in the manifest (None when absent).
        sha256: its SHA-256 recorded in the manifest (None when absent).
        files: the manifest's ``files`` entry ({role: {path, size_bytes, sha256}}).
        pairing_warnings: what pairing tolerated (:func:`~dpflow_core.pairing.manifest.pairing_warnings`).
        validation: the entry's ``validation`` block, the figures pairing measured on the ``_vio.mcap`` it
            validated for this stem (:class:`~dpflow_core.recordings.RecordingReport`); empty for a hand-made
            entry. Alignment compares the file it reads with them (:func:`~dpflow_core.conversion.jobs.validated_figures`).
        task: the task of the manifest the entry came from (None when the manifest names none).
    """

    stem: str
    vio_mcap: Path
    size_bytes: int | None
    sha256: str | None
    files: dict
    pairing_warnings: tuple = ()
    validation: dict = field(default_factory=dict)
    task: str | None = None

    @property
    def curation(self) -> dict | None:
        """The curation decision of a curated manifest's entry (``validation["curation"]``: decision, decided_by,
        score, flags, and a label's note), None for an uncurated one."""
        curation = self.validation.get("curation")
        return curation if isinstance(curation, dict) else None


@dataclass
class ConversionInputs:
    """Episodes to convert, gathered from one or more manifests or task folders.

    Attributes:
        episodes: accepted episodes, in manifest order.
        rejected: episodes the pairing rejected: [{stem, path, code, reason}].
        manifests: where the manifests came from (paths, or "<in memory>").
        task: the task name when all manifests agree on one, else None.
        root: the recordings root of the first manifest.
        topics: the topic map the first manifest was paired with (its ``topics``
            dict), or None when it records none.
    """

    episodes: list[EpisodeInput]
    rejected: list[dict]
    manifests: list[str]
    task: str | None
    root: str | None
    topics: dict | None = None


def _load_one(item: Any) -> tuple[Manifest, str]:
    """The typed :class:`~dpflow_core.pairing.Manifest` of one input, and where it came from: a ``Manifest``
    as it is, a manifest dict checked field by field (:func:`~dpflow_core.pairing.manifest_from_dict`), a
    manifest JSON path read once (:func:`~dpflow_core.pairing.load_manifest`), or a task folder paired now."""
    if isinstance(item, Manifest):
        return item, "<in memory>"
    if isinstance(item, dict):
        try:
            return manifest_from_dict(item, "<in memory>"), "<in memory>"
        except DpflowError as exc:  # a hand-made dict: the same check as a file's, named as conversion's input
            raise ConversionError(display_name(exc.reason), code="bad_manifest") from exc
    if isinstance(item, (str, os.PathLike)):
        return load_source(item), str(item)
    raise ConversionError(f"not a manifest: {type(item).__name__}", code="bad_manifest")


def load_inputs(manifest_or_paths: Any, *, mixed_tasks: bool = False) -> ConversionInputs:
    """Gather the accepted episodes of one or more pairing manifests.

    Args:
        manifest_or_paths: a ``Manifest`` (``dpflow_core.pairing``), a manifest
            dict (``{"manifest_version": 1, "root", "task", "accepted": [...],
            "rejected": [...]}``), a manifest JSON path, a task folder (paired on
            the fly), or a list of these, or the :class:`ConversionInputs` gathered already (returned as it
            is). Each becomes the typed :class:`~dpflow_core.pairing.Manifest` (a dict or a file is checked
            field by field, as :func:`~dpflow_core.pairing.load_manifest` does, and a file is read once).
            Only ``accepted`` entries are converted; relative file paths are resolved against the manifest's
            ``root``.
        mixed_tasks: accept manifests of different tasks in one dataset. Refused by default: no trainer config
            has a task input, so a policy trained on two tasks learns the mixture of their demonstrations
            (from a scene where either could start it may do either, or a blend). When mixed on purpose, each
            episode records its task (``EpisodeInput.task``; ``inputs.episodes[].task`` in ``dataset.json``).

    An accepted entry that is not what pairing accepted for its stem is moved to ``rejected`` as
    ``manifest_mismatch`` (:func:`edited_entry`). An accepted entry whose ``_vio.mcap`` SHA-256 or camera payload hash
    (``validation.camera_payload_sha256``) equals an earlier entry's, in any of the manifests,
    is moved to ``rejected`` as ``duplicate_episode`` naming the first one and its manifest.

    Raises:
        ConversionError: an input is not a manifest, an accepted stem is not a safe name, or a
            stem appears twice (``bad_manifest``); manifests name different tasks and ``mixed_tasks`` is
            False (``mixed_tasks``, naming each task and its manifest).
            A manifest dict with a field missing or of the wrong type is ``bad_manifest`` too, naming the field.
        PairingError: an input path is missing or neither a file nor a folder, pairing a task folder failed, or a
            manifest file is malformed (:func:`~dpflow_core.pairing.load_source`: naming the file and the field).
    """
    if isinstance(manifest_or_paths, ConversionInputs):  # gathered already: the manifests are not read again
        return manifest_or_paths
    items = list(manifest_or_paths) if isinstance(manifest_or_paths, (list, tuple)) else [manifest_or_paths]
    if not items:
        raise ConversionError("no input manifest or task folder given", code="bad_manifest")
    episodes: list[EpisodeInput] = []
    rejected: list[dict] = []
    sources, tasks = [], {}
    root0 = None
    seen: dict[str, str] = {}
    # Content hashes across every manifest of this dataset: pairing sees one task folder only.
    by_content: dict[str, tuple[str, str]] = {}
    topics = None
    for item in items:
        m, source = _load_one(item)
        sources.append(source)
        root = str(m.root) if m.root else None
        root0 = root0 or root
        topics = topics or (m.topics if isinstance(m.topics, dict) else None)
        if m.task:
            tasks.setdefault(m.task, source)
        if len(tasks) > 1 and not mixed_tasks:
            named = ", ".join(f"{t!r} ({where})" for t, where in tasks.items())
            raise ConversionError(
                f"mixed_tasks: the inputs are of different tasks: {named}. A policy trained on both learns the "
                "mixture of their demonstrations (no trainer config has a task input); convert one task per "
                "dataset, or mix them on purpose (dpflow convert --mixed-tasks), which records each episode's task",
                code="mixed_tasks")
        for entry in m.accepted:
            stem = entry.stem
            try:  # a Manifest built in code never went through manifest_from_dict's check: the same rule here
                validate_name(stem, "stem")
            except DpflowError as exc:
                raise ConversionError(f"accepted entry '{display_name(stem)}': {display_name(exc.reason)}", source,
                                      code="bad_manifest") from exc
            if stem in seen:
                raise ConversionError(f"stem {stem!r} appears in {seen[stem]} and {source}", source, code="bad_manifest")
            seen[stem] = source
            vio = entry.files["vio_mcap"]
            p = Path(vio.path)
            if not p.is_absolute() and root:
                p = Path(root) / p
            edited = edited_entry(stem, {role: f.path for role, f in entry.files.items()}, vio.size_bytes,
                                  entry.validation)
            if edited is not None:  # before the duplicate check: the real owner of the file stays accepted
                rejected.append({"stem": stem, "stage": "conversion", "path": str(p), "code": "manifest_mismatch",
                                 "reason": edited})
                continue
            hashes = [(f"SHA-256 {vio.sha256[:12]}...", "file:" + vio.sha256)] if vio.sha256 else []
            cam = entry.validation.get("camera_payload_sha256")
            if cam:
                hashes.append((f"camera payload SHA-256 {cam[:12]}...", "camera:" + cam))
            original = next(((what, by_content[h]) for what, h in hashes if h in by_content), None)
            if original is not None:
                what, (first, where) = original
                rejected.append({"stem": stem, "stage": "conversion", "path": str(p), "code": "duplicate_episode",
                                 "reason": f"{p.name} ({source}) holds the same content as episode {first!r} of {where} "
                                           f"({what}): the same demonstration twice would weigh it double"})
                continue
            for _what, h in hashes:
                by_content[h] = (stem, source)
            episodes.append(EpisodeInput(stem, p, vio.size_bytes, vio.sha256,
                                         {role: f.to_dict() for role, f in entry.files.items()},
                                         tuple(pairing_warnings(entry)), dict(entry.validation), m.task or None))
        for r in m.rejected:
            rejected.append({"stem": r.stem, "stage": "pairing", "path": r.path, "code": r.code, "reason": r.reason})
    return ConversionInputs(episodes, rejected, sources, next(iter(tasks)) if len(tasks) == 1 else None, root0, topics)


def edited_entry(stem: str, files: dict[str, str | Path], vio_size_bytes: int | None, validation: dict) -> str | None:
    """Why a manifest entry is not the one pairing wrote for ``stem`` (the reason of a ``manifest_mismatch`` reject),
    judged from the manifest alone, without reading a file; None when nothing disagrees.

    Two disagreements are caught: files named by the naming rules (``<STEM>.mcap``, ``<STEM>_vio.mcap``,
    ``<STEM>_vio.json``, :func:`~dpflow_core.pairing.naming.rule_stems`) for different stems, and a ``_vio.mcap``
    whose recorded size (bytes) differs from the size pairing measured on the file it validated
    (``validation.size_bytes``). A figure that is absent (a hand-made entry) is not judged; alignment compares the
    file it reads with the rest of ``validation`` (:func:`~dpflow_core.conversion.jobs.check_validated`).

    Args:
        stem: the entry's stem; files: path per role; vio_size_bytes: ``files.vio_mcap.size_bytes``;
        validation: the entry's ``validation`` block.
    """
    named = rule_stems(files)
    if len(set(named.values())) > 1:
        which = ", ".join(f"{role} {Path(files[role]).name}" for role in named)
        return f"episode {stem!r}: its files are named for different stems ({which}): {EDITED}"
    validated = validation.get("size_bytes")
    if isinstance(validated, int) and isinstance(vio_size_bytes, int) and validated != vio_size_bytes:
        return (f"episode {stem!r}: its vio_mcap {Path(files['vio_mcap']).name} is recorded as {vio_size_bytes} bytes, "
                f"but the file pairing validated for this stem ({Path(str(validation.get('path', '?'))).name}) "
                f"had {validated} bytes: {EDITED}")
    return None


def inputs_topic_map(inputs: ConversionInputs) -> TopicMap:
    """The manifest's topic map when it records one (as pairing writes it), else the DAS defaults."""
    if not inputs.topics:
        return DAS_DEFAULT
    try:
        from dpflow_core.pairing import topic_map_from_dict
    except ImportError:
        return DAS_DEFAULT
    try:
        return topic_map_from_dict(inputs.topics)
    except DpflowError as exc:
        raise ConversionError(f"manifest topics are invalid: {exc.reason}", code="bad_manifest") from exc


def dataset_key(manifest_or_paths: Any, settings: ConversionSettings | None = None) -> str:
    """Content address of the dataset a conversion would produce (64 hex digits).

    SHA-256 of the accepted inputs' stems and file hashes, the settings (:meth:`ConversionSettings.options`,
    with the manifest's topics) and :data:`CONVERTER_VERSION`: equal keys mean the same conversion of the
    same bytes (:func:`options_key`).

    Args:
        manifest_or_paths: see :func:`load_inputs`, or the :class:`ConversionInputs` it gave.
        settings: the conversion settings (default: the defaults); a dataset needs an ``image_size``.

    Raises:
        ConversionError: ``bad_option`` without an image size; what :func:`load_inputs` raises.
    """
    settings = settings or ConversionSettings()
    check_image_size(settings.image_size)
    inputs = manifest_or_paths if isinstance(manifest_or_paths, ConversionInputs) else load_inputs(manifest_or_paths)
    return options_key(inputs, settings.options(inputs_topic_map(inputs)))


def options_key(inputs: ConversionInputs, options: dict) -> str:
    """SHA-256 (hex) of the converter version, ``options`` (:meth:`ConversionSettings.options`) and every input's
    identity: equal keys mean an equal dataset, so an existing one with this key is reused."""
    doc = {
        "converter_version": CONVERTER_VERSION,
        "options": options,
        "inputs": sorted(
            [e.stem, *(f"{role}:{(e.files.get(role) or {}).get('sha256')}" for role in sorted(e.files))]
            for e in inputs.episodes
        ),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def dataset_path_in(workdir: str | Path, inputs: ConversionInputs, settings: ConversionSettings | None = None,
                    task: str | None = None) -> Path:
    """The content-addressed place of a dataset in a work folder: ``<workdir>/datasets/<task>/<key12>/dataset.npz``.

    ``key12`` is the first 12 hex digits of :func:`dataset_key` of ``inputs`` and ``settings``, so equal inputs
    and settings find the same dataset and different ones never share a folder. ``task``: default the
    inputs' task, else ``"task"``.

    Raises:
        InvalidNameError: the task is not a safe name.
        ConversionError: ``bad_option`` without an image size.
    """
    name = validate_name(task or inputs.task or "task", "task")
    return Path(workdir) / "datasets" / name / dataset_key(inputs, settings)[:12] / "dataset.npz"


def sidecar_path_for(out_path: str | Path) -> Path:
    """The metadata sidecar beside a dataset: ``dataset.npz`` -> ``dataset.json``."""
    out = Path(out_path)
    return out.with_suffix(".json")


def norm_stats_path_for(out_path: str | Path) -> Path:
    """The norm stats file beside a dataset: ``norm_stats.json`` for ``dataset.npz``,
    ``<stem>.norm_stats.json`` for any other name (two datasets may share a folder)."""
    out = Path(out_path)
    return out.with_name("norm_stats.json" if out.stem == "dataset" else f"{out.stem}.norm_stats.json")
