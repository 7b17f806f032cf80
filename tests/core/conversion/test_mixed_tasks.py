"""Manifests of two different tasks given to one conversion: refused unless mixed on purpose, and then each
episode says which task it is.

Two small task folders (``pick_place`` and ``stack``, two and three episodes) are paired for real; which task each
episode belongs to is known by construction (its folder).
"""

from __future__ import annotations

import json

import pytest
from recording_fixtures import write_small_task
from typer.testing import CliRunner

from dpflow_core.cli import app
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.errors import ConversionError
from dpflow_core.pairing import pair_recordings, save_manifest

SIZE = (32, 24)


@pytest.fixture(scope="module")
def two_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    truth = {}
    paths = []
    for task, n, seed in (("pick_place", 2, 0), ("stack", 3, 7)):
        eps = write_small_task(root / "rec", episodes=n, seed=seed, task=task)
        truth.update({e.stem: task for e in eps})
        path, _ = save_manifest(pair_recordings(root / "rec" / task), root / "work" / task)
        paths.append(path)
    return paths, truth


def test_two_tasks_in_one_dataset_are_refused_naming_both(two_tasks, tmp_path):
    paths, _ = two_tasks
    out = tmp_path / "both.npz"
    with pytest.raises(ConversionError) as err:
        convert([str(p) for p in paths], out, ConversionSettings(image_size=SIZE), workers=1, cache=False)
    assert err.value.code == "mixed_tasks"
    text = str(err.value)
    assert "'pick_place'" in text and "'stack'" in text and str(paths[0]) in text and str(paths[1]) in text
    assert text.startswith("mixed_tasks: ") and "--mixed-tasks" in text and "convert(" not in text
    assert not out.exists() and not list(tmp_path.iterdir())


def test_mixed_on_purpose_each_episode_records_its_task(two_tasks, tmp_path):
    paths, truth = two_tasks
    r = convert([str(p) for p in paths], tmp_path / "both.npz", ConversionSettings(image_size=SIZE), workers=1,
                cache=False, mixed_tasks=True)
    meta = json.loads(r.sidecar_path.read_text())
    assert meta["task"] is None and r.n_episodes == 5
    assert {e["stem"]: e["task"] for e in meta["inputs"]["episodes"]} == truth
    (warning,) = [w for w in meta["warnings"] if w["code"] == "mixed_tasks"]
    assert "pick_place (2)" in warning["reason"] and "stack (3)" in warning["reason"]


def test_one_task_records_no_per_episode_task(two_tasks, tmp_path):
    paths, _ = two_tasks
    r = convert(str(paths[1]), tmp_path / "stack.npz", ConversionSettings(image_size=SIZE), workers=1, cache=False)
    meta = json.loads(r.sidecar_path.read_text())
    assert meta["task"] == "stack" and all("task" not in e for e in meta["inputs"]["episodes"])
    assert not [w for w in meta["warnings"] if w["code"] == "mixed_tasks"]


def test_cli_refuses_then_mixes_with_the_flag(two_tasks, tmp_path):
    paths, truth = two_tasks
    args = ["convert", *map(str, paths), "--image-size", "32,24", "-j", "1", "--no-cache", "--json"]
    refused = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "a.npz")])
    assert refused.exit_code != 0 and "mixed_tasks" in refused.output + str(refused.exception)
    mixed = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "b.npz"), "--mixed-tasks"])
    assert mixed.exit_code == 0, mixed.output
    assert json.loads(mixed.output)["n_episodes"] == len(truth)
    plain = CliRunner().invoke(app, [*args[:-1], "-o", str(tmp_path / "c.npz"), "--mixed-tasks"])
    assert plain.exit_code == 0 and "mixed_tasks" in plain.output, plain.output  # the warning is printed
