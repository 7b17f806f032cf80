"""rate_policy reaches every stage that keeps or drops an off-rate episode (issue 28): the Dagster
dataset_npz config maps it onto conversion as ``dpflow convert --rate-policy`` does."""

from __future__ import annotations

import json
from dataclasses import replace

import dagster as dg
import pytest
from partitioned import materialize as materialize_task
from test_assets_dataset import _manifest, _upstream

from dpflow_core.recordings import samples
from dpflow_dagster.defs.dataset import dataset_npz

SPEC = samples.SampleSpec(seconds=1.5, width=96, height=72, gop_size=15)


@pytest.fixture(scope="module")
def mixed_rates(tmp_path_factory):
    """Two 30 Hz episodes and one 15 Hz one (the task's rate is 30 Hz: the larger group)."""
    root = tmp_path_factory.mktemp("rate_stages") / "pick"
    eps = [samples.write_episode(root, stem, replace(SPEC, fps=hz), seed=seed)
           for stem, hz, seed in (("a30", 30.0, 61), ("b30", 30.0, 62), ("c15", 15.0, 63))]
    manifest = root.parent / "manifest.json"
    manifest.write_text(json.dumps(_manifest(eps, root)))
    return manifest


def test_dataset_npz_rate_policy_config(mixed_rates, tmp_path):
    """'reject' (not the default 'resample', which would keep c15 resampled) drops the 15 Hz episode."""
    policy = "reject"
    config = {"image_width": 32, "image_height": 24, "workers": 1, "min_segment_frames": 10,
              "output_dir": str(tmp_path / "work"), "rate_policy": policy}
    res = materialize_task([_upstream(mixed_rates, 3), dataset_npz], "pick",
                           run_config=dg.RunConfig(ops={"dataset_npz": {"config": config}}))
    value = res.output_for_node("dataset_npz")
    assert value.n_episodes == 2
    assert [r["stem"] for r in value.rejected if r["code"] == "frequency_mismatch"] == ["c15"]
    assert value.frequency_hz == pytest.approx(30.0, rel=0.01)
    assert value.metadata["options"]["rate_policy"] == policy
