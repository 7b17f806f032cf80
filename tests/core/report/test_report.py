"""Episode quality report on sample recordings with known faults."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.errors import DpflowError, PairingError, RecordingError
from dpflow_core.report import OUTLIER_Z, episode_quality, flag_outliers, markdown_table, quality_figures, report_dir_for, write_report
from dpflow_core.recordings.samples import SampleSpec, write_episode, write_task

FPS = 30.0
SMALL = SampleSpec(width=160, height=120)
GAP = (0.51, 1.01)  # pose_valid false; not on a frame boundary


def _manifest(task_dir: Path, episodes) -> dict:
    return {
        "task": task_dir.name,
        "root": str(task_dir),
        "accepted": [
            {
                "stem": e.stem,
                "files": {"vio_mcap": {"path": e.vio_mcap.name, "sha256": hashlib.sha256(e.vio_mcap.read_bytes()).hexdigest()}},
                "validation": {},
            }
            for e in episodes
        ],
        "rejected": [{"stem": "pick_place_9999", "reason": "vio status failed"}],
    }


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """Three ordinary 2-s episodes, one with a pose_valid gap, one long one with camera faults."""
    root = tmp_path_factory.mktemp("recordings")
    eps = write_task(root, episodes=3, seconds=2.0, spec=SMALL)
    task_dir = root / "pick_place"
    gap = write_episode(task_dir, "pick_place_0003", replace(SMALL, seconds=2.0, pose_invalid=(GAP,)), seed=3)
    long = write_episode(
        task_dir, "pick_place_0004",
        replace(SMALL, seconds=4.0, drop_first_idr=True, missing_frames=(40, 41, 42)), seed=4,
    )
    manifest = _manifest(task_dir, [*eps, gap, long])
    path = root / "manifest.json"
    path.write_text(json.dumps(manifest))
    return {"path": path, "manifest": manifest, "episodes": [*eps, gap, long], "gap": gap, "long": long}


@pytest.fixture(scope="module")
def qualities(task):
    return {q.stem: q for q in episode_quality(task["path"])}


def test_pose_valid_gap_measured_within_one_frame(task, qualities):
    q, truth = qualities["pick_place_0003"], task["gap"]
    assert len(q.pose_gaps) == 1
    gap = q.pose_gaps[0]
    assert abs(gap.duration_s - (GAP[1] - GAP[0])) <= 1 / FPS
    t0 = min(int(truth.camera_ts_ns[0]), int(truth.pose_ts_ns[0]), int(truth.gripper_ts_ns[0]))
    expected_start = (int(truth.pose_ts_ns[0]) - t0) / 1e9 + GAP[0]
    assert abs(gap.start_s - expected_start) <= 1 / FPS
    assert abs(gap.n_poses - (GAP[1] - GAP[0]) * FPS) <= 1
    assert q.valid_fraction == pytest.approx(1 - gap.n_poses / q.n_pose)
    # invalid poses carry scores in [0, 0.3]: the minimum comes from the gap
    assert q.score_min < 0.3 < q.score_p95
    assert all(not other.pose_gaps for s, other in qualities.items() if s != "pick_place_0003")


def test_rates_durations_and_gripper_range(task, qualities):
    for e in task["episodes"]:
        q = qualities[e.stem]
        assert q.camera_hz == pytest.approx(FPS, abs=0.3)
        assert q.pose_hz == pytest.approx(FPS, abs=0.3)
        assert q.gripper_hz == pytest.approx(SMALL.gripper_hz, abs=0.5)
        assert q.n_camera == len(e.camera_ts_ns) and q.n_pose == len(e.pose_ts_ns)
        assert q.gripper_min_m == pytest.approx(float(e.gripper_width_m.min()))
        assert q.gripper_max_m == pytest.approx(float(e.gripper_width_m.max()))
        assert q.sha256 == hashlib.sha256(e.vio_mcap.read_bytes()).hexdigest()
        # overlap of the three streams: camera and pose share their frame clock, so
        # it is the camera span clipped by the gripper stream
        lo = max(int(e.camera_ts_ns[0]), int(e.pose_ts_ns[0]), int(e.gripper_ts_ns[0]))
        hi = min(int(e.camera_ts_ns[-1]), int(e.pose_ts_ns[-1]), int(e.gripper_ts_ns[-1]))
        assert q.duration_s == pytest.approx((hi - lo) / 1e9)
        assert q.recorded_s >= q.duration_s
    assert qualities["pick_place_0003"].duration_s == pytest.approx(2.0 - 1 / FPS, abs=2 / FPS)
    assert qualities["pick_place_0004"].duration_s == pytest.approx(4.0 - 1 / FPS, abs=2 / FPS)


def test_dropped_and_undecodable_frames(qualities):
    faulty = qualities["pick_place_0004"]
    assert faulty.frames_dropped == 3
    # the first IDR is gone: the P-frames up to the next IDR (gop 30) cannot be decoded
    assert faulty.frames_undecodable == SMALL.gop_size - 1
    for stem in ("pick_place_0000", "pick_place_0001", "pick_place_0002", "pick_place_0003"):
        assert qualities[stem].frames_dropped == 0
        assert qualities[stem].frames_undecodable == 0


def test_outliers_flagged_against_task_median(qualities):
    flagged = {s for s, q in qualities.items() if q.is_outlier}
    assert flagged == {"pick_place_0003", "pick_place_0004"}
    assert qualities["pick_place_0004"].robust_z["duration_s"] > OUTLIER_Z
    assert any(r.startswith("duration") for r in qualities["pick_place_0004"].outlier_reasons)
    assert qualities["pick_place_0003"].robust_z["pose_gap_total_s"] > OUTLIER_Z
    assert any(r.startswith("pose_valid gaps") for r in qualities["pick_place_0003"].outlier_reasons)
    assert abs(qualities["pick_place_0000"].robust_z["duration_s"]) < OUTLIER_Z


def test_task_figures_of_the_quality_table(qualities):
    """Five episodes, two of them outliers (above): their durations summed, the median of five scores."""
    figures = quality_figures(list(qualities.values()))
    assert figures["outliers"] == 2
    assert figures["total_duration_s"] == pytest.approx(math.fsum(q.duration_s for q in qualities.values()))
    assert figures["median_vio_score"] == float(np.median([q.score_median for q in qualities.values()]))
    assert quality_figures([]) == {"outliers": 0, "total_duration_s": 0.0, "median_vio_score": 0.0}
    assert report_dir_for("/w", "/w/manifests/pick_place-0123456789ab.json") == Path("/w/reports/pick_place-0123456789ab")


def test_identical_episodes_flag_nothing_and_a_low_score_is_flagged(qualities):
    base = qualities["pick_place_0000"]
    same = flag_outliers([replace(base, stem=f"e{i}") for i in range(5)])
    assert [q.outlier_reasons for q in same] == [()] * 5
    assert all(z == 0.0 for q in same for z in q.robust_z.values())
    low = flag_outliers([replace(base, stem=f"e{i}", score_median=0.9 + 0.005 * i) for i in range(5)]
                        + [replace(base, stem="bad", score_median=0.6)])
    assert [q.stem for q in low if q.is_outlier] == ["bad"]
    assert low[-1].robust_z["score_median"] < -OUTLIER_Z


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_write_report_html_json_and_previews(task, tmp_path):
    out = tmp_path / "report"
    result = write_report(task["path"], out)
    assert result.outliers == ["pick_place_0003", "pick_place_0004"]
    html = result.html_path.read_text()
    for e in task["episodes"]:
        png = out / "previews" / f"{e.stem}.png"
        assert _png_size(png) == (900, 400)
        assert f'src="previews/{e.stem}.png"' in html
    assert html.count('class="outlier"') == 2
    assert "pick_place_9999" in html and "vio status failed" in html
    data = json.loads(result.json_path.read_text())
    assert [e["stem"] for e in data["episodes"]] == [e.stem for e in task["episodes"]]
    gap = next(e for e in data["episodes"] if e["stem"] == "pick_place_0003")
    assert gap["is_outlier"] and gap["pose_gaps"][0]["n_poses"] >= 14
    with pytest.raises(DpflowError) as err:
        write_report(task["path"], out)
    assert err.value.code == "output_exists"
    one = dict(task["manifest"], accepted=task["manifest"]["accepted"][:1])
    again = write_report(one, out, overwrite=True)
    assert again.html_path == result.html_path
    assert [e["stem"] for e in json.loads(again.json_path.read_text())["episodes"]] == ["pick_place_0000"]
    assert 'class="outlier"' not in again.html_path.read_text()


def test_markdown_table(qualities):
    eps = list(qualities.values())
    md = markdown_table(eps, {q.stem: f"previews/{q.stem}.png" for q in eps})
    lines = md.splitlines()
    assert len(lines) == 2 + len(eps)
    assert lines[0].count("|") == lines[2].count("|") - lines[2].count("\\|")
    assert "![pick_place_0004](previews/pick_place_0004.png)" in md
    assert sum("**" in line for line in lines) == 2


def test_bad_manifest_and_missing_recording(tmp_path, task):
    bad = tmp_path / "m.json"
    bad.write_text("{not json")
    with pytest.raises(PairingError, match="not valid JSON") as err:
        episode_quality(bad)
    assert err.value.path == str(bad)
    m = json.loads(json.dumps(task["manifest"]))
    m["accepted"][0]["files"]["vio_mcap"]["path"] = "gone_vio.mcap"
    with pytest.raises(RecordingError, match="file not found") as err:
        episode_quality(m)
    assert err.value.path.endswith("gone_vio.mcap")



def test_cli_report(task, tmp_path):
    from typer.testing import CliRunner

    from dpflow_core.cli import app

    out = tmp_path / "cli_report"
    res = CliRunner().invoke(app, ["report", str(task["path"]), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "5 episodes, 2 outliers" in res.output
    assert (out / "report.html").is_file()
    n_png = len(list((out / "previews").glob("*.png")))
    assert n_png == 5
    assert np.isfinite(json.loads((out / "quality.json").read_text())["episodes"][0]["duration_s"])


def test_cli_report_takes_a_task_folder_and_names_a_wrong_path(task, tmp_path):
    """A task folder is paired first (its manifest kept in OUT/manifests/), as convert and curate do; a
    misspelt path says what was expected, for report and curate alike."""
    from typer.testing import CliRunner

    from dpflow_core.cli import app

    folder = task["path"].parent / "pick_place"
    out = tmp_path / "folder_report"
    res = CliRunner().invoke(app, ["report", str(folder), "-o", str(out)])
    assert res.exit_code == 0, res.output
    (saved,) = (out / "manifests").glob("pick_place-*.json")
    accepted = json.loads(saved.read_text())["accepted"]
    assert len(accepted) >= 3 and f"{len(accepted)} episodes" in res.output and (out / "report.html").is_file()
    typo = tmp_path / "pick_plcae"
    for command in ("report", "curate"):
        res = CliRunner().invoke(app, [command, str(typo), "-o", str(tmp_path / command)])
        assert isinstance(res.exception, PairingError), (command, res.output)
        assert res.exception.path == str(typo) and res.exception.code == "missing_manifest"
        assert res.exception.reason == "no such file or folder (expected a pairing manifest or a task folder)"
        assert not (tmp_path / command).exists()
