"""The CLI's defaults: one work folder for everything, ``--version``, ``pair`` on an output root of one task."""

from __future__ import annotations

import importlib.metadata
import json
import re

from typer.testing import CliRunner

from dpflow_core import __version__
from dpflow_core.checkpoints import default_checkpoint_root
from dpflow_core.cli import app
from dpflow_core.server.config import ServerConfig, default_local_data_root
from recording_fixtures import write_small_task

runner = CliRunner()


def test_without_a_host_uploads_and_checkpoints_share_the_work_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("DPFLOW_SERVER_ROOT", raising=False)
    monkeypatch.delenv("DPFLOW_WORKDIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_local_data_root() == str(tmp_path / "outputs" / "server")
    assert default_checkpoint_root() == tmp_path / "outputs" / "checkpoints"
    monkeypatch.setenv("DPFLOW_WORKDIR", str(tmp_path / "work"))
    assert ServerConfig.local().data_root == str(tmp_path / "work" / "server")
    assert default_checkpoint_root() == tmp_path / "work" / "checkpoints"
    monkeypatch.setenv("DPFLOW_SERVER_ROOT", str(tmp_path / "elsewhere"))
    assert default_local_data_root() == str(tmp_path / "elsewhere")


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"dpflow {__version__}" == f"dpflow {importlib.metadata.version('dpflow')}"


def test_pair_on_a_folder_holding_one_task_folder_uses_it_and_says_so(tmp_path):
    root = tmp_path / "matrix_output"
    episodes = write_small_task(root, episodes=1, seed=3, task="pick_cup")
    result = runner.invoke(app, ["pair", str(root), "-o", str(tmp_path / "m.json")])
    assert result.exit_code == 0, result.output
    assert f"{root} holds one task folder: pairing {root / 'pick_cup'}" in result.output
    manifest = json.loads((tmp_path / "m.json").read_text())
    assert manifest["task"] == "pick_cup" and [a["stem"] for a in manifest["accepted"]] == [episodes[0].stem]

    write_small_task(root, episodes=1, seed=4, task="wipe_table")
    again = runner.invoke(app, ["pair", str(root), "-o", str(tmp_path / "m2.json")])
    assert again.exit_code != 0 and not (tmp_path / "m2.json").exists()
    assert "2 task folders (pick_cup, wipe_table); give one of them" in str(again.exception)


def _commands(group, prefix=()):
    """Every leaf command of the click group, with its path of names."""
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):  # a sub-app (cache, scale)
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_usage_lines_name_arguments_the_posix_way():
    """A new user read ``dpflow convert [OPTIONS] {inputs}...`` as a literal brace. Every command's usage line
    now gives a required argument in capitals and an optional one in brackets, as ``--help`` prints it."""
    import typer.main

    group = typer.main.get_command(app)
    seen = {}
    for path, cmd in _commands(group):
        if path == ("demo",):  # hands every argument, --help included, to dpflow_dagster.demo (os.execv)
            continue
        out = runner.invoke(app, [*path, "--help"], terminal_width=200).output
        usage = next(line for line in out.splitlines() if "Usage:" in line).split("Usage:")[1].strip()
        assert "{" not in usage and "}" not in usage, (path, usage)
        # an on/off flag takes no value: no "<bool>" after it (a new user typed `--overwrite true`)
        assert "<bool>" not in out, (path, [ln for ln in out.splitlines() if "<bool>" in ln][:2])
        # a "[default: ...]" in a help text is rich markup to Typer: it vanished and left "server ." behind
        assert not re.search(r"[\w)] \.(\s|$)", out), (path, re.search(r".{40}[\w)] \.(\s|$)", out))
        for p in cmd.params:
            if p.param_type_name == "argument":
                name = (p.metavar or p.name).upper()
                word = (name if p.required else f"[{name}]") + ("..." if p.nargs != 1 else "")
                assert word in usage.split(), (path, usage)
        seen[" ".join(path)] = usage
    assert seen["convert"].endswith("[OPTIONS] INPUTS...") and seen["rollout"].endswith("[OPTIONS] [CHECKPOINT]")
    assert seen["scale train"].endswith("[OPTIONS] DATASET") and len(seen) > 20
    for group in ([], ["cache"], ["scale"]):
        assert "<bool>" not in runner.invoke(app, [*group, "--help"], terminal_width=200).output, group
    # dpflow demo's own app (dpflow_dagster.demo, reached through os.execv) alike
    from dpflow_dagster.demo import cli as demo_cli

    demo_help = runner.invoke(demo_cli, ["--help"], terminal_width=200).output
    assert "--recordings" in demo_help and "<bool>" not in demo_help, demo_help
