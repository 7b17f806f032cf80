"""The conversion settings are declared once: every field has its ``dpflow convert`` option and its ``dataset_npz``
config field, with the same default and help; the settings validate once and key a dataset as before (issue 30)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from dpflow_core.cli import app
from dpflow_core.conversion.inputs import ConversionInputs, EpisodeInput, dataset_key
from dpflow_core.conversion.jobs import alignment_job, settings_of_job
from dpflow_core.conversion.settings import ConversionSettings, front_ends, setting
from dpflow_core.episode_cache import episode_key
from dpflow_core.errors import ConversionError
from dpflow_core.recordings.plausibility import PlausibilityOptions
from dpflow_core.recordings.topics import DAS_DEFAULT


def _front_ends():
    from dpflow_dagster.defs.dataset import DatasetConfig

    return typer.main.get_command(app).commands["convert"], DatasetConfig


def missing_front_ends(cls, command, config_cls) -> list[str]:
    """Each field of ``cls`` without its option in ``command`` or its field(s) in the Dagster config ``config_cls``."""
    out = []
    for name, meta in front_ends(cls).items():
        if not meta.get("option") or not meta.get("config") or not meta.get("help"):
            out.append(f"{name}: not mapped")
            continue
        if not any(meta["option"] in p.opts for p in command.params):
            out.append(f"{name}: no {meta['option']} in dpflow {command.name}")
        fields = meta["config"] if isinstance(meta["config"], tuple) else (meta["config"],)
        out += [f"{name}: no field {f} in {config_cls.__name__}" for f in fields if f not in config_cls.model_fields]
    return out


def test_every_setting_has_an_option_and_a_config_field_with_its_default_and_help():
    command, config_cls = _front_ends()
    assert missing_front_ends(ConversionSettings, command, config_cls) == []
    # one default for each setting, whichever front end is used
    cli = ConversionSettings.from_options({p.name: p.default for p in command.params})
    assert cli == ConversionSettings.from_config(config_cls()) == ConversionSettings()
    # one help text: the CLI's option and the Dagster field's description (a setting spread over several
    # config fields describes each of them)
    options = {opt: p for p in command.params for opt in p.opts}
    for name, meta in front_ends(ConversionSettings).items():
        assert options[meta["option"]].help == meta["help"], name
        if isinstance(meta["config"], str):
            assert config_cls.model_fields[meta["config"]].description == meta["help"], name


def test_the_dagster_config_maps_onto_the_settings():
    _, config_cls = _front_ends()
    config = config_cls(image_width=32, image_height=24, min_pose_score=0.5, short_episode_policy="warn",
                        plausibility={"max_speed_mps": 4.0, "policies": {"gripper_dead": "warn"}}, workers=3)
    assert ConversionSettings.from_config(config) == ConversionSettings(
        image_size=(32, 24), min_pose_score=0.5, short_episode_policy="warn",
        plausibility={"max_speed_mps": 4.0, "policies": {"gripper_dead": "warn"}})


def test_the_completeness_check_sees_a_field_one_front_end_lacks():
    @dataclasses.dataclass(frozen=True)
    class Wider(ConversionSettings):
        crop: float = setting(1.0, "--crop", "crop", "Centre crop fraction.")

    command, config_cls = _front_ends()
    assert missing_front_ends(Wider, command, config_cls) == [
        "crop: no --crop in dpflow convert", "crop: no field crop in DatasetConfig"]


def test_the_settings_state_their_defaults_and_refuse_bad_values():
    s = ConversionSettings()
    assert (s.image_size, s.invalid_pose_policy, s.min_overlap_fraction, s.frequency_tolerance, s.rate_policy) == (
        (224, 224), "trim", 0.5, 0.05, "resample")
    assert (s.max_gap_s, s.gap_policy, s.min_segment_frames, s.min_pose_score, s.short_episode_policy) == (
        0.5, "split", 46, 0.0, "reject")
    assert s.plausibility.to_dict() == PlausibilityOptions().to_dict()
    # the forms the front ends give: "W,H" text, a dict or JSON text of plausibility fields
    assert ConversionSettings(image_size="32x24").image_size == (32, 24)
    assert ConversionSettings(image_size=None).image_size is None
    given = ConversionSettings(plausibility='{"max_speed_mps": 4, "policies": {"gripper_dead": "warn"}}')
    assert given.plausibility.to_dict() == PlausibilityOptions(max_speed_mps=4, policies={"gripper_dead": "warn"}).to_dict()
    assert given == ConversionSettings(plausibility=given.plausibility.to_dict())
    assert ConversionSettings(plausibility={"max_speed_mps": 4}).plausibility.max_speed_mps == 4
    assert ConversionSettings.from_options({"max_gap": 1.0, "plausibility": None}).max_gap_s == 1.0
    for bad, match in [
        (dict(image_size=(4, 4)), "out of range"), (dict(image_size="wide"), "W,H"),
        (dict(invalid_pose_policy="ignore"), "invalid_pose_policy must be one of"),
        (dict(gap_policy="bridge"), "gap_policy must be one of"), (dict(max_gap_s=0), "max_gap_s must be > 0"),
        (dict(frequency_tolerance=1.5), r"frequency_tolerance must be in \(0, 1\)"),
        (dict(rate_policy="drop"), "rate_policy must be one of"), (dict(min_segment_frames=1), "min_segment_frames"),
        (dict(short_episode_policy="keep"), "short_episode_policy must be one of"),
        (dict(plausibility={"policies": {"gripper_dead": "repair"}}), "plausibility options: .*takes policy"),
        (dict(plausibility={"max_sped_mps": 4}), "plausibility options"),
        (dict(plausibility="{not json"), "must be a JSON object"),
    ]:
        with pytest.raises(ConversionError, match=match) as info:
            ConversionSettings(**bad)
        assert info.value.code == "bad_option"


def _inputs() -> ConversionInputs:
    eps = [EpisodeInput(stem, Path(f"/x/{stem}_vio.mcap"), size, sha,
                        {"vio_mcap": {"path": f"{stem}_vio.mcap", "sha256": sha}})
           for stem, size, sha in (("a", 10, "ab" * 32), ("b", 11, "cd" * 32))]
    return ConversionInputs(eps, [], ["m"], "pick", "/x", None)


@pytest.mark.parametrize("options, key", [
    ({}, "73e973a44e59340c53a233966ac35dd4e4e00115627bc663f5c0ea1ef888b24b"),
    (dict(image_size=(32, 24), max_gap_s=1, gap_policy="reject", min_segment_frames=20),
     "531fbc7c9ebc28dade5fdb40360dbc8e0612673c34463936993f512ebffee7ff"),
    (dict(image_size=(64, 48), rate_policy="group", frequency_tolerance=0.1, min_overlap_fraction=0.3,
          invalid_pose_policy="reject"), "6f67f2ea2425f9fafeeb77d125c326721b8fc688c1dfee9d3e0d70a5c1821d1f"),
    (dict(image_size=(32, 24), plausibility={"max_speed_mps": 4.0, "policies": {"gripper_dead": "warn"}},
          short_episode_policy="warn"), "f7449ab50304a7fe14faf15827cb818da9c293f803d473bf93deb9733085675c"),
])
def test_dataset_keys_are_those_of_the_loose_options(options, key):
    """The keys (and so the reuse of existing datasets) of the options as they were passed one by one before the
    settings object: computed with the previous code and pinned here; re-pinned at converter 8 with the IMU's
    plausibility classes, and at each later version (11: the pose_rate_low, pose_glitch, pose_mirrored and clock_skew
    options; 12: imu_reversed's and camera_pose_mismatch's; 13: gripper_offset's; 14: the clock_skew slope, the version alone: with "13" the keys are the old ones; the version and the options are part
    of every key, so both change them by design)."""
    assert dataset_key(_inputs(), ConversionSettings(**options)) == key


def test_an_alignment_job_carries_the_settings_and_its_cache_key_is_unchanged():
    entry = _inputs().episodes[0]
    settings = ConversionSettings(image_size=(32, 24))
    job = alignment_job(entry, settings, DAS_DEFAULT, True)
    assert episode_key(job) == "d2bd9acfb597cbefc88a17498b68df39bbee76395d9394ef064f9bc927b75e4d"
    odd = ConversionSettings(image_size=(32, 24), invalid_pose_policy="reject", min_overlap_fraction=0.3, max_gap_s=1.0,
                             gap_policy="reject", min_segment_frames=20, min_pose_score=0.5,
                             plausibility={"max_speed_mps": 4.0}, short_episode_policy="warn")
    odd_job = alignment_job(entry, odd, DAS_DEFAULT, False)
    assert episode_key(odd_job) == "30bffc615769732388b1c1456c9c15dcd2237757b70a98a862089fd179ac1824"
    # what the worker reads back: the alignment settings, the rate ones at their defaults
    assert settings_of_job(job) == settings
    assert settings_of_job(odd_job) == odd


@pytest.mark.parametrize("flags, message", [
    (["--plausibility", "{max_speed_mps: 4"], "plausibility options must be a JSON object"),
    (["--min-segment-frames", "1"], "min_segment_frames must be a whole number of frames >= 2"),
    (["--short-episode-policy", "keep"], "short_episode_policy must be one of"),
])
def test_dpflow_convert_refuses_a_bad_setting_in_one_line_before_any_work(tmp_path, flags, message):
    proc = subprocess.run([sys.executable, "-c", "from dpflow_core.cli import main; main()", "convert",
                           str(tmp_path / "missing"), "-o", str(tmp_path / "dataset.npz"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert list(tmp_path.iterdir()) == []
