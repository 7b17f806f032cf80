"""The closed-loop judge's settings are declared once (issue 30): ``dpflow rollout``'s options and the
``rollout_evaluation`` asset's config are made from :class:`~dpflow_core.sim.settings.ClosedLoopSettings`."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.settings import front_ends
from dpflow_core.sim.settings import ClosedLoopSettings
from test_conversion_settings import missing_front_ends


def _front_ends():
    from dpflow_dagster.defs.rollouts import RolloutEvaluationConfig

    return typer.main.get_command(app).commands["rollout"], RolloutEvaluationConfig


def test_every_judge_setting_has_an_option_and_a_config_field_with_its_default_and_help():
    command, config_cls = _front_ends()
    assert missing_front_ends(ClosedLoopSettings, command, config_cls) == []
    assert ClosedLoopSettings.from_options({p.name: p.default for p in command.params}) == \
        ClosedLoopSettings.from_config(config_cls()) == ClosedLoopSettings()
    options = {opt: p for p in command.params for opt in p.opts}
    for name, meta in front_ends(ClosedLoopSettings).items():
        assert options[meta["option"]].help == meta["help"] == config_cls.model_fields[meta["config"]].description
    assert "-n" in options["--episodes"].opts


def test_both_front_ends_map_onto_the_same_judge():
    command, config_cls = _front_ends()
    expected = ClosedLoopSettings(episodes=50, seed=3, baselines=("hold",), target=0.5, margin=0.1, video_episodes=0,
                                  n_action_steps=4)
    config = config_cls(episodes=50, seed=3, baselines=["hold"], target=0.5, margin=0.1, video_episodes=0,
                        n_action_steps=4)
    assert ClosedLoopSettings.from_config(config) == expected
    values = {p.name: p.default for p in command.params} | dict(episodes=50, seed=3, baselines="hold", target=0.5,
                                                                 margin=0.1, video_episodes=0, n_action_steps=4)
    assert ClosedLoopSettings.from_options(values) == expected
    assert ClosedLoopSettings(baselines="none").baselines == ()


@pytest.mark.parametrize("args, message", [
    (["--baselines", "oracle,teleop"], "unknown baselines ['teleop']"), (["-n", "0"], "episodes must be >= 1"),
    (["--target", "1.5"], "fractions in [0, 1]"), (["--n-action-steps", "0"], "n_action_steps must be >= 1"),
])
def test_a_bad_judge_setting_is_refused_on_the_command_line_by_name(tmp_path, args, message):
    r = CliRunner().invoke(app, ["rollout", str(tmp_path / "x.ckpt"), "--task", "pick_place", *args])
    assert r.exit_code == 2 and message in " ".join(r.output.split()), r.output
