"""Data versions follow content: re-converting identical recordings leaves the downstream assets fresh
(Dagster's own staleness resolver, on a real SQLite instance); a changed recording makes them stale.

Ground truth: the SHA-256 of the files themselves (hashlib), compared with the data versions Dagster
stored on each materialization.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest
from partitioned import add_task

from dpflow_core.recordings import samples
from dpflow_dagster.defs.dataset import dataset_npz
from dpflow_dagster.defs.recordings import paired_episodes
from dpflow_dagster.defs.remote import remote_dataset
from dpflow_dagster.resources import GpuServerResource

SPEC = samples.SampleSpec(seconds=2.0, width=96, height=72, gop_size=15)
TASK = "wipe"
KEYS = {name: dg.AssetKey(name) for name in ("paired_episodes", "dataset_npz", "remote_dataset")}


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def setup(tmp_path):
    samples.write_task(tmp_path / "rec", episodes=2, seconds=2.0, task=TASK, spec=SPEC)
    assets = [paired_episodes, dataset_npz, remote_dataset]
    resources = {
        "gpu_server": GpuServerResource(data_root=str(tmp_path / "server")),
        "io_manager": dg.FilesystemIOManager(base_dir=str(tmp_path / "io")),
    }
    op_config = {
        "paired_episodes": {"config": {"root": str(tmp_path / "rec" / TASK), "output_dir": str(tmp_path / "work"),
                                       "quality": False}},
        "dataset_npz": {"config": {"image_width": 32, "image_height": 24, "workers": 1,
                                   "output_dir": str(tmp_path / "work")}},
    }
    graph = dg.Definitions(assets=assets, resources=resources).resolve_asset_graph()
    with dg.instance_for_test() as instance:
        add_task(instance, TASK)

        def materialize(selected):
            result = dg.materialize(assets, partition_key=TASK, instance=instance, resources=resources,
                                    run_config=dg.RunConfig(ops={k: v for k, v in op_config.items() if any(a.key.path[-1] == k for a in selected)}),
                                    selection=[a.key for a in selected])
            assert result.success
            return result

        def status(name: str) -> StaleStatus:
            return CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance)).get_status(KEYS[name], TASK)

        def data_version(name: str) -> str:
            event = instance.get_latest_materialization_event(KEYS[name])
            return event.asset_materialization.tags["dagster/data_version"]

        yield tmp_path, assets, materialize, status, data_version


@pytest.mark.slow
def test_identical_inputs_leave_downstream_fresh_and_a_changed_recording_makes_it_stale(setup):
    tmp_path, assets, materialize, status, data_version = setup
    first = materialize(assets)
    dataset = first.output_for_node("dataset_npz")
    assert data_version("dataset_npz") == _sha256(dataset.path) == dataset.sha256
    assert data_version("remote_dataset") == dataset.sha256
    manifest_hash = first.asset_materializations_for_node("paired_episodes")[0].metadata["content_hash"].value
    assert data_version("paired_episodes") == manifest_hash
    assert {name: status(name) for name in KEYS} == dict.fromkeys(KEYS, StaleStatus.FRESH)

    # re-pair and re-convert the same recordings: same content, so the upload stays fresh
    materialize(assets[:2])
    assert data_version("dataset_npz") == dataset.sha256 and data_version("paired_episodes") == manifest_hash
    assert status("remote_dataset") == StaleStatus.FRESH

    # a recording changes (the same stem recorded again): pairing sees new content, conversion is stale
    samples.write_episode(tmp_path / "rec" / TASK, f"{TASK}_0000", replace(SPEC, seconds=2.3), seed=777)
    materialize(assets[:1])
    assert data_version("paired_episodes") != manifest_hash
    assert status("dataset_npz") == StaleStatus.STALE
    materialize(assets[1:2])
    assert data_version("dataset_npz") != dataset.sha256
    assert status("dataset_npz") == StaleStatus.FRESH and status("remote_dataset") == StaleStatus.STALE
