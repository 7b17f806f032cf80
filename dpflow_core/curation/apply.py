"""Curation applied: a person's labels over the automatic decisions, idle stretches cut out, a curated manifest.

:func:`curate` scores every accepted episode of a pairing manifest
(:mod:`~dpflow_core.curation.score`), decides keep, trim or drop, lets a labels file
overrule any decision, and writes two things into its output folder:

- ``curation.json``: per episode its figures, flags with reasons, score and every check's
  ratio (near misses included), decision and who made it (``auto`` or ``label``), the label's
  note, and each cut; and the warnings of checks that could not judge (too few episodes);
- a curated pairing manifest (``manifests/<task>-<12 hex>.json``, through
  :func:`dpflow_core.pairing.save_manifest`): the kept episodes, each with
  ``validation["curation"]`` (decision, decided_by, flags, trim provenance), and the
  dropped ones moved to ``rejected`` with code ``curation_drop`` and the reason. Conversion
  reads it as any pairing manifest, so the dataset's lineage (``dataset.json``: its input
  manifest and the rejects with their reasons) records every decision.

Trimming never edits a recording: the kept messages of ``<STEM>_vio.mcap`` are copied,
byte for byte, into ``trimmed/<STEM>_vio.mcap`` without those captured inside each cut
(every topic; the manifest entry then points at the copy, with its own size and SHA-256,
and records the source file, its size and SHA-256, each cut and the kept spans of the
source's timeline, ``kept_s``; the dataset's lineage lists the copy as derived from it). A camera stream is H.264: a frame
after a cut must not reference one inside it, so each cut ends at the last key frame
(IDR access unit) inside the idle stretch. Conversion then sees a camera hole longer than
its ``max_gap_s`` and splits the episode there: nothing is interpolated across the cut.

Labels (JSON): ``{"<stem>": "keep" | "drop" | {"decision": "keep" | "drop", "note": str,
"by": str}}``. ``keep`` keeps the recording as it is (untrimmed: a person looked at it);
``drop`` drops it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from dpflow_core.curation.features import episode_features
from dpflow_core.curation.score import CurationSettings, auto_decision, idle_stretches, score_episodes
from dpflow_core.errors import DpflowError
from dpflow_core.files import atomic_output, sha256_file, write_text_atomic
from dpflow_core.recordings import inspect_recording
from dpflow_core.pairing import AcceptedEpisode, FileEntry, Manifest, PairingReject, load_manifest, save_manifest

CURATION_FILE = "curation.json"
DECISIONS = ("keep", "drop")
DROP_CODE = "curation_drop"


class CurationError(DpflowError):
    """Curation cannot run: a bad labels file, an output that exists, a manifest without episodes."""

    code = "curation_error"


@dataclass(frozen=True)
class Label:
    """A person's decision on one stem: ``decision`` (``keep`` or ``drop``), ``note``, ``by``."""

    decision: str
    note: str = ""
    by: str = ""


def read_labels(path: str | Path) -> dict[str, Label]:
    """The labels file (module docstring) as ``{stem: Label}``.

    Raises:
        CurationError: missing, not JSON, not an object, or a decision other than keep/drop
            (names the file and the stem).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CurationError(f"cannot read labels: {exc}", path, code="bad_labels") from exc
    if not isinstance(data, dict):
        raise CurationError("labels must be a JSON object {stem: keep|drop|{decision, note, by}}", path, code="bad_labels")
    out = {}
    for stem, value in data.items():
        item = {"decision": value} if isinstance(value, str) else value
        if not isinstance(item, dict) or item.get("decision") not in DECISIONS:
            raise CurationError(f"label of {stem!r} must be 'keep' or 'drop' (or an object with that 'decision'), "
                                f"got {value!r}", path, code="bad_labels")
        out[str(stem)] = Label(item["decision"], str(item.get("note", "")), str(item.get("by", "")))
    return out


def _has_key_frame(payload: bytes) -> bool:
    """Whether an H.264 Annex-B access unit holds an IDR slice (NAL type 5)."""
    i = payload.find(b"\x00\x00\x01")
    while i >= 0 and i + 3 < len(payload):
        if payload[i + 3] & 0x1F == 5:
            return True
        i = payload.find(b"\x00\x00\x01", i + 3)
    return False


def trim_recording(src: str | Path, dst: str | Path, cuts_ns: list[tuple[int, int]], camera_topic: str) -> dict:
    """Copy ``src`` (an MCAP) to ``dst`` without the messages captured inside each cut.

    Args:
        src, dst: the recording and the copy (``dst`` must not exist).
        cuts_ns: ``(start, end)`` capture times (ns, ``header.timestamp``) of the stretches to cut;
            each end is moved back to the last camera key frame inside it (a cut with no key frame
            inside is not made).
        camera_topic: the H.264 camera topic.

    Returns:
        Provenance: ``{"source", "source_sha256", "source_size_bytes", "sha256", "size_bytes", "cuts":
        [{start_ns, end_ns, requested_end_ns, messages: {topic: n}}], "skipped": [...]}`` (sizes in bytes).
        A cut removes the messages captured in ``[start_ns, end_ns)``.

    Raises:
        FileExistsError: ``dst`` exists. RecordingError / McapError: ``src`` cannot be read.
    """
    from mcap.reader import NonSeekingReader
    from mcap.writer import Writer
    from mcap_protobuf.decoder import DecoderFactory

    src, dst = Path(src), Path(dst)

    def messages():
        with open(src, "rb") as f:
            for schema, channel, message, decoded in NonSeekingReader(f, decoder_factories=[DecoderFactory()]) \
                    .iter_decoded_messages(log_time_order=False):
                header = getattr(decoded, "header", None)
                yield schema, channel, message, int(header.timestamp) if header is not None else None, decoded

    keys = np.array(sorted(ts for _s, ch, _m, ts, dec in messages()
                           if ch.topic == camera_topic and ts is not None and _has_key_frame(bytes(dec.data))), np.int64)
    cuts, skipped = [], []
    for a, b in cuts_ns:
        inside = keys[(keys > a) & (keys <= b)]
        (cuts if len(inside) else skipped).append(
            {"start_ns": int(a), "end_ns": int(inside[-1]) if len(inside) else None, "requested_end_ns": int(b),
             "messages": {}})
    with atomic_output(dst, "wb", overwrite=False) as fh:
        writer = Writer(fh)
        writer.start(profile="", library="dpflow curate")
        schemas, channels = {}, {}
        for schema, channel, message, ts, _dec in messages():
            cut = next((c for c in cuts if ts is not None and c["start_ns"] <= ts < c["end_ns"]), None)
            if cut is not None:
                cut["messages"][channel.topic] = cut["messages"].get(channel.topic, 0) + 1
                continue
            if channel.id not in channels:
                if schema is not None and schema.id not in schemas:
                    schemas[schema.id] = writer.register_schema(schema.name, schema.encoding, schema.data)
                channels[channel.id] = writer.register_channel(
                    channel.topic, channel.message_encoding, schemas.get(schema.id, 0) if schema else 0, channel.metadata)
            writer.add_message(channels[channel.id], message.log_time, message.data, message.publish_time,
                               message.sequence)
        writer.finish()
    return {"source": str(src), "source_sha256": sha256_file(src), "source_size_bytes": src.stat().st_size,
            "sha256": sha256_file(dst), "size_bytes": dst.stat().st_size, "cuts": cuts, "skipped": skipped}


def kept_spans(cuts: list[dict], duration_s: float) -> list[list[float]]:
    """The ``[start_s, end_s)`` spans of a recording's timeline (s from its first camera frame, 0 to
    ``duration_s``) that a trimmed copy keeps: the complement of the made ``cuts`` (``start_s``,
    ``end_s`` each, as :func:`curate` records them). Empty spans are left out."""
    spans, t = [], 0.0
    for c in sorted(cuts, key=lambda c: c["start_s"]):
        if c["start_s"] > t:
            spans.append([t, c["start_s"]])
        t = max(t, c["end_s"])
    if duration_s >= t:
        spans.append([t, round(duration_s, 3)])
    return spans


@dataclass
class CurationResult:
    """What :func:`curate` wrote: ``report_path`` (``curation.json``), ``manifest_path`` (the curated
    manifest), counts ``kept``, ``trimmed``, ``dropped``, ``episodes`` (the report's entries),
    ``warnings`` (checks that could not judge, :class:`~dpflow_core.curation.score.Scores`) and
    ``removed`` (an earlier curation's trimmed copies deleted with ``overwrite``)."""

    report_path: Path
    manifest_path: Path
    kept: int
    trimmed: int
    dropped: int
    episodes: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)

    def table(self) -> str:
        """One line per flagged or labelled episode: stem, score, decision (by), reasons; then the
        warnings, the stale trimmed copies removed, and the counts."""
        lines = [f"{'stem':<28} {'score':>5} {'decision':<14} reasons"]
        for e in self.episodes:
            if e["flags"] or e["decided_by"] != "auto":
                why = "; ".join(f["reason"] for f in e["flags"]) or "-"
                lines.append(f"{e['stem']:<28} {e['score']:>5.2f} {e['decision'] + ' (' + e['decided_by'] + ')':<14} {why}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"removed {p} (an earlier curation's trimmed copy, unused now)" for p in self.removed]
        lines.append(f"kept {self.kept} (trimmed {self.trimmed}), dropped {self.dropped}")
        return "\n".join(lines)


def curate(manifest: str | Path | Manifest, out_dir: str | Path, settings: CurationSettings = CurationSettings(),
           labels: dict[str, Label] | str | Path | None = None, overwrite: bool = False) -> CurationResult:
    """Score, decide, trim and write the curated manifest of a pairing manifest (module docstring).

    Args:
        manifest: a :class:`~dpflow_core.pairing.Manifest` or its JSON path.
        out_dir: the curation's folder (``curation.json``, ``trimmed/``, ``manifests/``).
        settings: the checks' limits.
        labels: ``{stem: Label}`` or a labels file; a label overrules the automatic decision.
        overwrite: replace an earlier ``curation.json`` and trimmed copies in ``out_dir``; the trimmed
            copies that the earlier ``curation.json`` records and the new decisions do not use are
            deleted (only those, and only inside ``out_dir/trimmed``).

    Raises:
        CurationError: the manifest has no accepted episode, a label names a stem the manifest does
            not accept, or ``out_dir`` holds a curation and ``overwrite`` is false.
        PairingError: the manifest cannot be read. RecordingError: a recording cannot be read.
    """
    m = manifest if isinstance(manifest, Manifest) else load_manifest(manifest)
    source = "<in memory>" if isinstance(manifest, Manifest) else str(Path(manifest).absolute())
    labels_from = str(labels) if isinstance(labels, (str, Path)) else None
    labels = read_labels(labels) if isinstance(labels, (str, Path)) else dict(labels or {})
    out = Path(out_dir)
    if not m.accepted:
        raise CurationError("the manifest accepts no episode: nothing to curate", source, code="no_episodes")
    unknown = sorted(set(labels) - {a.stem for a in m.accepted})
    if unknown:
        raise CurationError(f"labels name stems the manifest does not accept: {unknown[:5]}", labels_from or source,
                            code="bad_labels")
    if (out / CURATION_FILE).exists() and not overwrite:
        raise CurationError("a curation is already there (pass --overwrite to replace it)", out / CURATION_FILE,
                            code="output_exists")
    topics = m.topic_map()
    feats = [episode_features(a.vio_mcap, settings, a.stem, topics) for a in m.accepted]
    scores = score_episodes(feats, settings)
    earlier = _trimmed_copies(out) if overwrite else set()
    (out / "trimmed").mkdir(parents=True, exist_ok=True)
    entries, accepted, rejected = [], [], list(m.rejected)
    for k, (a, f) in enumerate(zip(m.accepted, feats)):
        label, fl = labels.get(a.stem), scores.flags(k)
        decision = label.decision if label else auto_decision(fl)
        entry = {"stem": a.stem, "score": round(scores.score(k), 3), "ratios": scores.ratios(k),
                 "flags": [x.to_dict() for x in fl], "figures": f.summary(), "decision": decision,
                 "decided_by": "label" if label else "auto", "auto_decision": auto_decision(fl)}
        if label:
            entry["label"] = {"decision": label.decision, "note": label.note, "by": label.by, "file": labels_from}
        if decision == "drop":
            who = (f"a person's label{' by ' + label.by if label and label.by else ''}"
                   f"{': ' + label.note if label and label.note else ''}") if label else "dpflow curate"
            why = "; ".join(x.reason for x in fl) or "no flag"
            rejected.append(PairingReject(a.stem, str(a.vio_mcap), DROP_CODE, f"dropped by {who} ({why})"))
        else:
            files = dict(a.files)
            if decision == "trim":
                half = settings.idle_keep_s / 2
                cuts = [(f.start_ns + int((s0 + half) * 1e9), f.start_ns + int((s1 - half) * 1e9))
                        for s0, s1 in idle_stretches(f, settings)]
                dst = out / "trimmed" / a.vio_mcap.name
                if dst.exists() and overwrite:
                    dst.unlink()
                trim = {"path": str(dst.absolute())} | trim_recording(a.vio_mcap, dst, cuts, topics.camera)
                for c in trim["cuts"] + trim["skipped"]:
                    c["start_s"] = round((c["start_ns"] - f.start_ns) / 1e9, 3)
                    c["end_s"] = None if c["end_ns"] is None else round((c["end_ns"] - f.start_ns) / 1e9, 3)
                    c["reason"] = f"idle: still for {(c['requested_end_ns'] - c['start_ns']) / 1e9 + settings.idle_keep_s:.1f} s"
                trim["kept_s"] = kept_spans(trim["cuts"], f.duration_s)
                entry["trim"] = trim
                files["vio_mcap"] = FileEntry(dst.absolute(), trim["size_bytes"], trim["sha256"])
            validation = dict(a.validation)
            if decision == "trim":  # the copy's own figures (camera payload hash included), not the source's
                validation |= inspect_recording(files["vio_mcap"].path, topics).to_dict()
            validation["curation"] = {k: entry[k] for k in ("decision", "decided_by", "score", "flags")
                                      if k in entry} | ({"label": entry["label"]} if label else {}) \
                | ({"trim": entry["trim"]} if "trim" in entry else {})
            accepted.append(AcceptedEpisode(a.stem, files, a.vio_status, validation))
        entries.append(entry)
    curated = Manifest(m.root, m.task, datetime.now(timezone.utc).isoformat(timespec="seconds"), m.topics,
                       accepted, sorted(rejected, key=lambda r: (r.stem, r.path)))
    manifest_path, _ = save_manifest(curated, out)
    report = {"source_manifest": source, "curated_manifest": str(manifest_path), "settings": settings.to_dict(),
              "labels_file": labels_from, "warnings": scores.warnings, "episodes": entries}
    report_path = write_text_atomic(out / CURATION_FILE, json.dumps(report, indent=2) + "\n")
    removed = _remove_stale(earlier - _trimmed_copies(out))
    n_drop = sum(e["decision"] == "drop" for e in entries)
    return CurationResult(report_path, manifest_path, len(entries) - n_drop,
                          sum(e["decision"] == "trim" for e in entries), n_drop, entries, scores.warnings, removed)


def _trimmed_copies(out: Path) -> set[Path]:
    """The trimmed copies that the curation recorded in ``out/curation.json`` made inside ``out/trimmed``
    (none when there is no readable report)."""
    try:
        report = json.loads((out / CURATION_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    folder = (out / "trimmed").absolute()
    found = set()
    for e in report.get("episodes", []) if isinstance(report, dict) else []:
        trim = e.get("trim") if isinstance(e, dict) else None
        if isinstance(trim, dict) and trim.get("source"):
            # reports before the copy's own path was recorded: curate named it after its source
            path = Path(trim.get("path") or folder / Path(trim["source"]).name).absolute()
            if path.parent == folder:
                found.add(path)
    return found


def _remove_stale(paths: set[Path]) -> list[Path]:
    """Delete ``paths`` (an earlier curation's trimmed copies that the new one does not use); those deleted."""
    removed = []
    for p in sorted(paths):
        if p.is_file():
            p.unlink()
            removed.append(p)
    return removed
