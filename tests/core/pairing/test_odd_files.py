"""Odd files a user's tools make (issue 28): a byte-order mark, a vio_result.json that parses but
says nothing, names that are not UTF-8."""

from __future__ import annotations

import json

import pytest

from dpflow_core.pairing import pair_recordings
from recording_fixtures import refresh_vio_result, write_small_episode, write_small_task

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


def test_a_recording_vio_result_lists_but_the_folder_lacks_is_named(tmp_path):
    """vio_result.json says two more takes were processed than the folder holds (moved or lost): each is named
    as listed_but_missing in the manifest's rejected list, the present ones pair as before."""
    import json as _json

    from dpflow_core.pairing import pair_recordings

    task = tmp_path / "pick_place"
    for k in range(2):
        write_small_episode(task, f"pick_place_{k:04d}", seed=40 + k)
    refresh_vio_result(task)
    doc = _json.loads((task / "vio_result.json").read_text())
    doc["success_mcap_files"] = list(doc["success_mcap_files"]) + ["pick_place_0007_vio.mcap", "pick_place_0009_vio.mcap"]
    (task / "vio_result.json").write_text(_json.dumps(doc))
    m = pair_recordings(task)
    assert [a.stem for a in m.accepted] == ["pick_place_0000", "pick_place_0001"]
    missing = [(r.stem, r.code) for r in m.rejected if r.code == "listed_but_missing"]
    assert missing == [("pick_place_0007", "listed_but_missing"), ("pick_place_0009", "listed_but_missing")]
    assert all(str(task) in r.reason for r in m.rejected if r.code == "listed_but_missing")


def _summary_with(d, eps, victim, layout):
    """vio_result.json of ``eps`` laid out by ``layout``: which stems go under which key."""
    names = {e.stem: f"{e.stem}_vio.mcap" for e in eps}
    ok = [names[s] for s in sorted(names) if s != victim]
    doc = {"task_name": "pick_place"}
    for key, which in layout.items():
        doc[key] = which if not isinstance(which, str) else {"ok": ok, "all": sorted(names.values()),
                                                             "victim": [names[victim]], "none": []}[which]
    (d / "vio_result.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("layout,near_miss,conflict", [
    # the trial's fault: the success list misspelt beside a correct failed list (it was read as "no success list")
    ({"sucess_mcap_files": "all", "failed_mcap_files": "none"}, "'sucess_mcap_files' for 'success_mcap_files'", False),
    ({"success_mcap_file": "all", "failed_mcap_files": "none"}, "'success_mcap_file' for 'success_mcap_files'", False),
    # the failed list misspelt: the victim, listed there, is no longer silently a success, and the reject says where
    ({"success_mcap_files": "ok", "faild_mcap_files": "victim"}, "'faild_mcap_files' for 'failed_mcap_files'", True),
    ({"success_mcap_files": "ok", "failed_mcap_file": "victim"}, "'failed_mcap_file' for 'failed_mcap_files'", True),
    # both spelt right and a third, misspelt copy beside them
    ({"success_mcap_files": "all", "failed_mcap_files": "none", "sucess_mcap_files": "victim"},
     "'sucess_mcap_files' for 'success_mcap_files'", False),
])
def test_a_misspelt_list_key_beside_a_correct_one_is_named(tmp_path, layout, near_miss, conflict):
    """Issue 28 trial: a vio_result.json with one list key misspelt and the other right was read without a word."""
    eps = write_small_task(tmp_path, episodes=3, seed=6)
    d = tmp_path / "pick_place"
    victim = eps[1].stem
    _summary_with(d, eps, victim, layout)
    m = pair_recordings(d)
    bad = [r for r in m.rejected if r.code == "bad_task_summary"]
    assert len(bad) == 1 and bad[0].stem == "" and bad[0].path == str(d / "vio_result.json"), m.rejected
    assert near_miss in bad[0].reason and "not read" in bad[0].reason and "rename the key" in bad[0].reason
    expected = sorted(e.stem for e in eps if not (conflict and e.stem == victim))
    assert sorted(a.stem for a in m.accepted) == expected
    if conflict:
        (r,) = [r for r in m.rejected if r.code == "status_conflict"]
        found = near_miss.split("'")[1]
        assert r.stem == victim and f"it lists it under {found!r}" in r.reason, r.reason
    assert len(m.rejected) == 1 + conflict


@pytest.mark.parametrize("extra", [{"total_mcap_files": 3}, {"failed_count": 0}, {"notes": "ok"}])
def test_keys_that_only_look_like_the_lists_are_no_near_miss(tmp_path, extra):
    """A key close to a list key but holding no list (a count, a note) is not named."""
    eps = write_small_task(tmp_path, episodes=2, seed=7)
    d = tmp_path / "pick_place"
    _summary_with(d, eps, eps[0].stem, {"success_mcap_files": "all", "failed_mcap_files": "none", **extra})
    m = pair_recordings(d)
    assert m.rejected == [] and len(m.accepted) == 2


@pytest.mark.parametrize("codec,bom", [("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff"),
                                       ("utf-32-le", b"\xff\xfe\x00\x00"), ("utf-32-be", b"\x00\x00\xfe\xff")])
@pytest.mark.parametrize("which", ["vio_json", "both"])
def test_status_files_in_utf16_or_utf32_with_a_byte_order_mark_are_read(tmp_path, codec, bom, which):
    """Issue 28 trial: a _vio.json saved by Notepad as "Unicode" (UTF-16 LE with a BOM) lost a good episode
    to a codec error. Each status file is re-encoded with its own non-ASCII note, so the text is really read."""
    eps = write_small_task(tmp_path, episodes=3, seed=8)
    d = tmp_path / "pick_place"
    victim = d / f"{eps[2].stem}_vio.json"
    files = [victim] + ([d / "vio_result.json"] if which == "both" else [])
    for p in files:
        doc = json.loads(p.read_text(encoding="utf-8"))
        doc["note"] = "prüfung 抓取"
        p.write_bytes(bom + json.dumps(doc, ensure_ascii=False).encode(codec))
    m = pair_recordings(d)
    assert m.rejected == [] and sorted(a.stem for a in m.accepted) == sorted(e.stem for e in eps)
    accepted = next(a for a in m.accepted if a.stem == eps[2].stem)
    assert accepted.vio_status["status"] == "success" and accepted.vio_status["note"] == "prüfung 抓取"


@pytest.mark.parametrize("encode,words", [
    (lambda t: t.encode("utf-16-le"), "UTF-16 text without a byte-order mark"),
    (lambda t: t.encode("utf-16-be"), "UTF-16 text without a byte-order mark"),
    (lambda t: t.encode("utf-32-le"), "UTF-32 text without a byte-order mark"),
    (lambda t: t.replace("success", "succèss").encode("latin-1"), "not UTF-8 text: byte 0xe8"),
    (lambda t: b"\xff\xfe" + t.encode("utf-16-le")[:-1], "UTF-16 text (byte-order mark) that does not decode"),
])
def test_status_text_in_another_encoding_is_named_with_what_to_do(tmp_path, encode, words):
    eps = write_small_task(tmp_path, episodes=2, seed=9)
    d = tmp_path / "pick_place"
    p = d / f"{eps[0].stem}_vio.json"
    p.write_bytes(encode(p.read_text(encoding="utf-8")))
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == [eps[1].stem]
    (r,) = m.rejected
    assert (r.stem, r.code) == (eps[0].stem, "unparseable_status")
    assert words in r.reason and r.reason.endswith("save it as UTF-8"), r.reason
