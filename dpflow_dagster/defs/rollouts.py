"""The closed-loop judge: ``rollout_evaluation`` and its blocking check ``closed_loop_success``.

For a task recorded in the simulated world (its folder holds ``sim_task.json``) the asset rolls the
downloaded checkpoint out on held-out initial states beside the oracle, replay and hold baselines
(:func:`dpflow_core.sim.evaluate.closed_loop_for_task`, what ``dpflow rollout`` runs). A lab's real
recordings have no simulator: the asset says so in its metadata and the offline gate
(``evaluation`` / ``beats_baseline``) remains the judge.
"""


import base64
import dataclasses
from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field

from dpflow_core.checkpoints import DownloadedCheckpoint
from dpflow_core.errors import DpflowError
from dpflow_core.pairing import PairedEpisodes
from dpflow_core.sim.evaluate import ClosedLoopResult, ClosedLoopSettings, closed_loop_for_task
from dpflow_dagster.partitions import OWNERS, check_partition_metadata, stage_value, task_asset_check, task_partitions

_DEFAULTS = ClosedLoopSettings()


class RolloutEvaluationConfig(dg.Config):
    """Maps onto :class:`dpflow_core.sim.evaluate.ClosedLoopSettings` (its docstring has the units)."""

    episodes: int = Field(default=_DEFAULTS.episodes, description="Held-out initial states (rollouts per predictor).")
    seed: int = Field(default=_DEFAULTS.seed, description="Which block of held-out seeds (never a training seed).")
    baselines: list[str] = Field(default=list(_DEFAULTS.baselines), description="Baselines on the same states.")
    target: Optional[float] = Field(
        default=_DEFAULTS.target, description="Success the policy must reach (fraction); unset: the task's own "
        "(80 % pick_place, 60 % stack).")
    margin: float = Field(default=_DEFAULTS.margin, description="Points by which it must beat each non-oracle baseline.")
    video_episodes: int = Field(default=_DEFAULTS.video_episodes, description="Episodes filmed (mp4, contact sheet).")
    baseline_checkpoints: dict[str, str] = Field(
        default_factory=dict, description="Other checkpoints rolled out as baselines on the same states, by name "
        "(e.g. {'no_camera': '/path/blind.ckpt'}); each must be beaten by the margin too.")

    def settings(self) -> ClosedLoopSettings:
        return ClosedLoopSettings(self.episodes, self.seed, tuple(self.baselines), self.target, self.margin,
                                  self.video_episodes)


def _summary_metadata(result: ClosedLoopResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in [("policy", result.policy)] + sorted(result.baselines.items()):
        out[f"{name}/success_rate"] = float(s["success_rate"])
        out[f"{name}/wilson95"] = f"{100 * s['wilson_low']:.1f}-{100 * s['wilson_high']:.1f} %"
    return out


@dg.asset(
    group_name="training",
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    kinds={"pytorch", "mujoco"},
    description="Closed-loop success of the checkpoint on held-out initial states of its simulated task, beside the "
    "scripted demonstrator (oracle), open-loop replay and hold, with Wilson 95 % intervals and a film; "
    "'no simulator for this task' for a lab's recordings.",
)
def rollout_evaluation(
    context: dg.AssetExecutionContext, config: RolloutEvaluationConfig,
    checkpoint: stage_value(DownloadedCheckpoint), paired_episodes: stage_value(PairedEpisodes),
) -> dg.Output[ClosedLoopResult]:
    """Run :func:`dpflow_core.sim.evaluate.closed_loop_for_task`."""
    ckpt, paired = DownloadedCheckpoint.coerce(checkpoint), PairedEpisodes.coerce(paired_episodes)
    out_dir = Path(ckpt.local_dir) / "rollouts"
    try:
        result = closed_loop_for_task(ckpt.local_path, paired.root, out_dir, config.settings(), overwrite=True,
                                      baseline_policies={k: Path(v) for k, v in config.baseline_checkpoints.items()})
    except (DpflowError, ValueError) as exc:
        raise dg.Failure(description=str(exc), metadata={"checkpoint": str(ckpt.local_path), "task_dir": paired.root}) from exc
    metadata: dict[str, Any] = {"simulated": result.simulated, "checkpoint_sha256": ckpt.local_sha256}
    if not result.simulated:
        metadata["note"] = "no simulator for this task: the offline gate (evaluation / beats_baseline) judges it"
        return dg.Output(result, metadata=metadata)
    context.log.info(result.table())
    metadata |= {
        "task": result.task,
        "episodes": result.episodes,
        "seeds": f"{result.seeds[0]}-{result.seeds[-1]}",
        "success_rate": float(result.policy["success_rate"]),
        "table": dg.MetadataValue.md(result.table()),
        **_summary_metadata(result),
        "passed": result.passed,
        "out_dir": dg.MetadataValue.path(str(result.out_dir)),
        "rollouts_json": dg.MetadataValue.path(str(result.out_dir / "rollouts.json")),
        "command": f"dpflow rollout {ckpt.local_path} --task {result.task} --episodes {result.episodes}",
    }
    if result.contact_sheet:
        data = base64.b64encode(Path(result.contact_sheet).read_bytes()).decode("ascii")
        metadata["contact_sheet"] = dg.MetadataValue.md(f"![first rollouts](data:image/png;base64,{data})")
        metadata["video"] = dg.MetadataValue.path(str(result.video))
    return dg.Output(dataclasses.replace(result), metadata=metadata)


@task_asset_check(
    asset=rollout_evaluation,
    name="closed_loop_success",
    blocking=True,
    description="On held-out initial states of a simulated task, the policy's closed-loop success reaches the target "
    "and beats every non-oracle baseline (replay, hold) by the margin; the oracle must reach 98 % or the world is "
    "broken. A lab's recordings have no simulator: the check says so and the offline gate judges.",
)
def closed_loop_success(
    context: dg.AssetCheckExecutionContext, rollout_evaluation: stage_value(ClosedLoopResult)
) -> dg.AssetCheckResult:
    """Read the verdict recorded by the rollouts."""
    result = ClosedLoopResult.coerce(rollout_evaluation)
    if not result.simulated:
        return dg.AssetCheckResult(
            passed=True, severity=dg.AssetCheckSeverity.WARN, description="no simulator for this task (not applicable)",
            metadata={**check_partition_metadata(context), "simulated": False},
        )
    return dg.AssetCheckResult(
        passed=result.passed, severity=dg.AssetCheckSeverity.ERROR,
        description=result.reason or f"policy {100 * result.policy['success_rate']:.1f} % over {result.episodes} held-out states",
        metadata={**check_partition_metadata(context), **_summary_metadata(result), "target": result.target,
                  "margin": result.margin},
    )


defs = dg.Definitions(assets=[rollout_evaluation], asset_checks=[closed_loop_success])
