"""The offline evaluation's settings are declared once (issue 30): ``dpflow evaluate``'s options and the
``evaluation`` asset's config are made from :class:`~dpflow_core.evaluation.settings.EvaluationSettings`. Before,
the command line had two of its eight settings and the asset four, with their defaults written in each."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.errors import RunError
from dpflow_core.evaluation.settings import EvaluationSettings
from dpflow_core.settings import front_ends
from test_conversion_settings import missing_front_ends


def _front_ends():
    from dpflow_dagster.defs.training import EvaluationConfig

    return typer.main.get_command(app).commands["evaluate"], EvaluationConfig


def test_every_evaluation_setting_has_an_option_and_a_config_field_with_its_default_and_help():
    command, config_cls = _front_ends()
    assert missing_front_ends(EvaluationSettings, command, config_cls) == []
    assert EvaluationSettings.from_options({p.name: p.default for p in command.params}) == \
        EvaluationSettings.from_config(config_cls()) == EvaluationSettings()
    options = {opt: p for p in command.params for opt in p.opts}
    for name, meta in front_ends(EvaluationSettings).items():
        assert options[meta["option"]].help == meta["help"], name
        assert config_cls.model_fields[meta["config"]].description.startswith(meta["help"]), name


def test_both_front_ends_map_onto_the_same_evaluation():
    command, config_cls = _front_ends()
    expected = EvaluationSettings(max_samples_per_episode=None, plot_episodes=1, seed=7, margin=0.1,
                                  gripper_threshold_m=0.04, command_latency_s=0.05)
    config = config_cls(max_samples_per_episode=0, plot_episodes=1, seed=7, margin=0.1, gripper_threshold_m=0.04,
                        command_latency_s=0.05)
    assert EvaluationSettings.from_config(config) == expected
    assert EvaluationSettings.from_config(config_cls(gripper_threshold_m=-1.0)).gripper_threshold_m is None
    values = {p.name: p.default for p in command.params} | dict(
        plot_episodes=1, seed=7, margin=0.1, gripper_threshold=0.04, command_latency=0.05)
    assert EvaluationSettings.from_options(values) == EvaluationSettings(
        plot_episodes=1, seed=7, margin=0.1, gripper_threshold_m=0.04, command_latency_s=0.05)


@pytest.mark.parametrize("bad, code", [(dict(margin=1.0), "bad_margin"), (dict(margin=-0.1), "bad_margin"),
                                       (dict(max_samples_per_episode=0), "bad_config"),
                                       (dict(command_latency_s=float("nan")), "bad_config")])
def test_bad_evaluation_settings_are_refused(bad, code):
    with pytest.raises(RunError) as exc:
        EvaluationSettings(**bad)
    assert exc.value.code == code


def test_a_bad_margin_on_the_command_line_is_one_line_before_any_work(tmp_path):
    r = CliRunner().invoke(app, ["evaluate", str(tmp_path / "x.ckpt"), "--dataset", str(tmp_path / "d.npz"),
                                 "--margin", "1.5"])
    assert r.exit_code != 0 and "margin must be in [0, 1)" in r.output + str(r.exception)
