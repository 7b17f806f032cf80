"""convert(): paired episodes -> dataset.npz + dataset.json + norm_stats.json."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.recordings import samples
from dpflow_core.conversion import CONVERTER_VERSION, ConversionSettings, align_episode, convert, dataset_key
from dpflow_core.conversion.dataset_npz import RUN_ONLY_EPISODE_KEYS, RUN_ONLY_KEYS
from dpflow_core.errors import ConversionError
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.recordings.topics import DAS_DEFAULT

SPEC = samples.SampleSpec(seconds=2.5, width=160, height=120, gop_size=15)
SIZE = (64, 48)
CONTRACT_KEYS = {"path", "sha256", "size_bytes", "sidecar_path", "norm_stats_path", "frequency_hz", "n_episodes",
                 "total_steps", "image_size"}


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _entry(path: Path) -> dict:
    return {"path": str(path), "size_bytes": path.stat().st_size, "sha256": _sha(path)}


def manifest_for(episodes, root, task="pick", rejected=()) -> dict:
    """A pairing manifest dict (manifest_version 1 layout) accepting ``episodes``."""
    return {
        "manifest_version": 1,
        "root": str(root),
        "task": task,
        "created_at": "2026-01-01T00:00:00+00:00",
        "topics": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(DAS_DEFAULT).items()},
        "accepted": [
            {"stem": e.stem,
             "files": {"raw_mcap": _entry(e.raw_mcap), "vio_mcap": _entry(e.vio_mcap), "vio_json": _entry(e.vio_json)},
             "vio_status": {"status": "success"}, "validation": {}}
            for e in episodes
        ],
        "rejected": list(rejected),
    }


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("conv")
    eps = [samples.write_episode(root / "pick", f"pick_{k:04d}", replace(SPEC, seconds=2.2 + 0.3 * k), seed=20 + k)
           for k in range(3)]
    return root / "pick", eps


@pytest.fixture(scope="module")
def converted(task, tmp_path_factory):
    root, eps = task
    out = tmp_path_factory.mktemp("out") / "dataset.npz"
    result = convert(manifest_for(eps, root), out, ConversionSettings(image_size=SIZE), workers=2)
    return result, eps


def test_dataset_holds_the_aligned_episodes(converted):
    result, eps = converted
    z = np.load(result.path)
    aligned = [align_episode(e.vio_mcap, ConversionSettings(image_size=SIZE)) for e in eps]
    lengths = [len(a) for a in aligned]
    np.testing.assert_array_equal(z["meta__episode_ends"], np.cumsum(lengths))
    assert z["meta__episode_ends"].dtype == np.int64
    np.testing.assert_array_equal(z["data__camera0_rgb"], np.concatenate([a.rgb for a in aligned]))
    np.testing.assert_array_equal(z["data__robot0_eef_pos"], np.concatenate([a.eef_pos for a in aligned]))
    np.testing.assert_array_equal(z["data__robot0_eef_rot_axis_angle"],
                                  np.concatenate([a.eef_rot_axis_angle for a in aligned]))
    np.testing.assert_array_equal(z["data__robot0_gripper_width"], np.concatenate([a.gripper_width for a in aligned]))
    np.testing.assert_array_equal(z["data__timestamp"], np.concatenate([a.timestamps_s for a in aligned]))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for a, s, n in zip(aligned, starts, lengths):
        np.testing.assert_array_equal(z["data__robot0_demo_start_pose"][s : s + n],
                                      np.tile(np.r_[a.eef_pos[0], a.eef_rot_axis_angle[0]], (n, 1)))
        np.testing.assert_array_equal(z["data__robot0_demo_end_pose"][s : s + n],
                                      np.tile(np.r_[a.eef_pos[-1], a.eef_rot_axis_angle[-1]], (n, 1)))
        assert z["data__timestamp"][s] == 0.0
    expected = {
        "data__camera0_rgb": ((sum(lengths), SIZE[1], SIZE[0], 3), np.uint8),
        "data__robot0_eef_pos": ((sum(lengths), 3), np.float32),
        "data__robot0_eef_rot_axis_angle": ((sum(lengths), 3), np.float32),
        "data__robot0_gripper_width": ((sum(lengths), 1), np.float32),
        "data__robot0_demo_start_pose": ((sum(lengths), 6), np.float32),
        "data__robot0_demo_end_pose": ((sum(lengths), 6), np.float32),
        "data__timestamp": ((sum(lengths),), np.float64),
    }
    for name, (shape, dtype) in expected.items():
        assert z[name].shape == shape and z[name].dtype == dtype, name
    with zipfile.ZipFile(result.path) as zf:
        assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
    rb = ReplayBuffer(result.path)
    assert rb.n_episodes == 3 and rb.n_steps == sum(lengths)
    assert isinstance(rb["camera0_rgb"], np.memmap)


def test_hash_size_and_metadata(converted):
    result, eps = converted
    out = subprocess.run(["sha256sum", str(result.path)], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == result.sha256
    assert result.size_bytes == result.path.stat().st_size
    assert result.sidecar_path == result.path.with_name("dataset.json")
    assert result.norm_stats_path == result.path.with_name("norm_stats.json")
    side = json.loads(result.sidecar_path.read_text())
    member = json.loads(np.load(result.path)["meta__info_json"].tobytes())
    assert side["sha256"] == result.sha256 and side["size_bytes"] == result.size_bytes
    assert member["sha256"] is None and member["size_bytes"] is None
    # what describes this run, not the dataset, is in the sidecar only
    assert set(side) == set(member) | set(RUN_ONLY_KEYS) and not set(member) & set(RUN_ONLY_KEYS)
    for k in set(member) - {"sha256", "size_bytes", "episodes"}:
        assert side[k] == member[k], k
    assert [{k: v for k, v in e.items() if k not in RUN_ONLY_EPISODE_KEYS} for e in side["episodes"]] == member["episodes"]
    assert all(set(RUN_ONLY_EPISODE_KEYS) <= set(e) for e in side["episodes"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", side["created_at"]) and side["workers"] == 2
    assert set(side["timings_s"]) == {"episodes", "write", "norm_stats", "total"}
    lengths = np.diff(np.r_[0, np.load(result.path)["meta__episode_ends"]])
    assert side["n_episodes"] == 3 and side["total_steps"] == int(lengths.sum())
    assert side["episode_lengths"] == {"min": int(lengths.min()), "mean": float(lengths.mean()), "max": int(lengths.max())}
    assert side["frequency_hz"] == pytest.approx(30.0, rel=0.01) == result.frequency_hz
    assert side["image_size"] == list(SIZE)
    assert side["converter"]["version"] == CONVERTER_VERSION
    assert side["keys"]["data__camera0_rgb"] == {"shape": [int(lengths.sum()), SIZE[1], SIZE[0], 3], "dtype": "uint8"}
    assert [(e["stem"], e["files"]["vio_mcap"]["sha256"]) for e in side["inputs"]["episodes"]] == [
        (e.stem, _sha(e.vio_mcap)) for e in eps]
    assert [e["frequency_hz"] for e in side["episodes"]] == pytest.approx([30.0] * 3, rel=0.01)
    rng = side["value_ranges"]["robot0_gripper_width"]
    w = np.load(result.path)["data__robot0_gripper_width"]
    assert rng == {"min": [float(w.min())], "max": [float(w.max())]}
    assert side["wall_time_s"] > 0 and result.wall_time_s == side["wall_time_s"]
    norm = json.loads(result.norm_stats_path.read_text())
    assert norm["dataset"]["sha256"] == result.sha256
    assert set(result.to_dict()) == CONTRACT_KEYS | {"rejected", "wall_time_s", "metadata", "reused"}
    assert type(result).from_dict(json.loads(json.dumps(result.to_dict()))) == result
    # nothing left beside the outputs
    assert sorted(p.name for p in result.path.parent.iterdir()) == ["dataset.json", "dataset.npz", "norm_stats.json"]


def test_one_worker_gives_the_same_arrays(converted, task, tmp_path):
    result, eps = converted
    root, _ = task
    one = convert(manifest_for(eps, root), tmp_path / "one.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert one.norm_stats_path == tmp_path / "one.norm_stats.json" and one.sidecar_path == tmp_path / "one.json"
    a, b = np.load(result.path), np.load(one.path)
    for name in a.files:
        if name != "meta__info_json":
            np.testing.assert_array_equal(a[name], b[name])


def test_converting_twice_gives_a_byte_identical_dataset(converted, task, tmp_path):
    """Same manifest, same options (another worker count and folder): the same bytes, so the same SHA-256."""
    result, eps = converted
    root, _ = task
    again = convert(manifest_for(eps, root), tmp_path / "again" / "dataset.npz", ConversionSettings(image_size=SIZE),
                    workers=1)
    assert again.path.read_bytes() == result.path.read_bytes()
    assert again.sha256 == result.sha256 == _sha(again.path)
    with zipfile.ZipFile(again.path) as zf:
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    # the run-specific facts are kept, in the sidecars
    first, second = json.loads(result.sidecar_path.read_text()), json.loads(again.sidecar_path.read_text())
    assert (first["workers"], second["workers"]) == (2, 1)
    assert first["dataset_key"] == second["dataset_key"] and first["sha256"] == second["sha256"]


def test_the_parent_of_workers_does_not_load_what_only_alignment_needs(task, tmp_path):
    """With -j 2 the converting process only writes the dataset: SciPy (Slerp) is loaded by the
    worker pool's forkserver, never by it, and the dataset is the same bytes as in-process (-j 1)."""
    root, eps = task
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(manifest_for(eps, root)))
    code = (
        "import json, sys\n"
        "from dpflow_core.conversion import ConversionSettings, convert\n"
        f"r = convert({str(manifest)!r}, {str(tmp_path / 'dataset.npz')!r}, ConversionSettings(image_size={SIZE!r}),"
        " workers=2, cache=False)\n"
        "print(json.dumps({'sha256': r.sha256, 'workers': r.metadata['workers'],\n"
        "                  'scipy': sorted(m for m in sys.modules if m.split('.')[0] == 'scipy')}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["workers"] == 2 and out["scipy"] == []
    one = convert(manifest, tmp_path / "one" / "dataset.npz", ConversionSettings(image_size=SIZE),
                  workers=1, cache=False)
    assert out["sha256"] == one.sha256 == _sha(tmp_path / "dataset.npz")


def test_bad_episodes_are_rejected_with_reasons(task, tmp_path):
    root, eps = task
    bad_root = tmp_path / "bad"
    vio40 = samples.write_episode(bad_root, "vio40", replace(SPEC, vio_coverage=(0.3, 0.7)), seed=31)
    hz20 = samples.write_episode(bad_root, "hz20", replace(SPEC, fps=20.0), seed=32)
    trunc = samples.write_episode(bad_root, "trunc", SPEC, seed=33)
    data = trunc.vio_mcap.read_bytes()
    trunc.vio_mcap.write_bytes(data[: len(data) // 2])
    changed = samples.write_episode(bad_root, "changed", SPEC, seed=34)
    m = manifest_for([*eps, vio40, hz20, trunc, changed], root)
    m["accepted"][-1]["files"]["vio_mcap"]["sha256"] = "0" * 64
    r = convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE, rate_policy="reject"), workers=2)
    assert r.n_episodes == 3
    assert [e["stem"] for e in r.metadata["episodes"]] == [e.stem for e in eps]
    by_stem = {x["stem"]: x for x in r.rejected}
    assert set(by_stem) == {"vio40", "hz20", "trunc", "changed"}
    assert by_stem["vio40"]["code"] == "low_coverage" and "cover only" in by_stem["vio40"]["reason"]
    assert by_stem["hz20"]["code"] == "frequency_mismatch"
    got = re.match(r"measured ([\d.]+) Hz differs from the dataset's ([\d.]+) Hz by ([\d.]+)% \(tolerance 5.0%\)",
                   by_stem["hz20"]["reason"])
    assert got, by_stem["hz20"]["reason"]
    assert float(got[1]) == pytest.approx(20.0, rel=0.01) and float(got[2]) == pytest.approx(30.0, rel=0.01)
    assert float(got[3]) == pytest.approx(33.3, abs=0.5)
    assert by_stem["trunc"]["code"] == "corrupt_mcap" and "truncated or corrupt" in by_stem["trunc"]["reason"]
    assert by_stem["changed"]["code"] == "input_changed" and "SHA-256" in by_stem["changed"]["reason"]
    assert json.loads(r.sidecar_path.read_text())["rejected"] == r.rejected


def test_an_episode_rejected_after_its_frames_were_written_is_cut_out(converted, task, tmp_path):
    """A 20 Hz episode second of four: its frames are appended while the later episodes align, and
    only the median over all episodes rejects it (frequency_mismatch). The dataset then holds the
    other three: every byte before the metadata member equals a conversion of those three alone
    (the metadata differs: it lists the reject), the CRC-32s check and the reader maps it."""
    result, eps = converted
    root, _ = task
    hz20 = samples.write_episode(root, "hz20", replace(SPEC, fps=20.0), seed=32)
    r = convert(manifest_for([eps[0], hz20, *eps[1:]], root), tmp_path / "dataset.npz",
                ConversionSettings(image_size=SIZE, rate_policy="reject"), workers=1, cache=False)
    assert [x["code"] for x in r.rejected] == ["frequency_mismatch"] and r.n_episodes == 3
    body, three = r.path.read_bytes(), result.path.read_bytes()
    with zipfile.ZipFile(r.path) as zf, zipfile.ZipFile(result.path) as zf3:
        assert zf.testzip() is None and zf.namelist() == zf3.namelist()
        assert zf.namelist()[0] == "data__camera0_rgb.npy" and zf.namelist()[-1] == "meta__info_json.npy"
        info_at = zf.getinfo("meta__info_json.npy").header_offset
        assert info_at == zf3.getinfo("meta__info_json.npy").header_offset
    assert body[:info_at] == three[:info_at]
    assert r.sha256 == _sha(r.path)
    rb = ReplayBuffer(r.path)
    np.testing.assert_array_equal(rb["camera0_rgb"], ReplayBuffer(result.path)["camera0_rgb"])


def test_all_rejected_manifest(tmp_path):
    rejected = [{"stem": f"s{k}", "path": f"/x/s{k}.mcap", "code": "vio_failed", "reason": "VIO status is 'failed'"}
                for k in range(3)]
    m = manifest_for([], tmp_path, task="t", rejected=rejected)
    with pytest.raises(ConversionError) as err:
        convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE))
    assert err.value.code == "no_valid_episodes"
    assert err.value.reason.startswith("no valid episodes: 3 found, 3 rejected: s0: VIO status is 'failed'; s1:")
    assert not (tmp_path / "dataset.npz").exists()


def test_all_episodes_failing_conversion(tmp_path):
    ep = samples.write_episode(tmp_path / "in", "vio40", replace(SPEC, vio_coverage=(0.3, 0.7)), seed=41)
    m = manifest_for([ep], tmp_path / "in", rejected=[{"stem": "x", "path": "/x", "code": "orphan", "reason": "no _vio.mcap"}])
    with pytest.raises(ConversionError, match=r"no valid episodes: 2 found, 2 rejected: x: no _vio.mcap; vio40: the aligned"):
        convert(m, tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_existing_output_is_refused_or_backed_up(converted, task, tmp_path):
    result, eps = converted
    root, _ = task
    out = tmp_path / "dataset.npz"
    shutil.copy(result.path, out)
    before = out.read_bytes()
    with pytest.raises(ConversionError) as err:
        convert(manifest_for(eps, root), out, ConversionSettings(image_size=SIZE), workers=1)
    assert err.value.code == "output_exists" and "refusing to overwrite existing dataset.npz" in err.value.reason
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset.npz"]

    new = convert(manifest_for(eps, root), out, ConversionSettings(image_size=(32, 24)), workers=1, backup=True)
    backups = sorted(tmp_path.glob("dataset.bak-*.npz"))
    assert len(backups) == 1 and backups[0].read_bytes() == before
    assert new.image_size == (32, 24) and ReplayBuffer(out)["camera0_rgb"].shape[1:3] == (24, 32)
    assert _sha(out) == new.sha256


def test_reuse_existing_identical_dataset(converted, task):
    result, eps = converted
    root, _ = task
    again = convert(manifest_for(eps, root), result.path, ConversionSettings(image_size=SIZE), reuse_existing=True)
    assert again.reused and again.sha256 == result.sha256 and again.total_steps == result.total_steps
    assert again.metadata["dataset_key"] == dataset_key(manifest_for(eps, root), ConversionSettings(image_size=SIZE))
    with pytest.raises(ConversionError, match="different dataset"):
        convert(manifest_for(eps, root), result.path, ConversionSettings(image_size=(32, 24)), reuse_existing=True)


def test_stale_partial_files_are_removed(converted, task, tmp_path):
    _, eps = converted
    root, _ = task
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stale = tmp_path / f".dataset.npz.partial-{proc.pid}"
    stale.write_bytes(b"PK\x03\x04 half a zip")
    (tmp_path / f".dataset.npz.work-{proc.pid}").mkdir()
    mine = tmp_path / f".dataset.npz.partial-{os.getpid()}x"  # not a pid suffix: left alone
    mine.write_bytes(b"")
    r = convert(manifest_for(eps[:2], root), tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert sorted(r.metadata["stale_files_removed"]) == sorted([stale.name, f".dataset.npz.work-{proc.pid}"])
    assert not stale.exists() and mine.exists()


@pytest.mark.slow
def test_cli_convert_and_norm_stats(task, tmp_path):
    root, eps = task
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(manifest_for(eps[:2], root)))
    out = tmp_path / "ds" / "dataset.npz"
    cmd = ["dpflow", "convert", str(manifest), "-o", str(out), "--image-size", "48,32", "-j", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["image_size"] == [48, 32] and res["n_episodes"] == 2 and res["sha256"] == _sha(out)
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 2 and "refusing to overwrite existing dataset.npz" in again.stderr
    ns = tmp_path / "ns.json"
    proc = subprocess.run(["dpflow", "norm-stats", str(out), "-o", str(ns)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(ns.read_text())
    assert stats["dataset"]["sha256"] == res["sha256"]
    assert stats["norm_stats"] == json.loads(Path(res["norm_stats_path"]).read_text())["norm_stats"]
    # printed into a pipe (no terminal width): every figure whole, none cut to an ellipsis
    assert "…" not in proc.stdout
    rows = [line.split("│") for line in proc.stdout.splitlines() if line.startswith("│")]
    for key, s in stats["norm_stats"].items():
        for d in range(len(s["mean"])):
            want = [str(d), *(f"{s[f][d]:.4g}" for f in ("mean", "std", "min", "max", "q01", "q99"))]
            assert [c.strip() for c in rows.pop(0)[2:-1]] == want, (key, d)
    assert not rows


def test_cli_convert_counts_one_episode_in_the_singular(task, tmp_path):
    root, eps = task
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(manifest_for(eps[:1], root)))
    out = tmp_path / "one" / "dataset.npz"
    proc = subprocess.run([str(Path(sys.executable).with_name("dpflow")), "convert", str(manifest), "-o", str(out),
                           "--image-size", "48,32", "-j", "1", "--no-cache"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^1 episode, \d+ steps \(lengths", proc.stdout, re.M), proc.stdout


def test_task_folder_input_is_paired(tmp_path):
    eps = samples.write_task(tmp_path, episodes=3, seconds=2.0, task="wipe",
                             spec=replace(SPEC, vio_status="success"))
    failed = samples.write_episode(tmp_path / "wipe", "wipe_0009", replace(SPEC, vio_status="failed"), seed=99)
    r = convert(tmp_path / "wipe", tmp_path / "dataset.npz", ConversionSettings(image_size=SIZE), workers=1)
    assert r.n_episodes == 3 and r.metadata["task"] == "wipe"
    assert [e["stem"] for e in r.metadata["episodes"]] == [e.stem for e in eps]
    assert failed.stem in {x["stem"] for x in r.rejected if x["stage"] == "pairing"}


def _copy_dataset(result, folder: Path) -> Path:
    folder.mkdir()
    shutil.copy(result.path, folder / "dataset.npz")
    shutil.copy(result.sidecar_path, folder / "dataset.json")
    return folder / "dataset.npz"


def _member_data_offset(npz: Path, member: str) -> int:
    """Byte offset of a stored member's array data, read with zipfile and numpy's .npy reader."""
    with zipfile.ZipFile(npz) as zf:
        info = zf.getinfo(member + ".npy")
    with open(npz, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len)
        version = np.lib.format.read_magic(f)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(f)
        return f.tell()


def _validate(*args: str) -> subprocess.CompletedProcess:
    dpflow = Path(sys.executable).with_name("dpflow")
    return subprocess.run([str(dpflow), "validate", *args], capture_output=True, text=True, timeout=120)


def test_validate_passes_a_converted_dataset(converted, tmp_path):
    result, _ = converted
    proc = _validate(str(_copy_dataset(result, tmp_path / "good")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    from dpflow_core.dataset import CHECKS

    assert [ln.split()[1].rstrip(":") for ln in lines[:-1]] == [*CHECKS, "archive_crc32", "sha256_matches_sidecar"]
    assert all(ln.startswith("PASS") for ln in lines[:-1]) and lines[-1].endswith("all blocking checks passed")


def test_validate_without_a_sidecar_says_the_sha256_was_not_checked(converted, tmp_path):
    result, _ = converted
    npz = _copy_dataset(result, tmp_path / "bare")
    npz.with_suffix(".json").unlink()
    proc = _validate(str(npz))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    *verdicts, summary = proc.stdout.splitlines()
    assert verdicts[-1] == ("WARN  sha256_matches_sidecar: no dataset.json beside the dataset: its SHA-256 was not "
                            "checked against a recorded one; the archive's own CRC-32s were")
    assert all(ln.startswith("PASS") for ln in verdicts[:-1]) and summary.endswith("all blocking checks passed")


def test_validate_of_a_file_that_is_no_dataset_says_so_once(tmp_path):
    from dpflow_core.dataset import CHECKS

    bad = tmp_path / "recording.mcap"
    bad.write_bytes(b"\x89MCAP0\r\n" + b"\0" * 64)
    proc = _validate(str(bad))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    *verdicts, summary = proc.stdout.splitlines()
    # one line per verdict (the blocking checks, then the warning), each naming its checks and the one reason
    assert [ln.split()[0] for ln in verdicts] == ["FAIL", "WARN"]
    assert all(": dataset does not open: not a readable .npz (zip) file" in ln for ln in verdicts)
    named = [name for ln in verdicts for name in ln.split(None, 1)[1].split(": ", 1)[0].split(", ")]
    assert sorted(named) == sorted(CHECKS)
    failed = verdicts[0].split(None, 1)[1].split(": ", 1)[0]
    assert summary == f"{bad}: {len(failed.split(', '))} blocking check(s) failed: {failed}"


def test_validate_fails_a_changed_byte_with_the_reason(converted, tmp_path):
    result, _ = converted
    npz = _copy_dataset(result, tmp_path / "byte")
    at = _member_data_offset(npz, "data__camera0_rgb") + 1000
    with open(npz, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0xFF]))
    proc = _validate(str(npz))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 2 and fails[0].startswith("FAIL  archive_crc32:") and "member 'data__camera0_rgb'" in fails[0]
    assert fails[1].startswith("FAIL  sha256_matches_sidecar:")
    assert _sha(npz) in fails[1] and result.sha256 in fails[1] and "changed after conversion" in fails[1]


def test_validate_fails_a_wrong_episode_ends_with_the_reason(converted, tmp_path):
    result, _ = converted
    npz = _copy_dataset(result, tmp_path / "ends")
    ends = np.load(npz)["meta__episode_ends"]
    at = _member_data_offset(npz, "meta__episode_ends")
    with open(npz, "r+b") as f:  # swap the first two episode ends: no longer increasing
        f.seek(at)
        f.write(np.array([ends[1], ends[0], *ends[2:]], dtype="<i8").tobytes())
    proc = _validate(str(npz), "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    by_name = {c["name"]: c for c in doc["checks"]}
    assert doc["passed"] is False
    assert by_name["episode_ends_valid"]["passed"] is False
    assert "episode_ends" in by_name["episode_ends_valid"]["description"]
    assert by_name["sha256_matches_sidecar"]["passed"] is False
