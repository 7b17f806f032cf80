"""The run settings are declared once: every field has its CLI option and its Dagster config field, with the
same default, and no front end builds a RunSpec itself (issue 30: one run recipe)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import typer

from dpflow_core.cli import app
from dpflow_core.errors import RunError
from dpflow_core.runs import DEFAULT_TRAIN_COMMAND, SmokeSettings, TrainSettings
from dpflow_core.runs.settings import front_ends
from dpflow_core.runs.spec import UPSTREAM_TRAIN_COMMAND

REPO = Path(__file__).resolve().parents[3]


def _commands():
    import dpflow_core.cli.scale  # noqa: F401 (registers `dpflow scale`)
    from dpflow_dagster.defs.run_config import SmokeRunConfig, TrainRunConfig

    root = typer.main.get_command(app)
    scale = root.commands["scale"]
    return {
        SmokeSettings: (root.commands["smoke"], scale.commands["smoke"], SmokeRunConfig),
        TrainSettings: (root.commands["train"], scale.commands["train"], TrainRunConfig),
    }


def missing_front_ends(cls, command, scale_command, config_cls) -> list[str]:
    """Each field of ``cls`` without its option in ``command`` (and ``scale_command`` unless ``scale`` is False)
    or without its field in the Dagster config ``config_cls``."""
    out = []
    for name, meta in front_ends(cls).items():
        if not meta.get("option") or not meta.get("config"):
            out.append(f"{name}: not mapped")
            continue
        for where, cmd in ((command.name, command), (f"scale {scale_command.name}", scale_command)):
            if where.startswith("scale") and not meta["scale"]:
                continue
            if not any(meta["option"] in p.opts for p in cmd.params):
                out.append(f"{name}: no {meta['option']} in dpflow {where}")
        if meta["config"] not in config_cls.model_fields:
            out.append(f"{name}: no field {meta['config']} in {config_cls.__name__}")
    return out


def _cli_defaults(cls, command) -> object:
    return cls.from_options({p.name: p.default for p in command.params})


@pytest.mark.parametrize("cls", [SmokeSettings, TrainSettings], ids=["smoke", "train"])
def test_every_setting_has_an_option_and_a_config_field_with_its_default(cls):
    command, scale_command, config_cls = _commands()[cls]
    assert missing_front_ends(cls, command, scale_command, config_cls) == []
    # one default for each setting, whichever front end is used
    assert _cli_defaults(cls, command) == _cli_defaults(cls, scale_command) == cls.from_config(config_cls()) == cls()


def test_the_completeness_check_sees_a_field_one_front_end_lacks():
    from dpflow_core.runs.settings import setting

    @dataclasses.dataclass(frozen=True)
    class Wider(SmokeSettings):
        warmup_s: float = setting(0.0, "--warmup", "warmup_s")

    command, scale_command, config_cls = _commands()[SmokeSettings]
    assert missing_front_ends(Wider, command, scale_command, config_cls) == [
        "warmup_s: no --warmup in dpflow smoke", "warmup_s: no --warmup in dpflow scale smoke",
        "warmup_s: no field warmup_s in SmokeRunConfig"]


def test_the_settings_state_their_defaults_and_refuse_bad_values():
    smoke = SmokeSettings()
    # the resume-continuity check: 2 epochs of 2 batches (it was 2x3 in `dpflow smoke`, 2x2 elsewhere)
    assert (smoke.resume_check_epochs, smoke.resume_check_steps) == (2, 2)
    assert (smoke.epochs, smoke.max_train_steps, smoke.batch_size, smoke.num_workers, smoke.timeout_s) == (1, 3, 4, 0, 900.0)
    assert smoke.config_name == TrainSettings().config_name == "auto"
    assert TrainSettings().timeout_s is None and TrainSettings().epochs is None
    assert TrainSettings.from_options({"gpu_ids": "0, 2", "override": ["a=1"]}).gpu_ids == (0, 2)
    assert SmokeSettings.from_options({"gpu_id": 1}).gpu_ids == (1,)
    assert SmokeSettings(train_command="upstream").train_command == UPSTREAM_TRAIN_COMMAND
    assert TrainSettings(train_command="").train_command == DEFAULT_TRAIN_COMMAND
    for bad, match in [(dict(gpu_ids=(0, 1)), "one GPU"), (dict(resume_check_epochs=1), "resume_check_epochs"),
                       (dict(config_name="a b"), "invalid config name"), (dict(epochs=0), "epochs")]:
        with pytest.raises(RunError, match=match):
            SmokeSettings(**bad)
    for bad, match in [(dict(resume=True), "resume needs the run_name"), (dict(gpu_ids="0,x"), "comma-separated"),
                       (dict(gpu_ids=(1, 1)), "distinct"), (dict(logging_mode="loud"), "logging mode"),
                       (dict(num_workers=-1), "num_workers")]:
        with pytest.raises(RunError, match=match):
            TrainSettings(**bad)


_BUILDS_A_SPEC = re.compile(r"\b(RunSpec|smoke_spec)\(")


def test_no_front_end_builds_a_run_spec():
    """``RunSpec(`` and ``smoke_spec(`` appear in the recipe (dpflow_core/runs), never in the CLI or Dagster."""
    hits = [f"{p.relative_to(REPO)}:{i}" for folder in ("dpflow_core/cli", "dpflow_dagster")
            for p in sorted((REPO / folder).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if _BUILDS_A_SPEC.search(line)]
    assert hits == []
    assert _BUILDS_A_SPEC.search((REPO / "dpflow_core/runs/recipe.py").read_text())
