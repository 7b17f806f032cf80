"""The README's main job on recordings written by an independent writer (tests/foreign_writer.py).

In its own module so that pytest-xdist (``--dist loadfile``) runs it beside the sample-recordings
demo of tests/test_demo_e2e.py instead of after it.
"""

from __future__ import annotations

import json

import foreign_writer as fw
import pytest
from test_demo_e2e import _assert_pipeline_products, _run_demo, _tiny_lab


@pytest.mark.slow
@pytest.mark.timeout(1200)  # one demo run: conversion, three smoke launches, training, evaluation
def test_main_job_on_recordings_from_another_writer(tmp_path):
    task = tmp_path / "matrix_output" / "cup_stack"
    episodes = [
        fw.write_foreign_episode(task, f"DAS07_20261129_{10 + k:02d}1500", seed=k, seconds=7.0, fps=20, size=(96, 64))
        for k in range(4)
    ]
    (task / "vio_result.json").write_text(json.dumps({
        "task_name": "cup_stack",
        "success_mcap_files": [e.raw_mcap.name for e in episodes],
        "failed_mcap_files": [],
    }))
    # what is under test is reading these recordings, not learning from them: a tiny training
    proc, instance, out = _run_demo(tmp_path, "--recordings", str(task), "--config", str(_tiny_lab(tmp_path)))
    assert not (out / "recordings").exists(), "no sample recordings are written when --recordings is given"
    _assert_pipeline_products(instance, out, "cup_stack")
    meta = json.loads(next(out.glob("datasets/*/*/dataset.json")).read_text())
    assert meta["n_episodes"] == 4
    assert abs(meta["frequency_hz"] - 20.0) < 0.2
