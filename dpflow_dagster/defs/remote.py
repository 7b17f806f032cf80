"""Assets and checks of the remote stage: ``remote_dataset`` and its SHA-256 check.

``remote_dataset`` wraps :func:`dpflow_core.server.upload.upload_dataset` (preflight,
resumable transfer, SHA-256 on the server). A mismatch at upload fails the
materialization with both hashes and sizes; the file stays on the server only
under a quarantine name. The blocking check ``remote_dataset_sha256_match``
hashes the remote file again (it also catches later corruption) and keeps
downstream assets (the smoke run, training) from running on a bad file.
"""

import dagster as dg

from dpflow_core.errors import DpflowError
from dpflow_core.server.upload import upload_dataset, verify_remote_file
from dpflow_dagster.partitions import OWNERS, check_partition_metadata, task_asset_check, task_partitions
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
def remote_dataset(context: dg.AssetExecutionContext, dataset_npz: dict, gpu_server: GpuServerResource) -> dg.MaterializeResult[dict]:
    """Upload ``dataset_npz["path"]`` (resumable), verify its SHA-256 on the server, record preflight."""
    try:
        with gpu_server.connect() as server:
            result = upload_dataset(
                server,
                dataset_npz["path"],
                expected_sha256=dataset_npz.get("sha256"),
                sidecar_path=dataset_npz.get("sidecar_path") or None,
                method=gpu_server.upload_method,
                with_preflight=True,
            )
    except DpflowError as exc:
        raise dg.Failure(
            description=str(exc), metadata={"path": exc.path or "", "code": exc.code, "reason": exc.reason}
        ) from exc
    report = result.preflight
    if not result.verified:
        raise dg.Failure(
            description=f"SHA-256 mismatch after upload: {result.verification.describe()}",
            metadata=_verification_metadata(result.verification),
        )
    context.log.info(
        f"{result.remote_path}: {result.method}, {result.bytes_sent} bytes sent, sha256 {result.sha256}"
    )
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
    if report is not None:
        metadata.update(report.to_metadata())
        metadata["preflight/gpus"] = dg.MetadataValue.md(report.gpu_markdown())
    return dg.MaterializeResult(
        value=result.to_remote_dataset(dataset_npz.get("frequency_hz", 0.0)), metadata=metadata,
        data_version=dg.DataVersion(result.sha256),
    )


@task_asset_check(
    asset=remote_dataset,
    name="remote_dataset_sha256_match",
    blocking=True,
    description="The file on the server hashes (SHA-256, computed there) to the local dataset's hash, same size.",
)
def remote_dataset_sha256_match(
    context: dg.AssetCheckExecutionContext, remote_dataset: dict, gpu_server: GpuServerResource
) -> dg.AssetCheckResult:
    """Hash ``remote_dataset["remote_path"]`` on the server; quarantine it on a mismatch."""
    with gpu_server.connect() as server:
        verification = verify_remote_file(
            server, remote_dataset["remote_path"], remote_dataset["sha256"], remote_dataset["size_bytes"],
            quarantine=True,
        )
    return dg.AssetCheckResult(
        passed=verification.match,
        severity=dg.AssetCheckSeverity.ERROR,
        description=None if verification.match else verification.describe(),
        metadata={**check_partition_metadata(context), **_verification_metadata(verification)},
    )


defs = dg.Definitions(assets=[remote_dataset], asset_checks=[remote_dataset_sha256_match])
