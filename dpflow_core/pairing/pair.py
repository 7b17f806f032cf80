"""The pairing entry point: one Matrix Studio task folder in, a :class:`~dpflow_core.pairing.Manifest` out.

:func:`pair_recordings` groups the folder's files by exact stem (:mod:`~dpflow_core.pairing.naming`),
or takes the explicit manifest's triples (:mod:`~dpflow_core.pairing.explicit`), reads
``vio_result.json`` (:mod:`~dpflow_core.pairing.status`), runs every check on each stem and then
across the accepted episodes (:mod:`~dpflow_core.pairing.checks`). One bad episode never stops
the others: each becomes a reject with its code and reason.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from dpflow_core.errors import PairingError
from dpflow_core.names import validate_name
from dpflow_core.pairing.across import cross_task_rejects
from dpflow_core.pairing.checks import check_candidate, content_rejects
from dpflow_core.pairing.explicit import read_explicit
from dpflow_core.pairing.manifest import AcceptedEpisode, Manifest, PairingReject, load_manifest, save_manifest, topic_map_to_dict
from dpflow_core.pairing.naming import group_by_stem, split_name
from dpflow_core.pairing.status import read_task_summary
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap


def pair_recordings(
    root: str | Path,
    topics: TopicMap = DAS_DEFAULT,
    explicit_manifest: str | Path | None = None,
    task: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> Manifest:
    """Pair the recordings of one Matrix Studio task folder by exact stem.

    Args:
        root: the task folder (``output/<task_name>/``).
        topics: topic map used to validate the MCAP files.
        explicit_manifest: optional JSON file ``{"episodes": [{"stem": ..., "raw_mcap": ...,
            "vio_mcap": ..., "vio_json": ...}]}`` with paths relative to ``root``, for
            naming schemes that differ; then only its entries are considered, each checked
            (inside the root, present, non-empty, status success, valid MCAP); the folder
            naming rules and the ``vio_result.json`` file lists are not applied.
        task: the task name; default ``task_name`` of ``vio_result.json``, else the
            folder name. Stems naming another task are rejected (``other_task``).
        progress: called as ``progress(stem, done, total)`` after each stem.

    Returns:
        The manifest: accepted episodes (files with sizes and SHA-256, validation
        figures) and rejects (stem, path, code, reason), both sorted by stem.

    Raises:
        PairingError: ``root`` holds no ``<STEM>.mcap`` file (code ``no_recordings``,
            reason "no <STEM>.mcap files under <root>"; with an explicit manifest: ``root``
            is not a folder), or the explicit manifest is missing or malformed.
        InvalidNameError: the task name is not a safe name.
    """
    root = Path(root).absolute()
    if explicit_manifest is None and (not root.is_dir() or not any(
        p.is_file() and split_name(p.name) and p.name.endswith(".mcap") for p in root.iterdir()
    )):
        raise _no_recordings(root)
    if not root.is_dir():
        raise PairingError(f"{root} is not a folder", root, code="no_recordings")
    summary = read_task_summary(root)
    if task is None:
        task = (summary.task_name if summary is not None else None) or root.name
    validate_name(task, "task")

    if explicit_manifest is not None:
        candidates, rejects = read_explicit(Path(explicit_manifest), root)
    else:
        groups, rejects = group_by_stem(root)
        candidates = [groups[s] for s in sorted(groups)]
    if summary is not None:
        rejects.extend(summary.bad_entries)
    if summary is not None and summary.error is not None:
        rejects.append(PairingReject(
            "", str(summary.path), summary.error_code, f"{summary.error}; the task-level cross-check was skipped",
        ))

    all_stems = {c.stem for c in candidates}
    if explicit_manifest is None:  # an explicit manifest pairs a chosen subset
        rejects.extend(listed_but_missing(summary, root, all_stems))
    accepted: list[AcceptedEpisode] = []
    for i, cand in enumerate(candidates):
        try:
            result = check_candidate(cand, root, task, summary, all_stems, topics)
        except OSError as exc:
            name = Path(exc.filename).name if exc.filename else cand.stem
            result = PairingReject(cand.stem, str(exc.filename or root), "unreadable",
                                   f"cannot read {name}: {exc.strerror or exc} (errno {exc.errno})")
        (accepted if isinstance(result, AcceptedEpisode) else rejects).append(result)
        if progress is not None:
            progress(cand.stem, i + 1, len(candidates))
    accepted, content = content_rejects(accepted)
    rejects.extend(content)
    accepted, across = cross_task_rejects(root, accepted, topics)
    rejects.extend(across)
    rejects.sort(key=lambda r: (r.stem, r.path))
    return Manifest(
        root=root,
        task=task,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        topics=topic_map_to_dict(topics),
        accepted=sorted(accepted, key=lambda a: a.stem),
        rejected=rejects,
    )


def listed_but_missing(summary, root: Path, stems: set[str]) -> list[PairingReject]:
    """``listed_but_missing`` entries of the manifest's ``rejected`` list: stems ``vio_result.json`` lists as
    VIO-processed (``success_mcap_files``) with no file of theirs in the folder (a lost or moved recording,
    which pairing would otherwise never mention). Nothing without a readable summary."""
    if summary is None or summary.error is not None:
        return []
    return [PairingReject(stem, str(summary.path), "listed_but_missing",
                          f"vio_result.json lists {stem} as processed, but no {stem}.mcap / {stem}_vio.mcap is in {root}")
            for stem in sorted((summary.success or set()) - stems)]


def _no_recordings(root: Path) -> PairingError:
    if not root.exists():
        return PairingError(f"no <STEM>.mcap files under {root}: no such folder", root, code="no_recordings")
    if not root.is_dir():
        return PairingError(f"no <STEM>.mcap files under {root}: not a folder", root, code="no_recordings")
    below = sorted({p.parent.relative_to(root).parts[0] for p in root.rglob("*.mcap")})
    hint = f" (task folders below it: {', '.join(below)}; pass one of them as the root)" if below else ""
    return PairingError(f"no <STEM>.mcap files under {root}{hint}", root, code="no_recordings")


def _is_task_folder(source: Path) -> bool:
    """Whether a command's input is a folder (True) or a manifest file (False).

    Raises:
        PairingError: ``missing_manifest`` when nothing is there, ``bad_manifest`` when it is neither a file nor a
            folder (a FIFO, a socket); both say a pairing manifest or a task folder was expected.
    """
    if source.is_dir():
        return True
    if not source.exists():
        raise PairingError("no such file or folder (expected a pairing manifest or a task folder)", source,
                           code="missing_manifest")
    if not source.is_file():
        raise PairingError("neither a manifest file nor a task folder (expected a pairing manifest or a task folder)",
                           source, code="bad_manifest")
    return False


def load_source(source: str | Path, topics: TopicMap = DAS_DEFAULT) -> Manifest:
    """The manifest a command's input names: a pairing manifest JSON read (:func:`load_manifest`), or a
    Matrix Studio task folder paired now (:func:`pair_recordings` with ``topics``).

    Raises:
        PairingError: the path is missing or neither a file nor a folder (:func:`_is_task_folder`); what
            :func:`load_manifest` and :func:`pair_recordings` raise.
    """
    source = Path(source)
    return pair_recordings(source, topics) if _is_task_folder(source) else load_manifest(source)


def manifest_file_for(source: str | Path, output_dir: str | Path, topics: TopicMap = DAS_DEFAULT) -> Path:
    """The manifest file a command's input names: a pairing manifest file as it is (not read here), or a task
    folder paired now and saved in ``output_dir/manifests/`` (:func:`save_manifest`), so what the command
    measured stays on record beside its output.

    Raises:
        PairingError: as :func:`load_source`, and :func:`save_manifest`'s ``output_exists``.
    """
    source = Path(source)
    if not _is_task_folder(source):
        return source
    return save_manifest(pair_recordings(source, topics), output_dir)[0]
