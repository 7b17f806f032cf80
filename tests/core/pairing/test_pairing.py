"""Exact pairing: each bad input rejected with its code and reason, or accepted with the fault measured."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dpflow_core.errors import InvalidNameError, PairingError
from dpflow_core.pairing import (
    load_manifest,
    manifest_path_for,
    pair_recordings,
    parse_vio_status,
    save_manifest,
    write_manifest,
)
from recording_fixtures import (
    TOPICS,
    copy_episode,
    cut_at_fraction,
    cut_closing_magic,
    refresh_vio_result,
    rewrite_mcap,
    write_small_episode,
    write_small_task,
)

GOOD = ("pick_place_0000", "pick_place_0001")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A task folder with two good episodes and one stem per bad input; paired once."""
    base = tmp_path_factory.mktemp("pairing")
    good = write_small_task(base, episodes=2, seed=0)
    d = base / "pick_place"
    ep = lambda stem, seed, **kw: write_small_episode(d, stem, seed=seed, **kw)  # noqa: E731

    ep("trunc", 1)
    cut_at_fraction(d / "trunc_vio.mcap", 0.6)
    ep("nomagic", 2)
    cut_closing_magic(d / "nomagic_vio.mcap")
    ep("chunkonly", 3)
    rewrite_mcap(d / "chunkonly_vio.mcap", d / "chunkonly_vio.mcap", chunk_index_only=True)
    ep("ooo", 4, pose_out_of_order=3)
    ep("pframes", 5, drop_first_idr=True)
    ep("late", 6, camera_start_delay_s=0.4)
    ep("failed", 7, vio_status="failed")
    ep("badjson", 8)
    (d / "badjson_vio.json").write_text('{"status": "success",')
    ep("novio", 9)
    (d / "novio_vio.mcap").unlink()
    ep("empty", 10)
    (d / "empty.mcap").write_bytes(b"")
    ep("cbor", 11)
    rewrite_mcap(d / "cbor_vio.mcap", d / "cbor_vio.mcap", encodings={TOPICS.pose: "cbor"})
    ep("rawtrunc", 12)
    cut_at_fraction(d / "rawtrunc.mcap", 0.6)
    ep("unknownlayout", 13)
    (d / "unknownlayout_vio.json").write_text(json.dumps({"result_code": 0, "message": "done?"}))
    ep("running", 14, vio_status="running")
    ep("othertask", 15)
    (d / "othertask_vio.json").write_text(json.dumps({"status": "success", "task_name": "stack_cups"}))
    copy_episode(good[0], d, "pick_place_0000_retry1")
    shutil.copyfile(good[1].vio_mcap, d / "pick_place_0001 (1)_vio.mcap")
    copy_episode(good[0], d, "arms.merge")
    (d / "arms.merge_vio.mcap").unlink()
    (d / "arms.merge_vio.json").unlink()
    outside = base / "elsewhere"
    outside.mkdir()
    ext = write_small_episode(outside, "escape", seed=16)
    ep("escape", 16)
    (d / "escape_vio.mcap").unlink()
    (d / "escape_vio.mcap").symlink_to(ext.vio_mcap)
    sub = d / "old_run"
    write_small_episode(sub, "nested", seed=17)
    (d / ".hidden.mcap").write_bytes(b"half")
    (d / "notes.txt").write_text("operator notes")
    refresh_vio_result(d)
    # written after vio_result.json, so not listed in success_mcap_files
    ep("unlisted", 18)
    manifest = pair_recordings(d)
    return {"dir": d, "base": base, "good": good, "manifest": manifest}


def _rejects(manifest):
    return {r.stem: r for r in manifest.rejected}


def test_accepts_exactly_the_good_and_tolerable_stems(task):
    m = task["manifest"]
    assert [a.stem for a in m.accepted] == sorted([*GOOD, "chunkonly", "late", "ooo", "pframes"])
    assert m.task == "pick_place" and m.root == task["dir"]
    assert m.topics["pose"] == TOPICS.pose and m.topics["camera_schemas"] == list(TOPICS.camera_schemas)


def test_accepted_files_carry_sizes_and_sha256(task):
    m = task["manifest"]
    first = next(a for a in m.accepted if a.stem == GOOD[0])
    ep = task["good"][0]
    for role, path in (("raw_mcap", ep.raw_mcap), ("vio_mcap", ep.vio_mcap), ("vio_json", ep.vio_json)):
        entry = first.files[role]
        assert entry.path == path.resolve() and entry.path.is_absolute()
        assert entry.size_bytes == path.stat().st_size
        # The raw .mcap is never read by conversion: pairing validates it but does not hash it.
        assert entry.sha256 == (None if role == "raw_mcap" else hashlib.sha256(path.read_bytes()).hexdigest())
    assert first.vio_status == json.loads(ep.vio_json.read_text())
    v = first.validation
    assert v["indexed"] is True and v["message_counts"][TOPICS.pose] == len(ep.pose_ts_ns)
    assert v["raw_mcap"]["indexed"] is True and TOPICS.pose not in v["raw_mcap"]["message_counts"]
    assert v["warnings"] == [] and v["errors"] == []


def test_tolerated_faults_are_measured_in_the_manifest(task):
    acc = {a.stem: a.validation for a in task["manifest"].accepted}
    assert acc["ooo"]["log_time_inversions"][TOPICS.pose] == 3
    assert acc["pframes"]["leading_undecodable_packets"] == 14
    assert acc["chunkonly"]["indexed"] is False
    assert [w["code"] for w in acc["chunkonly"]["warnings"]] == ["no_index"]
    assert acc["late"]["start_offsets_s"][TOPICS.camera] > 0.4
    assert "late_start" in {w["code"] for w in acc["late"]["warnings"]}


def test_each_bad_input_has_its_code_and_reason(task):
    d = task["dir"]
    rej = _rejects(task["manifest"])
    size = lambda name: (d / name).stat().st_size  # noqa: E731
    expected = {
        "trunc": ("truncated_mcap", d / "trunc_vio.mcap",
                  f"trunc_vio.mcap: truncated MCAP: the file ends at byte {size('trunc_vio.mcap')} in the middle "
                  "of a record, before the footer (0 messages readable before the cut)"),
        "rawtrunc": ("truncated_mcap", d / "rawtrunc.mcap",
                     f"rawtrunc.mcap: truncated MCAP: the file ends at byte {size('rawtrunc.mcap')} in the middle "
                     "of a record, before the footer (0 messages readable before the cut)"),
        "nomagic": ("missing_closing_magic", d / "nomagic_vio.mcap",
                    f"nomagic_vio.mcap: missing closing magic: the file ends at byte {size('nomagic_vio.mcap')} "
                    "right after the footer (written or copied incompletely)"),
        "failed": ("failed_status", d / "failed_vio.json", "failed_vio.json says VIO failed (status = 'failed')"),
        "running": ("status_not_final", d / "running_vio.json",
                    "running_vio.json says VIO is not finished (status = 'running')"),
        "unknownlayout": ("unknown_status", d / "unknownlayout_vio.json",
                          "unknownlayout_vio.json: status unknown: no recognised status key (keys found: message, "
                          "result_code); expected a JSON object with one of the keys status, state, result, "
                          "vio_status, success, succeeded, ok (a string such as \"success\", or a boolean)"),
        "badjson": ("unparseable_status", d / "badjson_vio.json",
                    "cannot parse badjson_vio.json: Expecting property name enclosed in double quotes: "
                    "line 1 column 22 (char 21)"),
        "novio": ("missing_partner", d / "novio_vio.mcap", "missing partner novio_vio.mcap for novio.mcap, novio_vio.json"),
        "empty": ("empty_file", d / "empty.mcap", "empty.mcap is empty (0 bytes)"),
        "cbor": ("unknown_encoding", d / "cbor_vio.mcap",
                 f"cbor_vio.mcap: topic {TOPICS.pose} uses message encoding 'cbor' with schema encoding 'protobuf'; "
                 "only protobuf can be decoded"),
        "othertask": ("other_task", d / "othertask_vio.json", "othertask_vio.json names task 'stack_cups', not 'pick_place'"),
        "nested": ("other_task", d / "old_run" / "nested.mcap",
                   f"old_run/nested.mcap is in subfolder old_run/, not in the task folder {d}: another task or run"),
        "pick_place_0000_retry1": ("retry_duplicate", d / "pick_place_0000_retry1.mcap",
                                   "pick_place_0000_retry1.mcap is a retry duplicate of stem 'pick_place_0000': exact "
                                   "pairing uses pick_place_0000's files (list this stem in an explicit manifest to "
                                   "use it instead)"),
        "pick_place_0001 (1)": ("retry_duplicate", d / "pick_place_0001 (1)_vio.mcap",
                                "pick_place_0001 (1)_vio.mcap is a retry duplicate of stem 'pick_place_0001': exact "
                                "pairing uses pick_place_0001's files (list this stem in an explicit manifest to use "
                                "it instead)"),
        "arms.merge": ("unsupported_multi_arm", d / "arms.merge.mcap",
                       "arms.merge.mcap is a Matrix Studio merged (multi-arm) recording; only single-arm recordings "
                       "are converted and an arm is never dropped silently: use each arm's own recordings"),
        "escape": ("path_escapes_root", d / "escape_vio.mcap",
                   f"escape_vio.mcap is a link to {task['base'] / 'elsewhere' / 'escape_vio.mcap'}, outside the "
                   f"root {d}"),
        "unlisted": ("status_conflict", d / "vio_result.json",
                     "unlisted_vio.json says success but vio_result.json does not list unlisted in success_mcap_files"),
    }
    got = {stem: (r.code, Path(r.path), r.reason) for stem, r in rej.items()}
    assert got == expected


def test_hidden_and_unrelated_files_are_ignored(task):
    m = task["manifest"]
    names = {Path(r.path).name for r in m.rejected} | {a.raw_mcap.name for a in m.accepted}
    assert ".hidden.mcap" not in names and "notes.txt" not in names


def test_one_bad_episode_never_stops_the_others(task):
    m = task["manifest"]
    assert len(m.accepted) + len(m.rejected) == 6 + 17


def test_manifest_round_trip_and_overwrite_rules(task, tmp_path):
    m = task["manifest"]
    path = write_manifest(m, tmp_path / "manifest.json")
    data = json.loads(path.read_text())
    assert list(data) == ["manifest_version", "root", "task", "created_at", "topics", "accepted", "rejected"]
    assert data["manifest_version"] == 1
    assert list(data["accepted"][0]) == ["stem", "files", "vio_status", "validation"]
    assert list(data["accepted"][0]["files"]["vio_mcap"]) == ["path", "size_bytes", "sha256"]
    assert list(data["rejected"][0]) == ["stem", "path", "code", "reason"]
    loaded = load_manifest(path)
    assert loaded.to_dict() == m.to_dict()
    assert loaded.content_hash() == m.content_hash()
    assert loaded.accepted[0].vio_mcap == m.accepted[0].vio_mcap
    assert loaded.topic_map() == TOPICS
    with pytest.raises(PairingError) as exc:
        write_manifest(m, path)
    assert exc.value.code == "output_exists" and exc.value.path == str(path)
    before = path.read_text()
    write_manifest(m, path, overwrite=True)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temp files left


def test_content_hash_ignores_created_at(task):
    again = pair_recordings(task["dir"])
    assert again.content_hash() == task["manifest"].content_hash()
    assert manifest_path_for("/w", again).name == f"pick_place-{again.content_hash()[:12]}.json"


def test_save_manifest_is_content_addressed(task, tmp_path):
    m = task["manifest"]
    path, written = save_manifest(m, tmp_path)
    assert written and path == tmp_path / "manifests" / f"pick_place-{m.content_hash()[:12]}.json"
    path2, written2 = save_manifest(m, tmp_path)
    assert path2 == path and not written2
    path.write_text(path.read_text().replace('"pick_place_0000"', '"renamed"', 1))
    with pytest.raises(PairingError, match="a different manifest already has this name"):
        save_manifest(m, tmp_path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("accepted"), "malformed manifest: manifest has no 'accepted'"),
        (lambda d: d.update(manifest_version=2), "unsupported manifest_version 2 (expected 1)"),
        (lambda d: d["accepted"][0]["files"].pop("vio_json"), "malformed manifest: accepted[0].files has no 'vio_json'"),
        (lambda d: d["accepted"][0]["files"]["raw_mcap"].update(size_bytes="12"),
         "malformed manifest: accepted[0].files.raw_mcap.size_bytes has type str"),
        (lambda d: d["rejected"][0].pop("code"), "malformed manifest: rejected[0] has no 'code'"),
    ],
)
def test_load_manifest_names_the_file_and_field(task, tmp_path, mutate, message):
    data = task["manifest"].to_dict()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PairingError) as exc:
        load_manifest(path)
    assert exc.value.reason == message and exc.value.path == str(path)


def test_load_manifest_unparseable_and_missing(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text("{")
    with pytest.raises(PairingError) as exc:
        load_manifest(bad)
    assert exc.value.path == str(bad) and exc.value.reason.startswith("cannot parse manifest:")
    with pytest.raises(PairingError) as exc:
        load_manifest(tmp_path / "none.json")
    assert exc.value.code == "missing_manifest"


def test_empty_or_wrong_root_folder(tmp_path):
    with pytest.raises(PairingError) as exc:
        pair_recordings(tmp_path)
    assert exc.value.reason == f"no <STEM>.mcap files under {tmp_path}" and exc.value.code == "no_recordings"
    with pytest.raises(PairingError) as exc:
        pair_recordings(tmp_path / "nope")
    assert exc.value.reason == f"no <STEM>.mcap files under {tmp_path / 'nope'}: no such folder"
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "stack_cups").mkdir()
    (tmp_path / "stack_cups" / "a.mcap").write_bytes(b"x")
    with pytest.raises(PairingError) as exc:
        pair_recordings(tmp_path)
    assert exc.value.reason == (
        f"no <STEM>.mcap files under {tmp_path} (task folders below it: stack_cups; pass one of them as the root)"
    )


def test_task_name_checks(task, tmp_path):
    with pytest.raises(InvalidNameError):
        pair_recordings(task["dir"], task="x; rm -rf ~")
    other = pair_recordings(task["dir"], task="stack_cups")
    assert other.accepted == []
    reasons = {r.stem: r.reason for r in other.rejected}
    assert reasons[GOOD[0]] == "vio_result.json names task 'pick_place', not 'stack_cups'"


def test_unparseable_task_summary_is_listed_and_cross_check_skipped(tmp_path):
    eps = write_small_task(tmp_path, episodes=1, seed=3)
    d = tmp_path / "pick_place"
    (d / "vio_result.json").write_text("not json")
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == [eps[0].stem]
    assert [(r.stem, r.code) for r in m.rejected] == [("", "unparseable_status")]
    assert m.rejected[0].reason.startswith("cannot parse vio_result.json: JSONDecodeError:")
    assert m.rejected[0].reason.endswith("; the task-level cross-check was skipped")


def test_explicit_manifest_for_other_naming_schemes(task, tmp_path):
    root = tmp_path / "renamed"
    for sub in ("raw", "vio", "status"):
        (root / sub).mkdir(parents=True)
    src = task["good"][0]
    shutil.copyfile(src.raw_mcap, root / "raw" / "take1.mcap")
    shutil.copyfile(src.vio_mcap, root / "vio" / "take1.vio.mcap")
    shutil.copyfile(src.vio_json, root / "status" / "take1.json")
    outside = tmp_path / "outside.mcap"
    shutil.copyfile(src.raw_mcap, outside)
    entries = [
        {"stem": "take1", "raw_mcap": "raw/take1.mcap", "vio_mcap": "vio/take1.vio.mcap", "vio_json": "status/take1.json"},
        {"stem": "take1", "raw_mcap": "raw/take1.mcap", "vio_mcap": "vio/take1.vio.mcap", "vio_json": "status/take1.json"},
        {"stem": "sneaky", "raw_mcap": "../outside.mcap", "vio_mcap": "vio/take1.vio.mcap", "vio_json": "status/take1.json"},
        {"stem": "gone", "raw_mcap": "raw/gone.mcap", "vio_mcap": "vio/take1.vio.mcap", "vio_json": "status/take1.json"},
        {"stem": "partial", "raw_mcap": "raw/take1.mcap"},
    ]
    spec = tmp_path / "pairs.json"
    spec.write_text(json.dumps({"episodes": entries}))
    m = pair_recordings(root, explicit_manifest=spec, task="pick_place")
    assert [a.stem for a in m.accepted] == ["take1"]
    assert m.accepted[0].files["vio_mcap"].sha256 == hashlib.sha256(src.vio_mcap.read_bytes()).hexdigest()
    got = {(r.stem, r.code): r.reason for r in m.rejected}
    assert got == {
        ("take1", "duplicate_stem"): "pairs.json: entry 1 repeats stem 'take1'; the first entry is used",
        ("sneaky", "path_escapes_root"): f"outside.mcap resolves to {outside}, outside the root {root}",
        ("gone", "missing_file"): "gone.mcap: file not found",
        ("partial", "invalid_manifest_entry"): "pairs.json: entry 4 lacks vio_mcap, vio_json",
    }
    spec.write_text("[1, 2")
    with pytest.raises(PairingError) as exc:
        pair_recordings(root, explicit_manifest=spec)
    assert exc.value.path == str(spec) and exc.value.code == "bad_manifest"


@pytest.mark.parametrize(
    "doc, state",
    [
        ({"status": "success"}, "success"),
        ({"status": "SUCCEEDED"}, "success"),
        ({"state": "failed"}, "failed"),
        ({"success": False}, "failed"),
        ({"result": {"status": "ok"}}, "success"),
        ({"vio": {"state": "in progress"}}, "running"),
        ({"status": 0}, "unknown"),
        ({"status": "weird"}, "unknown"),
        ([1, 2], "unknown"),
    ],
)
def test_parse_vio_status_layouts(doc, state):
    assert parse_vio_status(doc) == state


def test_cli_pair_matches_the_core_function(task, tmp_path):
    out = tmp_path / "m.json"
    proc = subprocess.run(["dpflow", "pair", str(task["dir"]), "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"task pick_place: 6 accepted, 17 rejected -> {out}" in " ".join(proc.stdout.split())
    assert load_manifest(out).content_hash() == task["manifest"].content_hash()
    again = subprocess.run(["dpflow", "pair", str(task["dir"]), "-o", str(out)], capture_output=True, text=True)
    assert again.returncode == 2 and "manifest already exists" in again.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(["dpflow", "pair", str(empty), "-o", str(tmp_path / "x.json")], capture_output=True, text=True)
    assert proc.returncode == 2 and f"no <STEM>.mcap files under {empty}" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def _bytes_read() -> int:
    """Bytes this process has read through read() so far (Linux /proc/self/io ``rchar``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_pairing_reads_each_input_byte_once(tmp_path):
    """Validation and hashing share one read of each file: the bytes read while pairing are
    the task's own bytes once (plus small reads: the magic re-check, vio_result.json), never twice."""
    write_small_task(tmp_path, episodes=2, seed=3)
    task_dir = tmp_path / "pick_place"
    sizes = sum(p.stat().st_size for p in task_dir.iterdir() if p.is_file())
    pair_recordings(task_dir)  # warm-up: imports and schema caches read nothing twice after this
    before = _bytes_read()
    m = pair_recordings(task_dir)
    read = _bytes_read() - before
    assert len(m.accepted) == 2
    assert sizes <= read < 1.2 * sizes, (read, sizes)
