"""Odd files a user's tools make (issue 28): a byte-order mark, a vio_result.json that parses but
says nothing, names that are not UTF-8."""

from __future__ import annotations

import json

import pytest

from dpflow_core.pairing import pair_recordings
from recording_fixtures import write_small_task

BOM = b"\xef\xbb\xbf"


def test_vio_json_with_a_byte_order_mark_is_accepted(tmp_path):
    eps = write_small_task(tmp_path, episodes=2, seed=3)
    d = tmp_path / "pick_place"
    bom = d / f"{eps[1].stem}_vio.json"
    bom.write_bytes(BOM + bom.read_bytes())
    summary = d / "vio_result.json"
    summary.write_bytes(BOM + summary.read_bytes())
    m = pair_recordings(d)
    assert sorted(a.stem for a in m.accepted) == sorted(e.stem for e in eps)
    assert m.rejected == []
    # the BOM file's status was read, not guessed: it still says what the writer wrote
    assert next(a for a in m.accepted if a.stem == eps[1].stem).vio_status["status"] == "success"


@pytest.mark.parametrize("content,code,words", [
    ([], "bad_task_summary", "holds an empty list"),
    ({"succes_mcap_files": ["x.mcap"]}, "bad_task_summary", "misspelt? 'succes_mcap_files' for 'success_mcap_files'"),
    ({"task_name": "pick_place", "failed_mcap_file": []}, "bad_task_summary", "'failed_mcap_file' for 'failed_mcap_files'"),
    ({"files": []}, "bad_task_summary", "no success_mcap_files or failed_mcap_files key (keys: 'files')"),
    ("done", "bad_task_summary", "holds a JSON str"),
])
def test_a_task_summary_that_says_nothing_is_named(tmp_path, content, code, words):
    eps = write_small_task(tmp_path, episodes=1, seed=4)
    d = tmp_path / "pick_place"
    (d / "vio_result.json").write_text(json.dumps(content))
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == [eps[0].stem]
    (r,) = m.rejected
    assert (r.stem, r.code) == ("", code) and r.path == str(d / "vio_result.json")
    assert words in r.reason and r.reason.endswith("; the task-level cross-check was skipped"), r.reason


@pytest.mark.parametrize("stem", ["../../x", "..", "a/b", ".hidden", "x; rm -rf ~"])
def test_a_hand_edited_manifest_stem_never_reaches_a_path(tmp_path, stem):
    """Every reader of a manifest (convert, its cache, report, export) loads it through load_manifest."""
    from dpflow_core.errors import PairingError
    from dpflow_core.pairing import write_manifest
    from dpflow_core.pairing.manifest import load_manifest

    write_small_task(tmp_path, episodes=1, seed=5)
    path = write_manifest(pair_recordings(tmp_path / "pick_place"), tmp_path / "manifest.json")
    data = json.loads(path.read_text())
    data["accepted"][0]["stem"] = stem
    path.write_text(json.dumps(data))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(PairingError) as err:
        load_manifest(path)
    assert err.value.code == "bad_manifest" and "accepted[0]" in str(err.value) and repr(stem) in str(err.value)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
