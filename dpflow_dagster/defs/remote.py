"""Assets and checks of the remote stage: ``remote_dataset`` and its SHA-256 check.

``remote_dataset`` wraps :func:`dpflow_core.runs.scale.upload_to_lab` (``dpflow scale`` calls it
too): :func:`~dpflow_core.server.upload.upload_dataset` (preflight, resumable transfer, SHA-256 on
the server) on the one server, on a Slurm cluster's login node (its shared file system; the
compute nodes' view is checked by the Slurm preflight of the runs), or on every host of
``gpu_server.hosts``, verified on each; its value is a :class:`~dpflow_core.server.upload.RemoteDataset`.
A mismatch at upload fails the
materialization with both hashes and sizes; the file stays on the server only
under a quarantine name. The blocking check ``remote_dataset_sha256_match``
hashes the remote file again (it also catches later corruption) and keeps
downstream assets (the smoke run, training) from running on a bad file.
"""

import dataclasses

import dagster as dg

from dpflow_core.errors import DpflowError
from dpflow_core.runs.scale import UploadMismatch, upload_to_lab
from dpflow_core.conversion import ConversionResult
from dpflow_core.server.upload import RemoteDataset, verify_remote_file
from dpflow_dagster.partitions import OWNERS, check_partition_metadata, stage_value, task_asset_check, task_partitions
from dpflow_dagster.resources import GpuServerResource


def _verification_metadata(v) -> dict:
    return {
        "local_sha256": v.local_sha256,
        "remote_sha256": v.remote_sha256 or "(missing)",
        "local_size_bytes": v.local_size,
        "remote_size_bytes": v.remote_size if v.remote_size is not None else -1,
        "remote_path": dg.MetadataValue.path(v.remote_path),
        **({"quarantine_path": dg.MetadataValue.path(v.quarantine_path)} if v.quarantine_path else {}),
    }


@dg.asset(
    group_name="dataset",
    kinds={"ssh"},
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    description="dataset.npz on the GPU server at <data_root>/<task>/<sha256[:16]>/dataset.npz, SHA-256 verified there.",
)
def remote_dataset(
    context: dg.AssetExecutionContext, dataset_npz: stage_value(ConversionResult), gpu_server: GpuServerResource
) -> dg.MaterializeResult[RemoteDataset]:
    """Upload the ``dataset_npz`` file (resumable) to every machine of ``gpu_server``, verify its SHA-256 on
    each, record preflight."""
    dataset = ConversionResult.coerce(dataset_npz)
    try:
        with gpu_server.connect_all() as servers:
            lab = upload_to_lab(
                servers,
                dataset.path,
                expected_sha256=dataset.sha256,
                sidecar_path=dataset.sidecar_path,
                method=gpu_server.upload_method,
                with_preflight=True,
                on_event=context.log.info,
            )
            hosts = [s.config.describe() for s in servers]
    except UploadMismatch as exc:
        raise dg.Failure(description=str(exc), metadata=_verification_metadata(exc.verification)) from exc
    except DpflowError as exc:
        raise dg.Failure(
            description=str(exc), metadata={"path": exc.path or "", "code": exc.code, "reason": exc.reason}
        ) from exc
    result = lab.results[0]
    report = result.preflight
    for where, each in zip(hosts, lab.results):
        context.log.info(f"{where}: {each.remote_path}: {each.method}, {each.bytes_sent} bytes sent, sha256 {each.sha256}")
    metadata = {
        "path": dg.MetadataValue.path(result.remote_path),
        "remote_path": dg.MetadataValue.path(result.remote_path),
        "host": result.host or "local",
        "task": result.task,
        "sha256": result.sha256,
        "size_bytes": result.size_bytes,
        "method": result.method,
        "already_present": result.already_present,
        "resumed_from_bytes": result.resumed_from_bytes,
        "bytes_sent": result.bytes_sent,
        "upload_seconds": round(result.duration_s, 3),
        **({"quarantined": ", ".join(result.quarantined)} if result.quarantined else {}),
    }
    if len(lab.results) > 1:
        metadata["machines"] = len(lab.results)
        for rank, (where, each) in enumerate(zip(hosts, lab.results)):
            metadata[f"host{rank}/remote_path"] = dg.MetadataValue.path(f"{where}:{each.remote_path}")
            metadata[f"host{rank}/bytes_sent"] = each.bytes_sent
    if report is not None:
        metadata.update(report.to_metadata())
        metadata["preflight/gpus"] = dg.MetadataValue.md(report.gpu_markdown())
    # each machine's copy, rank order (the same path on one server or a cluster's shared file system)
    value = dataclasses.replace(result.to_remote_dataset(dataset.frequency_hz), remote_paths=tuple(lab.paths))
    return dg.MaterializeResult(value=value, metadata=metadata, data_version=dg.DataVersion(result.sha256))


@task_asset_check(
    asset=remote_dataset,
    name="remote_dataset_sha256_match",
    blocking=True,
    description="The file on the server hashes (SHA-256, computed there) to the local dataset's hash, same size.",
)
def remote_dataset_sha256_match(
    context: dg.AssetCheckExecutionContext, remote_dataset: stage_value(RemoteDataset), gpu_server: GpuServerResource
) -> dg.AssetCheckResult:
    """Hash the dataset on each machine (``remote_paths``, rank order); quarantine a copy that does not match."""
    dataset = RemoteDataset.coerce(remote_dataset)
    with gpu_server.connect_all() as servers:
        paths = list(dataset.remote_paths) or [dataset.remote_path]
        verifications = [
            verify_remote_file(server, path, dataset.sha256, dataset.size_bytes, quarantine=True)
            for server, path in zip(servers, paths, strict=True)
        ]
        hosts = [s.config.describe() for s in servers]
    bad = [(where, v) for where, v in zip(hosts, verifications) if not v.match]
    metadata = {**check_partition_metadata(context), **_verification_metadata((bad[0][1] if bad else verifications[0]))}
    if len(verifications) > 1:
        metadata.update({f"host{rank}/remote_sha256": v.remote_sha256 or "(missing)" for rank, v in enumerate(verifications)})
    return dg.AssetCheckResult(
        passed=not bad,
        severity=dg.AssetCheckSeverity.ERROR,
        description="; ".join((f"{where}: " if len(hosts) > 1 else "") + v.describe() for where, v in bad) or None,
        metadata=metadata,
    )


defs = dg.Definitions(assets=[remote_dataset], asset_checks=[remote_dataset_sha256_match])
