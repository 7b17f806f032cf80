"""The LeRobot export's settings are declared once (issue 30): ``dpflow export-lerobot``'s options and the
``lerobot_dataset`` asset's config are made from :class:`~dpflow_core.export.settings.ExportSettings`, with one
default and one help per setting, and the export key changes with each setting that changes the export."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from dpflow_core.cli import app
from dpflow_core.errors import ConversionError
from dpflow_core.export.settings import ExportSettings
from dpflow_core.settings import front_ends, setting
from test_conversion_settings import missing_front_ends


def _front_ends():
    from dpflow_dagster.defs.lerobot import LeRobotDatasetConfig

    return typer.main.get_command(app).commands["export-lerobot"], LeRobotDatasetConfig


def test_every_export_setting_has_an_option_and_a_config_field_with_its_default_and_help():
    command, config_cls = _front_ends()
    assert missing_front_ends(ExportSettings, command, config_cls) == []
    cli = ExportSettings.from_options({p.name: p.default for p in command.params})
    assert cli == ExportSettings.from_config(config_cls()) == ExportSettings()
    options = {opt: p for p in command.params for opt in p.opts}
    for name, meta in front_ends(ExportSettings).items():
        assert options[meta["option"]].help == meta["help"], name
        assert config_cls.model_fields[meta["config"]].description == meta["help"], name


def test_the_completeness_check_sees_an_export_field_one_front_end_lacks():
    @dataclasses.dataclass(frozen=True)
    class Wider(ExportSettings):
        crf: int = setting(23, "--crf", "crf", "x264 constant rate factor.")

    command, config_cls = _front_ends()
    assert missing_front_ends(Wider, command, config_cls) == [
        "crf: no --crf in dpflow export-lerobot", "crf: no field crf in LeRobotDatasetConfig"]


def test_the_config_and_the_command_line_map_onto_the_same_settings():
    command, config_cls = _front_ends()
    config = config_cls(image_size="64,48", action_rule="delta", format="v2.1", rotation="rot6d", task_text="wipe",
                        rate_policy="group", min_overlap_fraction=0.8)
    expected = ExportSettings(task_text="wipe", action_rule="delta", image_size=(64, 48), codebase_version="v2.1",
                              rotation="rot6d", rate_policy="group", min_overlap_fraction=0.8)
    assert ExportSettings.from_config(config) == expected
    values = {p.name: p.default for p in command.params} | {
        "image_size": "64x48", "action_rule": "delta", "format": "v2.1", "rotation": "rot6d", "task_text": "wipe",
        "rate_policy": "group", "min_overlap_fraction": 0.8}
    assert ExportSettings.from_options(values) == expected
    assert ExportSettings(image_size="native").image_size is None


@pytest.mark.parametrize("bad, match", [
    (dict(image_size=(63, 48)), "must be even"), (dict(image_size="64"), "'W,H' or 'native'"),
    (dict(action_rule="velocity"), "unknown action rule 'velocity'"),
    (dict(codebase_version="v2.0"), "unknown LeRobot format 'v2.0'"), (dict(rotation="quat"), "unknown rotation"),
    (dict(rate_policy="drop"), "unknown rate_policy"), (dict(invalid_pose_policy="keep"), "unknown invalid_pose_policy"),
    (dict(frequency_tolerance=2.0), "frequency_tolerance must be a fraction"),
])
def test_bad_export_settings_are_refused_by_name(bad, match):
    with pytest.raises(ConversionError, match=match) as exc:
        ExportSettings(**bad)
    assert exc.value.code == "bad_option"
