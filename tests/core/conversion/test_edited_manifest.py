"""A pairing manifest edited by hand, or a file replaced since pairing: conversion refuses the entry by name.

Three small episodes are paired for real; the manifest is then edited so that stem ``pick_place_0000`` points at
``pick_place_0001``'s files (the ground truth: which recording each file holds is known by construction).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recording_fixtures import rewrite_mcap, write_small_task

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.pairing import pair_recordings, save_manifest
from dpflow_core.recordings.topics import DAS_DEFAULT

SIZE = (32, 24)


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """A task folder of three episodes (the last with repeated pose and gripper capture times, which
    pairing and conversion both count once) and its manifest as pairing wrote it."""
    root = tmp_path_factory.mktemp("edited")
    eps = write_small_task(root, episodes=3)
    last = eps[-1].vio_mcap
    rewrite_mcap(last, last.with_suffix(".tmp"), duplicate_first={DAS_DEFAULT.pose: 2, DAS_DEFAULT.gripper: 3})
    last.with_suffix(".tmp").replace(last)
    path, _ = save_manifest(pair_recordings(root / "pick_place"), root / "work")
    assert [a["stem"] for a in json.loads(path.read_text())["accepted"]] == [e.stem for e in eps]
    return path, eps


def _convert(manifest: dict, out: Path):
    return convert(manifest, out / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1, cache=False)


def _edited(paired, roles=("vio_mcap",), validation: tuple = ()) -> dict:
    """The manifest with entry 0's files of ``roles`` (path, size, SHA-256) copied from entry 1's, and
    its ``validation`` keys ``validation`` copied too."""
    m = json.loads(paired[0].read_text())
    first, second = m["accepted"][0], m["accepted"][1]
    for role in roles:
        first["files"][role] = dict(second["files"][role])
    for key in validation:
        first["validation"][key] = second["validation"][key]
    return m


def test_a_manifest_as_paired_converts_every_episode(paired, tmp_path):
    r = _convert(json.loads(paired[0].read_text()), tmp_path)
    assert r.rejected == [] and r.n_episodes == 3


def test_a_vio_file_named_for_another_stem_is_refused_and_its_owner_kept(paired, tmp_path):
    """The user's edit: stem 0000 points at 0001's ``_vio.mcap`` with its size and SHA-256. Before, 0000 held
    0001's data and the real 0001 was dropped as its duplicate; now 0000 is refused and 0001 kept."""
    _, eps = paired
    r = _convert(_edited(paired), tmp_path)
    assert [e["stem"] for e in r.metadata["episodes"]] == [eps[1].stem, eps[2].stem]
    (reject,) = r.rejected
    assert reject["code"] == "manifest_mismatch" and reject["stem"] == eps[0].stem
    for said in (repr(eps[0].stem), eps[1].vio_mcap.name, eps[0].raw_mcap.name,
                 "the manifest was edited or the file replaced since pairing"):
        assert said in reject["reason"], reject["reason"]


def test_all_files_of_another_stem_are_refused_by_the_validated_size(paired, tmp_path):
    """Every file of entry 0 swapped for entry 1's (the names agree with each other): the size pairing
    validated for stem 0000 differs from the one recorded for its file."""
    _, eps = paired
    r = _convert(_edited(paired, roles=("raw_mcap", "vio_mcap", "vio_json")), tmp_path)
    assert [e["stem"] for e in r.metadata["episodes"]] == [eps[1].stem, eps[2].stem]
    (reject,) = r.rejected
    assert reject["code"] == "manifest_mismatch" and reject["stem"] == eps[0].stem
    v0 = json.loads(paired[0].read_text())["accepted"][0]["validation"]["size_bytes"]
    for said in (eps[1].vio_mcap.name, str(v0), str(eps[1].vio_mcap.stat().st_size), "edited"):
        assert said in reject["reason"], reject["reason"]


def test_what_the_manifest_cannot_show_the_file_read_does(paired, tmp_path):
    """The validated size copied as well: only the figures alignment measures while reading (pose count,
    camera span) show the file is not the one pairing validated for stem 0000."""
    _, eps = paired
    m = _edited(paired, roles=("raw_mcap", "vio_mcap", "vio_json"), validation=("size_bytes", "path"))
    r = _convert(m, tmp_path)
    by_stem = {x["stem"]: x for x in r.rejected}
    reason = by_stem[eps[0].stem]["reason"]
    assert by_stem[eps[0].stem]["code"] == "manifest_mismatch"
    assert eps[1].vio_mcap.name in reason and "pairing measured" in reason and "edited" in reason, reason
    # Entry 1 holds the same bytes as the edited entry 0, the first holder of that hash, so it is refused as
    # its duplicate before any file is read: neither trains, and both say why.
    assert by_stem[eps[1].stem]["code"] == "duplicate_episode"
    assert [e["stem"] for e in r.metadata["episodes"]] == [eps[2].stem]


def test_a_changed_file_is_named_with_its_role(paired, tmp_path):
    _, eps = paired
    m = json.loads(paired[0].read_text())
    m["accepted"][0]["files"]["vio_mcap"]["size_bytes"] += 1
    m["accepted"][0]["validation"]["size_bytes"] += 1
    r = _convert(m, tmp_path)
    (reject,) = r.rejected
    assert reject["code"] == "input_changed"
    assert reject["reason"].startswith(f"{eps[0].vio_mcap} (the episode's vio_mcap): size is "), reject["reason"]
    assert "the file changed since pairing, or the manifest was edited" in reject["reason"]
