"""Assets of the LeRobot export: ``lerobot_dataset`` (LeRobot v3.0 or v2.1) and ``norm_stats`` (openpi).

Thin wrappers over :func:`dpflow_core.export.export_lerobot` and
:func:`dpflow_core.export.write_openpi_norm_stats`; their values are a
:class:`~dpflow_core.export.LeRobotExport` and an :class:`~dpflow_core.export.OpenpiNormStatsFile`.
The dataset folder is content-addressed (``<work folder>/lerobot/<task>/<export key>``, see
:func:`dpflow_core.export.lerobot_path_in`), so a
re-materialization of the same inputs and options finds its export and reuses
it, and different options never overwrite an earlier export.
"""

from pathlib import Path
from typing import Optional

import dagster as dg
from pydantic import Field

from dpflow_core import export as lerobot
from dpflow_core.errors import DpflowError
from dpflow_core.export.settings import ExportSettings
from dpflow_core.files import default_workdir
from dpflow_core.pairing import PairedEpisodes
from dpflow_core.recordings.topics import DAS_DEFAULT, TopicMap
from dpflow_core.settings import front_ends
from dpflow_dagster.partitions import CONVERSION_AUTOMATION, OWNERS, stage_value, task_partitions


_EXPORT = ExportSettings()


def _help(name: str) -> str:
    return front_ends(ExportSettings)[name]["help"]


class LeRobotDatasetConfig(dg.Config):
    """How the LeRobot dataset is written: :class:`~dpflow_core.export.settings.ExportSettings`' fields (their
    defaults and help), the work folder and the worker count."""

    output_dir: Optional[str] = Field(
        default=None,
        description="Work folder; exports go to <output_dir>/lerobot/<task>/<export key>/. Default $DPFLOW_WORKDIR, else <cwd>/outputs.",
    )
    task_text: Optional[str] = Field(default=_EXPORT.task_text, description=_help("task_text"))
    action_rule: str = Field(default=_EXPORT.action_rule, description=_help("action_rule"))
    image_size: str = Field(default="native", description=_help("image_size"))
    invalid_pose_policy: str = Field(default=_EXPORT.invalid_pose_policy, description=_help("invalid_pose_policy"))
    min_overlap_fraction: float = Field(default=_EXPORT.min_overlap_fraction, description=_help("min_overlap_fraction"))
    frequency_tolerance: float = Field(default=_EXPORT.frequency_tolerance, description=_help("frequency_tolerance"))
    rate_policy: str = Field(default=_EXPORT.rate_policy, description=_help("rate_policy"))
    workers: int = Field(default=0, description="Alignment worker processes; 0 = CPU cores.")
    format: str = Field(default=_EXPORT.codebase_version, description=_help("codebase_version"))
    rotation: str = Field(default=_EXPORT.rotation, description=_help("rotation"))


class NormStatsConfig(dg.Config):
    """Where openpi's norm_stats.json goes."""

    output: Optional[str] = Field(
        default=None, description="File or folder (e.g. openpi assets/<config>/<repo_id>); default <dataset>/norm_stats.json."
    )
    overwrite: bool = Field(default=False, description="Replace a different existing norm_stats.json.")


def _failure(exc: DpflowError) -> dg.Failure:
    return dg.Failure(description=str(exc), metadata={"path": exc.path or "", "code": exc.code, "reason": exc.reason})


def _skipped_table(skipped: dict[str, str]) -> str:
    if not skipped:
        return "None."
    rows = ["| stem | reason |", "|---|---|"]
    rows += [f"| {stem} | {reason.replace('|', '/').replace(chr(10), ' ')} |" for stem, reason in skipped.items()]
    return "\n".join(rows)


@dg.asset(
    group_name="dataset",
    kinds={"parquet"},
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    automation_condition=CONVERSION_AUTOMATION,
    description=(
        "LeRobot dataset, v3.0 (default) or v2.1 (config format): meta/info.json, episode index, tasks, stats, "
        "parquet data and H.264 MP4 per camera, of the paired episodes, aligned by the same code as dataset.npz; "
        "fps = measured frequency."
    ),
)
def lerobot_dataset(
    context: dg.AssetExecutionContext, config: LeRobotDatasetConfig, paired_episodes: stage_value(PairedEpisodes)
) -> dg.Output[lerobot.LeRobotExport]:
    paired = PairedEpisodes.coerce(paired_episodes)
    workdir = Path(config.output_dir) if config.output_dir else default_workdir()
    topics: TopicMap = DAS_DEFAULT
    try:
        settings = ExportSettings.from_config(config)
        out = lerobot.lerobot_path_in(workdir, paired.manifest_path, paired.task, settings, topics=topics)
        result = lerobot.export_lerobot(
            paired.manifest_path, out, settings, topics=topics, workers=config.workers, reuse_existing=True,
            progress=lambda stem, done, total: context.log.debug(f"{done}/{total} {stem}"),
        )
    except DpflowError as exc:
        raise _failure(exc) from exc
    context.log.info(
        f"{result.path}: {result.n_episodes} episodes, {result.total_frames} frames at {result.fps:.3f} Hz"
        + (" (reused)" if result.reused else "")
    )
    return dg.Output(
        result,
        metadata={
            "path": dg.MetadataValue.path(str(result.path)),
            "codebase_version": result.codebase_version,
            "fps": result.fps,
            "n_episodes": result.n_episodes,
            "total_frames": result.total_frames,
            "image_size": f"{result.image_size[0]}x{result.image_size[1]}",
            "action_rule": result.action_rule,
            "task": result.task,
            "export_key": result.export_key or "",
            "reused": result.reused,
            "skipped": dg.MetadataValue.md(_skipped_table(result.skipped)),
            "rate_policy": config.rate_policy,
            "resampled": ", ".join(result.resampled),
            "rate_groups": dg.MetadataValue.json(result.rate_groups),
        },
    )


@dg.asset(
    group_name="dataset",
    kinds={"parquet"},
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    automation_condition=CONVERSION_AUTOMATION,
    description=(
        "openpi norm_stats.json (mean, std, q01, q99 of state and actions) of the LeRobot dataset, from its parquet "
        "columns only; fails at once when meta/info.json is missing, of another codebase_version or inconsistent."
    ),
)
def norm_stats(
    context: dg.AssetExecutionContext, config: NormStatsConfig, lerobot_dataset: stage_value(lerobot.LeRobotExport)
) -> dg.Output[lerobot.OpenpiNormStatsFile]:
    dataset = str(lerobot.LeRobotExport.coerce(lerobot_dataset).path)
    try:
        path = lerobot.write_openpi_norm_stats(dataset, config.output, overwrite=config.overwrite)
        value = lerobot.OpenpiNormStatsFile.read(path, dataset)
        table = value.markdown_table()
    except DpflowError as exc:
        raise _failure(exc) from exc
    context.log.info(f"norm stats -> {path}")
    return dg.Output(
        value,
        metadata={
            "path": dg.MetadataValue.path(str(path)),
            "dataset_path": dg.MetadataValue.path(dataset),
            "norm_stats": dg.MetadataValue.md(table),
        },
    )


defs = dg.Definitions(assets=[lerobot_dataset, norm_stats])
