"""The closed-loop judge: ``rollout_evaluation`` and its blocking check ``closed_loop_success``, and the
policy it must show is needed: the same training without the camera (``no_camera_run``, ``no_camera_checkpoint``).

For a task recorded in the simulated world (its folder holds ``sim_task.json``) the asset rolls the
downloaded checkpoint out on held-out initial states beside the oracle, replay and hold baselines
(:func:`dpflow_core.sim.evaluate.closed_loop_for_task`, what ``dpflow rollout`` runs). A lab's real
recordings have no simulator: the asset says so in its metadata and the offline gate
(``evaluation`` / ``beats_baseline``) remains the judge.

The no-camera ablation (:func:`dpflow_core.runs.recipe.no_camera_on_lab`): ``no_camera_run`` launches it on
the server right after the smoke run and returns (it has the higher priority of the two steps then ready, so it
trains beside ``train_run``'s policy, each on one core of a CPU server); ``no_camera_checkpoint`` follows it to
its end (re-attaching by name), judges its natural exit and downloads its ``latest.ckpt``; ``rollout_evaluation``
rolls it out as the baseline ``no_camera`` on the same held-out states, which the policy must beat by the
margin like every non-oracle baseline. Both skip, saying why, for a lab's recordings (no simulator), with
``enabled: false``, and off one server.
"""


import base64
import dataclasses
from pathlib import Path
from typing import Any, Optional

import dagster as dg
from pydantic import Field

from dpflow_core.checkpoints import DownloadedCheckpoint, download_checkpoint
from dpflow_core.errors import DpflowError
from dpflow_core.pairing import PairedEpisodes
from dpflow_core.runs import TrainSettings
from dpflow_core.runs.recipe import AblationRun, no_camera_on_lab
from dpflow_core.server.upload import RemoteDataset
from dpflow_core.settings import front_ends
from dpflow_core.sim.evaluate import ClosedLoopResult, closed_loop_for_task
from dpflow_core.sim.settings import ClosedLoopSettings
from dpflow_dagster.defs.run_config import TrainRunConfig
from dpflow_dagster.defs.training import POOL, CheckpointConfig, from_world, smoke_run
from dpflow_dagster.partitions import OWNERS, check_partition_metadata, stage_value, task_asset_check, task_partitions
from dpflow_dagster.resources import GpuServerResource

_DEFAULTS = ClosedLoopSettings()


def _help(name: str) -> str:
    return front_ends(ClosedLoopSettings)[name]["help"]


class RolloutEvaluationConfig(dg.Config):
    """Maps onto :class:`dpflow_core.sim.settings.ClosedLoopSettings` (its defaults and help; its docstring has the
    units), plus the other checkpoints rolled out as baselines."""

    episodes: int = Field(default=_DEFAULTS.episodes, description=_help("episodes"))
    seed: int = Field(default=_DEFAULTS.seed, description=_help("seed"))
    baselines: list[str] = Field(default=list(_DEFAULTS.baselines), description=_help("baselines"))
    target: Optional[float] = Field(default=_DEFAULTS.target, description=_help("target"))
    margin: float = Field(default=_DEFAULTS.margin, description=_help("margin"))
    video_episodes: int = Field(default=_DEFAULTS.video_episodes, description=_help("video_episodes"))
    n_action_steps: Optional[int] = Field(default=_DEFAULTS.n_action_steps, description=_help("n_action_steps"))
    baseline_checkpoints: dict[str, str] = Field(
        default_factory=dict, description="Other checkpoints rolled out as baselines on the same states, by name "
        "(e.g. {'no_camera': '/path/blind.ckpt'}); each must be beaten by the margin too.")

    def settings(self) -> ClosedLoopSettings:
        return ClosedLoopSettings.from_config(self)


def _summary_metadata(result: ClosedLoopResult) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in [("policy", result.policy)] + sorted(result.baselines.items()):
        out[f"{name}/success_rate"] = float(s["success_rate"])
        out[f"{name}/wilson95"] = f"{100 * s['wilson_low']:.1f}-{100 * s['wilson_high']:.1f} %"
    return out


NO_CAMERA = "no_camera"


class NoCameraRunConfig(TrainRunConfig):
    """The ablation's training settings: those of ``train_run`` (the main job copies its ``train_run`` config
    here), with ``task.rgb_keys=[]`` appended to the overrides."""

    enabled: bool = Field(default=True, description="Train the no-camera ablation for a task of the simulated world "
                          "(a lab's recordings never: no simulator rolls it out).")


def _skip(context: dg.AssetExecutionContext, enabled: bool, lab_mode: str) -> str:
    """Why the ablation is not trained for this partition ('' when it is)."""
    if not enabled:
        return "disabled (no_camera_run: enabled: false)"
    if not from_world(context.partition_key if context.has_partition_key else None):
        return "no simulator for this task: nothing would roll the ablation out"
    if lab_mode != "single":
        return f"the ablation trains on one server, not a {lab_mode} lab"
    return ""


@dg.asset(
    group_name="training",
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    pool=POOL,
    kinds={"pytorch", "ssh"},
    deps=[smoke_run],
    # launched before train_run (both are ready once the smoke run passed): it then trains beside the policy
    op_tags={"dagster/priority": "1"},
    description="The same training as train_run without the camera (task.rgb_keys=[]), launched detached for a task "
    "of the simulated world: the ablation the closed-loop judge must see fail.",
)
def no_camera_run(
    context: dg.AssetExecutionContext, config: NoCameraRunConfig, remote_dataset: stage_value(RemoteDataset),
    gpu_server: GpuServerResource,
) -> dg.Output[AblationRun]:
    """Launch :func:`dpflow_core.runs.recipe.no_camera_on_lab` and return once it runs."""
    remote = RemoteDataset.coerce(remote_dataset)
    lab = gpu_server.lab()
    skipped = _skip(context, config.enabled, lab.mode)
    if skipped:
        return dg.Output(AblationRun(NO_CAMERA, skipped=skipped), metadata={"skipped": skipped})
    try:
        settings = TrainSettings.from_config(config)
        with gpu_server.connect_all() as servers:
            run = no_camera_on_lab(servers, lab, remote, settings, detach=True, on_event=context.log.info)
    except (DpflowError, ValueError) as exc:
        raise dg.Failure(description=f"no-camera ablation: {exc}") from exc
    spec, handle = run.spec, run.result.handle
    value = AblationRun(NO_CAMERA, spec.name, dataclasses.asdict(dataclasses.replace(settings, run_name=spec.name)))
    return dg.Output(value, metadata={"run_name": spec.name, "attached": run.result.attached,
                                      "run_dir": dg.MetadataValue.path(handle.run_dir if handle else ""),
                                      "overrides": " ".join(spec.extra_overrides)})


@dg.asset(
    group_name="training",
    owners=OWNERS,
    code_version="1",
    partitions_def=task_partitions,
    kinds={"pytorch", "ssh"},
    description="The no-camera ablation followed to its natural exit and its latest.ckpt downloaded, SHA-256 "
    "verified (skipped where no_camera_run was).",
)
def no_camera_checkpoint(
    context: dg.AssetExecutionContext, config: CheckpointConfig, no_camera_run: stage_value(AblationRun),
    remote_dataset: stage_value(RemoteDataset), gpu_server: GpuServerResource,
) -> dg.Output[AblationRun]:
    """Re-attach to the ablation by name (:func:`~dpflow_core.runs.recipe.no_camera_on_lab`), then
    :func:`dpflow_core.checkpoints.download_checkpoint`."""
    ablation, remote = AblationRun.coerce(no_camera_run), RemoteDataset.coerce(remote_dataset)
    if ablation.skipped:
        return dg.Output(ablation, metadata={"skipped": ablation.skipped})
    try:
        settings = ablation.train_settings()
        with gpu_server.connect_all() as servers:
            run = no_camera_on_lab(servers, gpu_server.lab(), remote, settings, detach=False, on_event=context.log.info)
            if not run.result.passed:
                raise dg.Failure(description=f"no-camera ablation {ablation.run_name}: {'; '.join(run.result.problems)}")
            got = download_checkpoint(servers[0], ablation.run_name, choose=config.choose,
                                      dest_root=config.output_dir or None, stable_interval_s=config.stable_interval_s)
    except (DpflowError, ValueError) as exc:
        raise dg.Failure(description=f"no-camera ablation {ablation.run_name}: {exc}") from exc
    value = dataclasses.replace(ablation, checkpoint_path=str(got.local_path), checkpoint_sha256=got.local_sha256)
    return dg.Output(value, metadata={"run_name": ablation.run_name, "global_step": run.result.global_step or 0,
                                      "path": dg.MetadataValue.path(str(got.local_path)), "sha256": got.local_sha256})


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
    no_camera_checkpoint: stage_value(AblationRun),
) -> dg.Output[ClosedLoopResult]:
    """Run :func:`dpflow_core.sim.evaluate.closed_loop_for_task`, with the no-camera ablation as a baseline
    when it was trained (a ``baseline_checkpoints`` entry of the same name replaces it)."""
    ckpt, paired = DownloadedCheckpoint.coerce(checkpoint), PairedEpisodes.coerce(paired_episodes)
    ablation = AblationRun.coerce(no_camera_checkpoint)
    baseline_policies = {} if ablation.skipped else {ablation.name: Path(ablation.checkpoint_path)}
    baseline_policies |= {k: Path(v) for k, v in config.baseline_checkpoints.items()}
    out_dir = Path(ckpt.local_dir) / "rollouts"
    try:
        result = closed_loop_for_task(ckpt.local_path, paired.root, out_dir, config.settings(), overwrite=True,
                                      baseline_policies=baseline_policies)
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
        "n_action_steps": result.n_action_steps,
        "command": f"dpflow rollout {ckpt.local_path} --task {result.task} --episodes {result.episodes}"
                   + (f" --n-action-steps {config.n_action_steps}" if config.n_action_steps else ""),
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


defs = dg.Definitions(assets=[no_camera_run, no_camera_checkpoint, rollout_evaluation],
                      asset_checks=[closed_loop_success])
