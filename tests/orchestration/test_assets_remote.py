"""``remote_dataset`` and its blocking SHA-256 check, materialised through Dagster.

The upstream ``dataset_npz`` is a stub asset of the same key returning the
data-contract dict for a real file; the GPU server is the local transport,
and once the real sshd with the key given through an environment variable.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pytest

from dpflow_dagster.defs.remote import remote_dataset, remote_dataset_sha256_match
from dpflow_core.server.upload import RemoteDataset
from dpflow_dagster.partitions import task_partitions
from partitioned import materialize as materialize_task
from dpflow_dagster.resources import GpuServerResource, default_resources
from sshd import sshd_server  # noqa: F401  (fixture)

SIZE = 200_000


@pytest.fixture
def dataset(tmp_path) -> dict:
    """A dataset file with its sidecar, and the ``dataset_npz`` contract dict for it."""
    path = tmp_path / "datasets" / "pick_place" / "0123456789ab" / "dataset.npz"
    path.parent.mkdir(parents=True)
    # a real archive of random bytes (upload checks the archive's own CRC-32s before it sends anything)
    np.savez(path, data__x=np.frombuffer(os.urandom(SIZE), dtype=np.uint8))
    sidecar = path.with_suffix(".json")
    sidecar.write_text(json.dumps({"task": "pick_place"}))
    return {
        "path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size_bytes": path.stat().st_size,
        "sidecar_path": str(sidecar), "norm_stats_path": str(path.parent / "norm_stats.json"),
        "frequency_hz": 29.97, "n_episodes": 3, "total_steps": 120, "image_size": [224, 224],
    }


def _assets(dataset: dict):
    @dg.asset(name="dataset_npz", group_name="dataset")
    def dataset_npz_stub() -> dict:
        return dataset

    @dg.asset(name="smoke_probe", partitions_def=task_partitions)
    def smoke_probe(remote_dataset: RemoteDataset) -> str:
        return remote_dataset.remote_path

    return [dataset_npz_stub, remote_dataset, remote_dataset_sha256_match, smoke_probe]


def _resources(tmp_path: Path, gpu_server: GpuServerResource) -> dict:
    return {"gpu_server": gpu_server, "io_manager": dg.FilesystemIOManager(base_dir=str(tmp_path / "io"))}


def _check_evaluation(result):
    [evaluation] = result.get_asset_check_evaluations()
    assert evaluation.check_name == "remote_dataset_sha256_match"
    return evaluation, {k: v.value for k, v in evaluation.metadata.items()}


def test_definitions_wire_remote_dataset():
    from dpflow_dagster.definitions import defs

    graph = defs.resolve_asset_graph()
    node = graph.get(dg.AssetKey("remote_dataset"))
    assert node.group_name == "dataset" and "ssh" in node.kinds
    assert dg.AssetKey("dataset_npz") in node.parent_keys
    [check_key] = [k for k in graph.asset_check_keys if k.name == "remote_dataset_sha256_match"]
    assert check_key.asset_key == dg.AssetKey("remote_dataset")
    assert graph.get_check_spec(check_key).blocking
    resource = default_resources()["gpu_server"]
    assert isinstance(resource, GpuServerResource)


def test_materialize_upload_and_check_then_catch_corruption(tmp_path, dataset):
    instance = dg.DagsterInstance.ephemeral()
    data_root = tmp_path / "server"
    resources = _resources(tmp_path, GpuServerResource(data_root=str(data_root), python=sys.executable))
    result = materialize_task(_assets(dataset), "pick_place", resources=resources, instance=instance)
    assert result.success
    expected_path = str(data_root / "pick_place" / dataset["sha256"][:16] / "dataset.npz")
    assert result.output_for_node("remote_dataset").to_dict() == {
        "remote_path": expected_path, "sha256": dataset["sha256"], "size_bytes": dataset["size_bytes"], "host": None,
        "frequency_hz": 29.97, "local_path": dataset["path"], "remote_paths": [expected_path],
    }
    assert Path(expected_path).read_bytes() == Path(dataset["path"]).read_bytes()
    assert result.output_for_node("smoke_probe") == expected_path

    [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key == dg.AssetKey("remote_dataset")]
    meta = {k: v.value for k, v in mat.materialization.metadata.items()}
    assert meta["sha256"] == dataset["sha256"] and meta["task"] == "pick_place" and meta["host"] == "local"
    assert meta["method"] in ("rsync", "copy") and meta["bytes_sent"] == dataset["size_bytes"]
    assert meta["preflight/ok"] is True and meta["preflight/gpu_status"] == "no_gpu"
    assert meta["preflight/nproc"] == len(os.sched_getaffinity(0))
    assert meta["preflight/repo_commit"] and "no_gpu" in meta["preflight/gpus"]

    evaluation, check_meta = _check_evaluation(result)
    assert evaluation.passed
    assert check_meta["local_sha256"] == check_meta["remote_sha256"] == dataset["sha256"]
    assert check_meta["local_size_bytes"] == check_meta["remote_size_bytes"] == dataset["size_bytes"]

    # One byte flipped on the server after the upload: the check (run again, with the
    # downstream asset) fails, quarantines the file and blocks the downstream asset.
    with open(expected_path, "r+b") as fh:
        fh.seek(SIZE // 3)
        byte = fh.read(1)
        fh.seek(SIZE // 3)
        fh.write(bytes([byte[0] ^ 0x10]))
    rerun = materialize_task(
        _assets(dataset), "pick_place", resources=resources, instance=instance, raise_on_error=False,
        selection=dg.AssetSelection.checks(remote_dataset_sha256_match) | dg.AssetSelection.assets("smoke_probe"),
    )
    assert not rerun.success
    evaluation, check_meta = _check_evaluation(rerun)
    assert not evaluation.passed
    assert check_meta["local_sha256"] == dataset["sha256"] != check_meta["remote_sha256"]
    assert check_meta["remote_sha256"] == hashlib.sha256(Path(check_meta["quarantine_path"]).read_bytes()).hexdigest()
    assert not Path(expected_path).exists()
    assert not [m for m in rerun.get_asset_materialization_events() if m.asset_key == dg.AssetKey("smoke_probe")]
    # the check's step, and with it the run, fails with dpflow's reason: the check, the task and both hashes
    [failure] = [e for e in rerun.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_failure_data.user_failure_data.description == (
        f"blocking check remote_dataset:remote_dataset_sha256_match failed for task pick_place: {evaluation.description}")
    assert dataset["sha256"] in evaluation.description and check_meta["remote_sha256"] in evaluation.description


def test_mismatch_at_upload_fails_with_both_hashes(tmp_path, dataset):
    data_root = tmp_path / "server"
    final = data_root / "pick_place" / dataset["sha256"][:16] / "dataset.npz"
    final.parent.mkdir(parents=True)
    corrupted = bytearray(Path(dataset["path"]).read_bytes())
    corrupted[7] ^= 0x01
    Path(f"{final}.partial").write_bytes(corrupted)  # resume by size will trust it; the hash will not
    resources = _resources(tmp_path, GpuServerResource(data_root=str(data_root), upload_method="stream"))
    result = materialize_task(_assets(dataset), "pick_place", resources=resources, raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failure.step_key == "remote_dataset"
    info = failure.step_failure_data.user_failure_data
    meta = {k: v.value for k, v in info.metadata.items()}
    assert meta["local_sha256"] == dataset["sha256"]
    assert meta["remote_sha256"] == hashlib.sha256(corrupted).hexdigest()
    assert meta["local_size_bytes"] == meta["remote_size_bytes"] == dataset["size_bytes"]
    assert Path(meta["quarantine_path"]).read_bytes() == bytes(corrupted) and not final.exists()
    assert dataset["sha256"] in info.description
    materialized = {m.asset_key for m in result.get_asset_materialization_events()}
    assert dg.AssetKey("remote_dataset") not in materialized and dg.AssetKey("smoke_probe") not in materialized


@pytest.mark.sshd
@pytest.mark.slow
def test_ssh_resource_from_environment_keeps_the_key_out_of_records(sshd_server, tmp_path, dataset, monkeypatch):
    data_root = tmp_path / "ssh-server"
    monkeypatch.setenv("DPFLOW_SERVER_HOST", sshd_server.host)
    monkeypatch.setenv("DPFLOW_SERVER_PORT", str(sshd_server.port))
    monkeypatch.setenv("DPFLOW_SERVER_USER", sshd_server.user)
    monkeypatch.setenv("DPFLOW_SERVER_KEY", str(sshd_server.key_path))
    monkeypatch.setenv("DPFLOW_KNOWN_HOSTS", str(sshd_server.known_hosts))
    monkeypatch.setenv("DPFLOW_SERVER_ROOT", str(data_root))
    monkeypatch.setenv("DPFLOW_SERVER_PYTHON", sys.executable)
    gpu_server = default_resources()["gpu_server"]
    assert str(sshd_server.key_path) not in repr(gpu_server)  # an EnvVar reference, not the value

    instance = dg.DagsterInstance.ephemeral()
    result = materialize_task(_assets(dataset), "pick_place", resources=_resources(tmp_path, gpu_server), instance=instance)
    assert result.success
    value = result.output_for_node("remote_dataset")
    assert value.host == sshd_server.host
    assert Path(value.remote_path).read_bytes() == Path(dataset["path"]).read_bytes()
    assert str(value.remote_path).startswith(str(data_root))
    assert _check_evaluation(result)[0].passed

    records = [str(entry) for entry in instance.all_logs(result.run_id)]
    records.append(json.dumps(result.dagster_run.run_config, default=str))
    assert records and not [r for r in records if str(sshd_server.key_path) in r]


def test_unknown_host_key_fails_with_code_and_reason(sshd_server, tmp_path, dataset):
    known_hosts = tmp_path / "empty_known_hosts"
    known_hosts.write_text("")
    gpu_server = GpuServerResource(
        host=sshd_server.host, port=sshd_server.port, user=sshd_server.user, key_file=str(sshd_server.key_path),
        known_hosts=str(known_hosts), data_root=str(tmp_path / "never"),
    )
    result = materialize_task(_assets(dataset), "pick_place", resources=_resources(tmp_path, gpu_server), raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    meta = {k: v.value for k, v in failure.step_failure_data.user_failure_data.metadata.items()}
    assert failure.step_key == "remote_dataset" and meta["code"] == "unknown_host_key"
    assert not (tmp_path / "never").exists()
