"""Curation against the world's ground truth: bad demonstrations written on purpose (dpflow_core.sim.faults),
flagged by dpflow curate from the recordings alone; a person's label overrules and reaches the dataset's
lineage; trimmed idle stretches keep their provenance."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.curation import CurationSettings
from dpflow_core.curation.apply import DROP_CODE, CurationError, Label, curate, read_labels
from dpflow_core.files import sha256_file
from dpflow_core.pairing import load_manifest, pair_recordings, save_manifest
from dpflow_core.recordings.reader import read_streams
from dpflow_core.sim.demonstrator import plan
from dpflow_core.sim.faults import KINDS, TRUTH_FILE, FaultSpec, dropped, read_truth, regrasp, wrong_target
from dpflow_core.sim.record import SimRecordingSpec, demonstrate, read_sim_task, record_task
from dpflow_core.sim.tasks import failure_mode, initial_state, new_world, success

pytestmark = pytest.mark.slow
#: The check that names each kind of bad demonstration.
NAMING_CHECK = {"idle": "idle", "duplicate": "duplicate", "dropped": "release_height",
                "regrasp": "repeated_grasp", "wrong_target": "release_scene"}


@pytest.fixture(scope="module")
def world_task(tmp_path_factory):
    """25 pick_place demonstrations, 10 of them bad (2 of each kind), paired and curated without labels."""
    root = tmp_path_factory.mktemp("curation")
    task_dir = record_task(root / "rec", "pick_place", 25, seed=7, spec=SimRecordingSpec(width=64, height=64),
                           faults=FaultSpec(bad_fraction=0.4))
    manifest_path, _ = save_manifest(pair_recordings(task_dir), root / "work")
    result = curate(manifest_path, root / "work" / "curation")
    truth = {e["stem"]: e for e in read_truth(task_dir)["episodes"]}
    return task_dir, manifest_path, result, truth


def test_faults_do_what_they_say_in_the_world():
    """Each plan fault changes the world's outcome the way its name says (the ground truth is real)."""
    world = new_world("pick_place", 32, 32)
    try:
        for seed in (3, 4):
            state = initial_state("pick_place", seed)
            demonstrate(world, state)
            assert success(world, "pick_place")
            rng = np.random.default_rng(seed)
            demonstrate(world, state, track=wrong_target(plan(state), rng)[0])
            assert failure_mode(world, "pick_place") == "wrong_place"
            demonstrate(world, state, track=dropped(plan(state), rng)[0])
            assert failure_mode(world, "pick_place") == "dropped"
            track, details = regrasp(plan(state), rng)
            demonstrate(world, state, track=track)
            assert world.grasp_attempts.count("held") == details["loops"] + 1
    finally:
        world.close()


def test_flags_match_the_ground_truth(world_task):
    task_dir, _, result, truth = world_task
    meta = read_sim_task(task_dir)
    assert (task_dir / TRUTH_FILE).exists() and len(meta["episodes"]) == 25
    assert len({e["seed"] for e in meta["episodes"]}) == 25  # a duplicate keeps its own slot's seed
    kinds = [t["kind"] for t in truth.values() if t["bad"]]
    assert sorted(kinds) == sorted(KINDS * 2)
    by_stem = {e["stem"]: e for e in result.episodes}
    rows = []
    for kind in KINDS:
        stems = [s for s, t in truth.items() if t["kind"] == kind]
        flagged = [s for s in stems if by_stem[s]["flags"]]
        named = [s for s in stems if NAMING_CHECK[kind] in {f["check"] for f in by_stem[s]["flags"]}]
        rows.append((kind, len(stems), len(flagged), len(named)))
    good = [s for s, t in truth.items() if not t["bad"]]
    false_pos = [s for s in good if by_stem[s]["flags"]]
    bad_flagged = sum(r[2] for r in rows)
    precision = bad_flagged / max(1, bad_flagged + len(false_pos))
    print("\nkind          bad  flagged  by its check")
    for kind, n, f, named in rows:
        print(f"{kind:<13} {n:>3}  {f:>7}  {named:>12}")
    print(f"recall {bad_flagged}/{len(kinds)}, precision {precision:.2f}, good flagged {len(false_pos)}/{len(good)}")
    recall = {kind: named / n for kind, n, _f, named in rows}
    assert recall["idle"] == 1.0 and recall["duplicate"] == 1.0
    assert recall["dropped"] == 1.0 and recall["regrasp"] == 1.0
    assert bad_flagged / len(kinds) >= 0.8
    assert len(false_pos) <= 1, false_pos
    # idle alone is trimmed, never dropped; a duplicate names the episode it repeats
    for s, t in truth.items():
        if t["kind"] == "idle":
            assert by_stem[s]["decision"] == "trim"
        if t["kind"] == "duplicate":
            reason = next(f["reason"] for f in by_stem[s]["flags"] if f["check"] == "duplicate")
            assert repr(t["details"]["source"]) in reason


def test_trimming_keeps_provenance(world_task):
    task_dir, _, result, truth = world_task
    curated = load_manifest(result.manifest_path)
    idle = [s for s, t in truth.items() if t["kind"] == "idle"]
    for stem in idle:
        entry = next(a for a in curated.accepted if a.stem == stem)
        trim = entry.validation["curation"]["trim"]
        source = task_dir / f"{stem}_vio.mcap"
        assert trim["source"] == str(source) and trim["source_sha256"] == sha256_file(source)
        assert entry.vio_mcap != source and sha256_file(entry.vio_mcap) == trim["sha256"] == entry.files["vio_mcap"].sha256
        (cut,) = trim["cuts"]
        t0, dur = truth[stem]["details"]["start_s"], truth[stem]["details"]["duration_s"]
        # the cut lies inside the demonstrator's idle stretch (0.2 s for the controller's stop) and takes most of it
        assert t0 - 0.2 <= cut["start_s"] < cut["end_s"] <= t0 + dur + 0.2
        assert cut["end_s"] - cut["start_s"] >= dur - 1.0 - 0.6  # a GOP (1 s) and the kept 0.5 s at most
        assert "idle" in cut["reason"] and cut["messages"]["/robot0/sensor/camera0/compressed"] > 0
        before, after = read_streams(source), read_streams(entry.vio_mcap)
        inside = (before.camera_ts_ns >= cut["start_ns"]) & (before.camera_ts_ns < cut["end_ns"])
        assert len(after.camera_ts_ns) == len(before.camera_ts_ns) - inside.sum()
        kept = [p for p, i in zip(before.camera_packets, inside) if not i]
        assert list(after.camera_packets) == kept  # byte for byte
        assert trim["cuts"][0]["messages"]["/robot0/sensor/camera0/compressed"] == inside.sum()


def test_label_overrides_and_reaches_the_dataset_lineage(world_task, tmp_path):
    task_dir, manifest_path, result, truth = world_task
    m = load_manifest(manifest_path)
    by_stem = {e["stem"]: e for e in result.episodes}
    bad = next(s for s, t in truth.items() if t["kind"] == "dropped" and by_stem[s]["decision"] == "drop")
    good = [s for s, t in truth.items() if not t["bad"] and by_stem[s]["decision"] == "keep"][:4]
    small = replace(m, accepted=[a for a in m.accepted if a.stem in {bad, *good}])
    labels_path = tmp_path / "labels.json"
    labels_path.write_text(json.dumps({bad: {"decision": "keep", "note": "dropped on purpose", "by": "ana"},
                                       good[0]: "drop"}))
    assert read_labels(labels_path)[good[0]] == Label("drop")
    runs = {}
    for name, labels in (("auto", None), ("labelled", labels_path)):
        r = curate(small, tmp_path / name, CurationSettings(min_task_episodes=5), labels=labels)
        runs[name] = (r, convert(r.manifest_path, tmp_path / name / "ds" / "dataset.npz",
                                 ConversionSettings(image_size=(32, 32))))
    (auto, auto_ds), (lab, lab_ds) = runs["auto"], runs["labelled"]
    curated = load_manifest(lab.manifest_path)
    kept = next(a for a in curated.accepted if a.stem == bad)
    assert kept.validation["curation"]["decided_by"] == "label"
    assert kept.validation["curation"]["label"]["note"] == "dropped on purpose"
    assert "release_height" in {f["check"] for f in kept.validation["curation"]["flags"]}
    assert next(e for e in auto.episodes if e["stem"] == bad)["decision"] == "drop"  # what the label overrules
    drop = next(r for r in curated.rejected if r.stem == good[0])
    assert drop.code == DROP_CODE and "label" in drop.reason
    # the dataset changes with the label, and its lineage says why
    lineage = {r["stem"]: r for r in json.loads(lab_ds.sidecar_path.read_text())["rejected"]}
    assert lineage[good[0]]["code"] == DROP_CODE and bad not in lineage
    auto_lineage = {r["stem"]: r for r in json.loads(auto_ds.sidecar_path.read_text())["rejected"]}
    assert auto_lineage[bad]["code"] == DROP_CODE and good[0] not in auto_lineage
    assert lab_ds.sha256 != auto_ds.sha256 and lab_ds.n_episodes == auto_ds.n_episodes
    # a person's keep reaches the dataset too, beside every automatic decision (a new user found it stopped
    # at the curated manifest)
    decided = {e["stem"]: e["curation"] for e in json.loads(lab_ds.sidecar_path.read_text())["episodes"]}
    assert decided[bad]["decided_by"] == "label" and decided[bad]["label"]["note"] == "dropped on purpose"
    assert {decided[s]["decided_by"] for s in good[1:] if s in decided} == {"auto"}
    with pytest.raises(CurationError, match="already there"):
        curate(small, tmp_path / "labelled", labels=labels_path)
    labels_path.write_text(json.dumps({"nope_0000": "drop"}))
    with pytest.raises(CurationError, match="nope_0000"):
        curate(small, tmp_path / "other", labels=labels_path)


def test_overwrite_removes_the_trimmed_copies_the_new_decision_does_not_use(world_task, tmp_path):
    """A first curate trimmed an idle episode into trimmed/<stem>_vio.mcap; a re-run with --labels keeping it
    untrimmed and --overwrite left the copy behind. Only curate's own recorded copies are removed."""
    _, manifest_path, _, truth = world_task
    m = load_manifest(manifest_path)
    idle = sorted(s for s, t in truth.items() if t["kind"] == "idle")
    small = replace(m, accepted=[a for a in m.accepted if a.stem in idle])
    out = tmp_path / "cur"
    first = curate(small, out)
    copies = {s: out / "trimmed" / f"{s}_vio.mcap" for s in idle}
    assert [e["decision"] for e in first.episodes] == ["trim"] * len(idle) and all(p.is_file() for p in copies.values())
    stranger = out / "trimmed" / "mine.txt"
    stranger.write_text("not curate's")
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps({idle[0]: "keep"}))
    second = curate(small, out, labels=labels, overwrite=True)
    assert second.removed == [copies[idle[0]].absolute()] and not copies[idle[0]].exists()
    assert copies[idle[1]].is_file() and stranger.is_file()
    kept = next(a for a in load_manifest(second.manifest_path).accepted if a.stem == idle[0])
    assert kept.vio_mcap == m.accepted[[a.stem for a in m.accepted].index(idle[0])].vio_mcap
    assert f"removed {copies[idle[0]].absolute()}" in second.table()
