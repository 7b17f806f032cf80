"""Sample recordings: deterministic per seed, a valid Matrix Studio task folder, and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import av
import pytest

from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.errors import RecordingError
from dpflow_core.pairing import pair_recordings
from dpflow_core.recordings import inspect_recording, read_streams
from dpflow_core.recordings.samples import write_task
from recording_fixtures import SMALL, TOPICS, write_small_task


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    """The same task written twice with seed 7 and once with seed 8."""
    base = tmp_path_factory.mktemp("samples")
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        write_small_task(base / name, episodes=2, seed=seed)
    return base


def test_same_seed_writes_identical_files(three_runs):
    a, b = _digests(three_runs / "a" / "pick_place"), _digests(three_runs / "b" / "pick_place")
    assert sorted(a) == [
        "pick_place_0000.mcap", "pick_place_0000_vio.json", "pick_place_0000_vio.mcap",
        "pick_place_0001.mcap", "pick_place_0001_vio.json", "pick_place_0001_vio.mcap", "vio_result.json",
    ]
    assert a == b


def test_other_seed_writes_other_recordings(three_runs):
    a, c = _digests(three_runs / "a" / "pick_place"), _digests(three_runs / "c" / "pick_place")
    assert a.keys() == c.keys()
    differing = {name for name in a if a[name] != c[name]}
    assert {n for n in a if n.endswith(".mcap")} <= differing


def test_sample_folder_is_a_valid_task(three_runs):
    d = three_runs / "a" / "pick_place"
    summary = json.loads((d / "vio_result.json").read_text())
    assert summary["task_name"] == "pick_place"
    assert summary["success_mcap_files"] == ["pick_place_0000_vio.mcap", "pick_place_0001_vio.mcap"]
    m = pair_recordings(d)
    assert [a.stem for a in m.accepted] == ["pick_place_0000", "pick_place_0001"] and m.rejected == []
    for a in m.accepted:
        assert a.validation["warnings"] == []
        assert a.validation["rates_hz"][TOPICS.camera] == pytest.approx(SMALL.fps, rel=0.01)


def test_frames_decode_at_the_requested_size(three_runs):
    s = read_streams(three_runs / "a" / "pick_place" / "pick_place_0000_vio.mcap")
    ctx = av.CodecContext.create("h264", "r")
    frames = [f for data in s.camera_packets[:3] for f in ctx.decode(av.Packet(data))]
    assert (frames[0].width, frames[0].height) == (SMALL.width, SMALL.height)
    img = frames[0].to_ndarray(format="rgb24")
    assert img.std() > 10  # a textured scene, not a flat frame


def test_write_task_refuses_a_folder_with_recordings(three_runs):
    with pytest.raises(FileExistsError, match="already holds recordings"):
        write_task(three_runs / "a", episodes=1, seconds=1.0, spec=SMALL)


def test_cli_sample_recordings(tmp_path):
    args = ["sample-recordings", str(tmp_path / "rec"), "--episodes", "2", "--seconds", "1.5",
            "--seed", "3", "--task", "stack_cups", "--width", "128", "--height", "96"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    d = tmp_path / "rec" / "stack_cups"
    assert sorted(p.name for p in d.glob("*_vio.mcap")) == ["stack_cups_0000_vio.mcap", "stack_cups_0001_vio.mcap"]
    assert "stack_cups_0001" in result.output
    assert ("note: 'stack_cups' is not a world task (the world's tasks: pick_place, stack): writing smooth random "
            "camera motion") in " ".join(result.output.split())
    report = inspect_recording(d / "stack_cups_0000_vio.mcap")
    assert report.ok and report.message_counts[TOPICS.camera] > 30
    s = read_streams(d / "stack_cups_0000_vio.mcap")
    frame = next(f for data in s.camera_packets for f in av.CodecContext.create("h264", "r").decode(av.Packet(data)))
    assert (frame.width, frame.height) == (128, 96)
    first = _digests(d)
    again = CliRunner().invoke(app, args)
    assert isinstance(again.exception, RecordingError) and again.exception.code == "output_exists"
    assert "already holds recordings" in again.exception.reason
    args[1] = str(tmp_path / "rec2")
    assert CliRunner().invoke(app, args).exit_code == 0
    assert _digests(tmp_path / "rec2" / "stack_cups") == first
    odd = CliRunner().invoke(app, ["sample-recordings", str(tmp_path / "r3"), "--width", "127", "--motion", "random"])
    assert isinstance(odd.exception, RecordingError) and "must be even" in odd.exception.reason
    # a world task's demonstrations last as long as the task: --seconds is refused
    world = CliRunner().invoke(app, ["sample-recordings", str(tmp_path / "r4"), "--task", "stack", "--seconds", "6"])
    assert world.exit_code == 2 and "--seconds: only for random motion" in world.output
    assert not (tmp_path / "r4").exists()
    # the world's camera size is the user's to choose (the README's Python recipe records at 64 x 64)
    small = CliRunner().invoke(app, ["sample-recordings", str(tmp_path / "r5"), "--task", "stack", "-n", "1",
                                     "--width", "64", "--height", "48"])
    assert small.exit_code == 0, small.output
    meta = json.loads((tmp_path / "r5" / "stack" / "sim_task.json").read_text())
    assert (meta["recording"]["width"], meta["recording"]["height"]) == (64, 48)
    from mcap.reader import make_reader
    from mcap_protobuf.decoder import DecoderFactory

    codec = av.CodecContext.create("h264", "r")
    with open(tmp_path / "r5" / "stack" / "stack_0000_vio.mcap", "rb") as f:
        for _, _, _, image in make_reader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
                topics=["/robot0/sensor/camera0/compressed"]):
            frames = codec.decode(av.Packet(image.data))
            if frames:
                break
    assert (frames[0].width, frames[0].height) == (64, 48)  # decoded, not read from the metadata


def test_cli_errors_exit_2_with_one_line(tmp_path):
    (tmp_path / "rec" / "pick_place").mkdir(parents=True)
    (tmp_path / "rec" / "pick_place" / "x.mcap").write_bytes(b"x")
    proc = subprocess.run(["dpflow", "sample-recordings", str(tmp_path / "rec"), "--episodes", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'rec' / 'pick_place'}: already holds recordings; choose an empty folder"


def test_a_refusal_asked_for_as_json_is_json_on_stdout(tmp_path):
    """A script running ``dpflow ... --json`` reads stdout: a refused command gives it the code, the path and the
    reason there, besides the one line on stderr and exit 2 (it printed nothing on stdout before)."""
    missing = tmp_path / "nowhere" / "manifest.json"
    proc = subprocess.run(["dpflow", "convert", str(missing), "-o", str(tmp_path / "d.npz"), "--json"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and "Traceback" not in proc.stderr
    err = json.loads(proc.stdout)["error"]
    assert err["path"] == str(missing) and err["reason"] and err["code"] != "error", err
    assert err["reason"] in proc.stderr
    plain = subprocess.run(["dpflow", "convert", str(missing), "-o", str(tmp_path / "d.npz")], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stdout == "" and plain.stderr == proc.stderr
    # a refused option value and a missing option: usage errors, the same way
    for args, reason in [(["rollout", str(missing), "--task", "stack", "--n-action-steps", "0"], "n_action_steps must be >= 1"),
                         (["rollout", str(missing)], "Missing option '--task'")]:
        usage = subprocess.run(["dpflow", *args, "--json"], capture_output=True, text=True)
        assert usage.returncode == 2 and reason in usage.stderr and "Traceback" not in usage.stderr, usage.stderr
        err = json.loads(usage.stdout)["error"]
        assert err["code"] == "usage" and reason in err["reason"], err
    # --json asked for and nothing refused: the command's own exit status and output
    shown = subprocess.run(["dpflow", "cache", "show", "--json"], capture_output=True, text=True,
                           env={**os.environ, "DPFLOW_CACHE_DIR": str(tmp_path / "cache")})
    assert shown.returncode == 0 and "error" not in json.loads(shown.stdout)
