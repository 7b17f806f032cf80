"""Assets and checks of the dataset stage: ``dataset_npz`` and its blocking checks.

``dataset_npz`` is a thin wrapper over :func:`dpflow_core.conversion.convert`, its config the conversion
settings (:class:`~dpflow_core.conversion.settings.ConversionSettings`) plus where to write; its value is the
:class:`~dpflow_core.conversion.ConversionResult`;
the checks wrap :func:`dpflow_core.dataset.validate_dataset`. The output folder
is content-addressed (:func:`dpflow_core.conversion.dataset_path_in`),
``<output_dir>/datasets/<task>/<key12>/dataset.npz`` with ``key12`` the first 12 hex digits of
:func:`dpflow_core.conversion.dataset_key`
(input hashes, settings, converter version): re-materialising the same
inputs finds the existing dataset and reuses it instead of failing.

``umi_dataset`` (never automated: materialize it when the GPU server trains with
a lab's own UMI checkout) writes the same dataset in upstream UMI's zarr replay
buffer layout, ``dataset.zarr.zip`` beside the ``dataset.npz``
(:func:`dpflow_core.export.umi.export_umi`), and reuses it when its sidecar says it
came from the same ``dataset.npz`` with the same codec settings.
"""


from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field

from dpflow_core.conversion import CONVERTER_VERSION, ConversionResult, convert, dataset_path_in, load_inputs
from dpflow_core.conversion.settings import ConversionSettings, front_ends
from dpflow_core.dataset import CHECKS, MIN_TRAIN_LENGTH, validate_dataset
from dpflow_core.errors import DpflowError
from dpflow_core.files import default_workdir
from dpflow_core.export.umi import UmiExport
from dpflow_core.pairing import PairedEpisodes
from dpflow_dagster.partitions import (
    CONVERSION_AUTOMATION, OWNERS, check_partition_metadata, fail_blocking_checks, stage_value, task_check_spec,
    task_partitions,
)


#: The conversion settings' defaults, which the config's fields take (the plausibility defaults: an empty mapping).
_DEFAULTS = ConversionSettings()


def _help(name: str) -> str:
    return front_ends(ConversionSettings)[name]["help"]


class DatasetConfig(dg.Config):
    """How ``dataset_npz`` converts the paired episodes: the fields of
    :class:`~dpflow_core.conversion.settings.ConversionSettings` (names from its ``config`` metadata, defaults
    and descriptions from the settings; a test keeps them complete), plus where and with how many workers.
    ``ConversionSettings.from_config(config)`` maps it onto the settings."""

    image_width: int = Field(default=_DEFAULTS.image_size[0], description="Frame width in pixels (W of --image-size).")
    image_height: int = Field(default=_DEFAULTS.image_size[1], description="Frame height in pixels (H of --image-size).")
    workers: int = Field(default=0, description="Worker processes; 0 = CPU cores.")
    invalid_pose_policy: str = Field(default=_DEFAULTS.invalid_pose_policy, description=_help("invalid_pose_policy"))
    min_overlap_fraction: float = Field(default=_DEFAULTS.min_overlap_fraction, description=_help("min_overlap_fraction"))
    frequency_tolerance: float = Field(default=_DEFAULTS.frequency_tolerance, description=_help("frequency_tolerance"))
    rate_policy: str = Field(default=_DEFAULTS.rate_policy, description=_help("rate_policy"))
    max_gap_s: float = Field(default=_DEFAULTS.max_gap_s, description=_help("max_gap_s"))
    gap_policy: str = Field(default=_DEFAULTS.gap_policy, description=_help("gap_policy"))
    min_segment_frames: int = Field(default=_DEFAULTS.min_segment_frames, description=_help("min_segment_frames"))
    min_pose_score: float = Field(default=_DEFAULTS.min_pose_score, description=_help("min_pose_score"))
    short_episode_policy: str = Field(default=_DEFAULTS.short_episode_policy, description=_help("short_episode_policy"))
    plausibility: dict[str, Any] = Field(default_factory=dict, description=_help("plausibility"))
    output_dir: Optional[str] = Field(
        default=None,
        description="Work folder; datasets go to <output_dir>/datasets/<task>/<key>/. Default $DPFLOW_WORKDIR, else <cwd>/outputs.",
    )


def _md(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _inputs_table(meta: dict) -> str:
    rows = ["| stem | steps | Hz | trimmed s | vio_mcap sha256 |", "|---|---|---|---|---|"]
    episodes = {e["stem"]: e for e in meta.get("episodes", [])}
    for item in meta.get("inputs", {}).get("episodes", []):
        ep = episodes.get(item["stem"], {})
        sha = (item.get("files", {}).get("vio_mcap") or {}).get("sha256") or ""
        source = item.get("derived_from")  # a curated, trimmed copy: say so, and of which recording
        copy = f" (trimmed copy of `{source.get('sha256', '')}`)" if source else ""
        rows.append(
            f"| {_md(item['stem'])} | {ep.get('length', '')} | {ep.get('frequency_hz', 0):.2f} "
            f"| {ep.get('trimmed_s', {}).get('total', '')} | `{sha}`{copy} |"
        )
    return "\n".join(rows)


def _rejected_table(rejected: list[dict]) -> str:
    if not rejected:
        return "No episode rejected."
    rows = ["| stem | stage | code | reason |", "|---|---|---|---|"]
    rows += [f"| {_md(r.get('stem'))} | {r.get('stage')} | {r.get('code')} | {_md(r.get('reason'))} |" for r in rejected]
    return "\n".join(rows)


@dg.asset(
    group_name="dataset",
    kinds={"numpy"},
    owners=OWNERS,
    code_version=f"converter-{CONVERTER_VERSION}",
    partitions_def=task_partitions,
    automation_condition=CONVERSION_AUTOMATION,
    description=(
        "The replay buffer dataset.npz (formats.md section 2) converted from the accepted episodes: frames resized "
        "to the configured size, poses and gripper aligned on the camera timestamps, measured frequency, SHA-256, "
        "dataset.json sidecar and norm_stats.json."
    ),
)
def dataset_npz(
    context: dg.AssetExecutionContext, config: DatasetConfig, paired_episodes: stage_value(PairedEpisodes)
) -> dg.MaterializeResult[ConversionResult]:
    output_dir = Path(config.output_dir) if config.output_dir else default_workdir()
    paired = PairedEpisodes.coerce(paired_episodes)
    manifest_path = paired.manifest_path

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "episodes":
            context.log.info(f"aligned {done}/{total} episodes")

    try:
        settings = ConversionSettings.from_config(config)
        inputs = load_inputs(manifest_path)
        out = dataset_path_in(output_dir, inputs, settings, paired.task)
        # the manifest is read once: the inputs gathered for the dataset's path are what is converted
        result = convert(inputs, out, settings, workers=config.workers, reuse_existing=True, progress=progress)
    except DpflowError as exc:
        raise dg.Failure(
            description=str(exc),
            metadata={"path": exc.path or "", "code": exc.code, "reason": exc.reason, "manifest_path": manifest_path},
        ) from exc
    meta = result.metadata
    lengths = meta["episode_lengths"]
    if result.reused:
        context.log.info(f"reusing the identical dataset already at {result.path} (sha256 {result.sha256})")
    return dg.MaterializeResult(
        value=result,
        data_version=dg.DataVersion(result.sha256),
        metadata={
            "path": dg.MetadataValue.path(str(result.path)),
            "sha256": result.sha256,
            "size_bytes": result.size_bytes,
            "n_episodes": result.n_episodes,
            "total_steps": result.total_steps,
            "episode_length_min": lengths["min"],
            "episode_length_mean": float(lengths["mean"]),
            "episode_length_max": lengths["max"],
            "frequency_hz": result.frequency_hz,
            "image_size": f"{result.image_size[0]}x{result.image_size[1]}",
            "keys": dg.MetadataValue.json(meta["keys"]),
            "value_ranges": dg.MetadataValue.json(meta["value_ranges"]),
            "converter_version": meta["converter"]["version"],
            "dataset_key": meta["dataset_key"],
            "inputs": dg.MetadataValue.md(_inputs_table(meta)),
            "rejected_count": len(result.rejected),
            "rejected": dg.MetadataValue.md(_rejected_table(result.rejected)),
            "wall_time_s": result.wall_time_s,
            "frames_per_s": result.frames_per_s,
            "reused": result.reused,
            # The per-episode cache dpflow convert shares: episodes taken from it instead of aligned.
            "episodes_from_cache": int((meta.get("cache") or {}).get("episodes_reused", 0)),
            "episode_cache_dir": str((meta.get("cache") or {}).get("dir") or ""),
            "status": (
                f"reused the existing identical dataset (converted at {meta['created_at']})"
                if result.reused else "converted"
            ),
            "sidecar_path": dg.MetadataValue.path(str(result.sidecar_path)),
            "norm_stats_path": dg.MetadataValue.path(str(result.norm_stats_path)),
            "manifest_path": dg.MetadataValue.path(manifest_path),
        },
    )


_CHECK_DESCRIPTIONS = {
    "members_length_T": "Every data__ member has the same length T along time.",
    "episode_ends_valid": "meta__episode_ends is strictly increasing and its last value is T.",
    "values_finite": "No NaN or inf in the floating-point members.",
    "rotation_norm_le_pi": "Rotation vectors have norm <= pi.",
    "image_size": "Frames have the requested image size.",
    "min_two_episodes": "At least two episodes (the train/val split is by episode).",
    "short_episodes": "Episodes too short to yield a training sample (warns above the threshold).",
}


@dg.multi_asset_check(
    specs=[
        task_check_spec(name, asset="dataset_npz", blocking=True, description=_CHECK_DESCRIPTIONS[name])
        for name in CHECKS
    ],
    ins={"dataset_npz": dg.AssetIn("dataset_npz")},
    config_schema={
        "min_train_length": dg.Field(int, default_value=MIN_TRAIN_LENGTH,
                                     description="Shortest episode that yields a training sample (steps)."),
        "max_short_episodes": dg.Field(int, default_value=0, description="Warn above this many short episodes."),
    },
)
def dataset_npz_checks(context: dg.AssetCheckExecutionContext, dataset_npz: stage_value(ConversionResult)):
    """Blocking checks of the converted dataset (:func:`dpflow_core.dataset.validate_dataset`), for the run's task."""
    dataset = ConversionResult.coerce(dataset_npz)
    results = validate_dataset(
        dataset.path,
        image_size=dataset.image_size,
        min_train_length=context.op_execution_context.op_config["min_train_length"],
        max_short_episodes=context.op_execution_context.op_config["max_short_episodes"],
    )
    evaluations = [
        dg.AssetCheckResult(
            asset_key="dataset_npz",
            check_name=r.name,
            passed=r.passed,
            severity=dg.AssetCheckSeverity.WARN if r.severity == "warn" else dg.AssetCheckSeverity.ERROR,
            description=r.description,
            metadata={
                **check_partition_metadata(context),
                **{k: dg.MetadataValue.json(v) if isinstance(v, (dict, list)) else v for k, v in r.metadata.items()},
            },
        )
        for r in results
    ]
    yield from evaluations
    fail_blocking_checks(context, evaluations)


class UmiDatasetConfig(dg.Config):
    """JPEG-XL settings of ``umi_dataset``'s frames."""

    jpegxl_level: int = Field(default=80, description="JPEG-XL quality 0-100 of camera0_rgb frames (UMI's conversion: 80).")
    jpegxl_effort: int = Field(default=3, description="JPEG-XL encoder effort 1 (fast) - 9 (small).")


@dg.asset(
    group_name="dataset",
    kinds={"zarr"},
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    description=(
        "dataset_npz in upstream UMI's replay-buffer layout (zarr format 2 dataset.zarr.zip, JPEG-XL frames, "
        "meta/episode_ends) for a lab's own UMI train.py; SHA-256 in its .json sidecar. Not automated."
    ),
)
def umi_dataset(
    context: dg.AssetExecutionContext, config: UmiDatasetConfig, dataset_npz: stage_value(ConversionResult)
) -> dg.MaterializeResult[UmiExport]:
    from dpflow_core.export.umi import export_umi, read_umi_sidecar

    dataset = ConversionResult.coerce(dataset_npz)
    out = Path(dataset.path).with_name("dataset.zarr.zip")
    try:
        result = read_umi_sidecar(out, source_sha256=dataset.sha256, jpegxl_level=config.jpegxl_level,
                                  jpegxl_effort=config.jpegxl_effort)
        reused = result is not None
        if result is None:
            result = export_umi(dataset.path, out, jpegxl_level=config.jpegxl_level,
                                jpegxl_effort=config.jpegxl_effort, overwrite=out.exists())
    except DpflowError as exc:
        raise dg.Failure(description=str(exc), metadata={"path": str(exc.path or out), "code": exc.code}) from exc
    context.log.info(f"{result.path}: {result.n_episodes} episodes, {result.n_steps} steps, sha256 {result.sha256}"
                     + (" (reused)" if reused else ""))
    return dg.MaterializeResult(
        value=result,
        data_version=dg.DataVersion(result.sha256),
        metadata={
            "path": dg.MetadataValue.path(result.path),
            "sha256": result.sha256,
            "size_bytes": result.size_bytes,
            "n_episodes": result.n_episodes,
            "n_steps": result.n_steps,
            "image_shape": "x".join(str(v) for v in result.image_shape),
            "jpegxl": f"level {result.jpegxl_level}, effort {result.jpegxl_effort}",
            "dataset_sha256": result.source_sha256,
            "reused": reused,
        },
    )


defs = dg.Definitions(assets=[dataset_npz, umi_dataset], asset_checks=[dataset_npz_checks])
