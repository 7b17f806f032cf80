"""One recipe per run kind: the smoke run and the training run, on one server, a Slurm cluster or several hosts.

``dpflow smoke|train``, ``dpflow scale smoke|train`` and the ``smoke_run`` / ``train_run`` assets
call :func:`smoke_on_lab` and :func:`train_on_lab` with their options mapped onto
:class:`~dpflow_core.runs.settings.SmokeSettings` / :class:`~dpflow_core.runs.settings.TrainSettings`.
Each recipe names the run (rule 1), checks the server's GPUs, picks the trainer config, builds the
:class:`~dpflow_core.runs.spec.RunSpec` and runs it with :func:`~dpflow_core.runs.scale.run_on_lab`.

Naming: ``<kind>-<sha256[:12]>-<UTC time>`` unless ``run_name`` is set; a training run of one server
without a name first re-attaches to the running training of the same dataset
(:func:`~dpflow_core.runs.state.active_or_new_run_name`). GPUs: on one server the current nvidia-smi must
show a usable GPU where one is expected (:func:`~dpflow_core.runs.gpus.require_gpus`); on a cluster Slurm
chooses them (``gpu_ids`` is refused there). Config ``auto``: :func:`~dpflow_core.runs.spec.resolve_config_name`
from the first server's nvidia-smi, on a cluster :func:`~dpflow_core.runs.scale.slurm_config_name`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

from dpflow_core.errors import RunError
from dpflow_core.results import StageResult
from dpflow_core.server import GpuInventory, GpuServer
from dpflow_core.server.lab import LabServers
from dpflow_core.server.upload import RemoteDataset
from dpflow_core.runs.gpus import require_gpus
from dpflow_core.runs.scale import EventCallback, RunHooks, ScaleResult, run_on_lab, slurm_config_name
from dpflow_core.runs.settings import SmokeSettings, TrainSettings
from dpflow_core.runs.smoke import ResumeCheckSize, SmokeRun
from dpflow_core.runs.spec import GPU_CONFIG_NAME, RunSpec, default_run_name, resolve_config_name
from dpflow_core.runs.state import active_or_new_run_name

#: Opens what a front end adds to a run on one server (a Dagster Pipes session), given the server and the spec;
#: the recipes also take a plain :class:`RunHooks`.
HooksFactory = Callable[[GpuServer, RunSpec], ContextManager[RunHooks]]


@dataclass(frozen=True)
class LabRun:
    """A run made by a recipe: its ``spec`` and how it went (``result``)."""

    spec: RunSpec
    result: ScaleResult


def _config_name(server: GpuServer, lab: LabServers, config_name: str, inventory: GpuInventory | None) -> str:
    if lab.mode == "slurm":
        return slurm_config_name(config_name, server.config.slurm)
    if config_name != "auto":  # named: no nvidia-smi needed
        return config_name
    return resolve_config_name(config_name, inventory if inventory is not None else server.gpu_inventory(), server)


def _checked_inventory(server: GpuServer, lab: LabServers, kind: str, gpu_ids: Sequence[int]) -> GpuInventory | None:
    """The nvidia-smi of the server a run starts on by itself (one server; a smoke run's first host), checked
    (rule 5); None for a Slurm job (which refuses ``gpu_ids``) and a multi-machine run (each host chooses its own)."""
    if lab.mode == "slurm" and gpu_ids:
        raise RunError(f"gpu_ids {list(gpu_ids)}: on a Slurm cluster the scheduler chooses the GPUs", code="bad_config")
    if not (lab.mode == "single" or (lab.mode == "hosts" and kind == "smoke")):
        return None
    inventory = server.gpu_inventory()
    require_gpus(server, inventory)
    return inventory


def _paths(dataset: RemoteDataset, servers: Sequence[GpuServer]) -> list[str]:
    return list(dataset.remote_paths) or [dataset.remote_path] * len(servers)


def _hooks(hooks: HooksFactory | RunHooks | None, server: GpuServer, spec: RunSpec,
           lab: LabServers) -> ContextManager[RunHooks]:
    # hooks reach a run on one server or the first host; Slurm jobs and multi-machine runs report through their own files
    used = lab.mode == "single" or (lab.mode == "hosts" and spec.kind == "smoke")
    if hooks is None or not used:
        return contextlib.nullcontext(RunHooks())
    return contextlib.nullcontext(hooks) if isinstance(hooks, RunHooks) else hooks(server, spec)


def _announce(on_event: EventCallback | None, spec: RunSpec, lab: LabServers, servers: Sequence[GpuServer]) -> None:
    if on_event is not None:
        on_event(f"{spec.kind} run {spec.name} ({lab.mode}, {len(servers)} server(s)) via {servers[0].config.describe()}")


def smoke_spec(
    name: str,
    dataset_path: str,
    frequency_hz: float,
    settings: SmokeSettings | None = None,
    *,
    dataset_sha256: str | None = None,
    config_name: str | None = None,
) -> RunSpec:
    """A smoke run (rule 6) of ``settings`` (:class:`~dpflow_core.runs.settings.SmokeSettings`; default its
    defaults): one GPU (its ``gpu_ids``), offline logging, no resume, few steps, small batch, no checkpoints.
    ``config_name``: the trainer config chosen for it (the recipe resolves ``auto``); default the settings' own,
    :data:`GPU_CONFIG_NAME` when that is ``auto``."""
    s = settings or SmokeSettings()
    chosen = config_name or (GPU_CONFIG_NAME if s.config_name == "auto" else s.config_name)
    return RunSpec(
        name=name, kind="smoke", dataset_path=dataset_path, frequency_hz=frequency_hz, dataset_sha256=dataset_sha256,
        config_name=chosen, epochs=s.epochs, max_train_steps=s.max_train_steps, max_val_steps=s.max_train_steps,
        batch_size=s.batch_size, num_workers=s.num_workers, num_processes=1, gpu_ids=tuple(s.gpu_ids),
        train_command=s.train_command, resume=False,
        logging_mode="offline", extra_overrides=tuple(s.extra_overrides), save_checkpoints=False,
    )


def smoke_on_lab(
    servers: Sequence[GpuServer],
    lab: LabServers,
    dataset: RemoteDataset,
    settings: SmokeSettings,
    *,
    hooks: HooksFactory | RunHooks | None = None,
    on_event: EventCallback | None = None,
) -> LabRun:
    """The smoke run of ``dataset`` (rule 6): on the one server, as a one-node Slurm job, or on the first host.

    Raises:
        RunError: ``gpu_unavailable`` (no usable GPU where one is expected, or ``auto`` over SSH without one),
            ``bad_config``; what :func:`~dpflow_core.runs.scale.run_on_lab` raises.
    """
    server = servers[0]
    inventory = _checked_inventory(server, lab, "smoke", settings.gpu_ids)
    spec = smoke_spec(settings.run_name or default_run_name(dataset.sha256, "smoke"), dataset.remote_path,
                      dataset.frequency_hz, settings, dataset_sha256=dataset.sha256,
                      config_name=_config_name(server, lab, settings.config_name, inventory))
    _announce(on_event, spec, lab, servers)
    with _hooks(hooks, server, spec, lab) as run_hooks:
        result = run_on_lab(servers, lab, spec, _paths(dataset, servers), timeout_s=settings.timeout_s,
                            on_event=on_event, hooks=run_hooks)
    return LabRun(spec, result)


def smoke_value(run: LabRun, settings: SmokeSettings, dataset: RemoteDataset) -> SmokeRun:
    """What the ``smoke_run`` asset hands on for a smoke run that ran (the resume check's size from ``settings``).

    Raises:
        RunError: ``not_submitted``: nothing ran (the Slurm preflight refused).
    """
    size = ResumeCheckSize(epochs=settings.resume_check_epochs, steps=settings.resume_check_steps)
    return run.result.smoke_run(run.spec, dataset.host, size, dataset.local_path or None)


def train_on_lab(
    servers: Sequence[GpuServer],
    lab: LabServers,
    dataset: RemoteDataset,
    settings: TrainSettings,
    *,
    hooks: HooksFactory | RunHooks | None = None,
    detach: bool = False,
    judge_exit: bool = True,
    on_event: EventCallback | None = None,
    on_state: Callable | None = None,
) -> LabRun:
    """The training run of ``dataset`` (rule 8): launched on the one server (or re-attached to) and followed,
    submitted to Slurm and followed, or one run over every host, then judged (natural exit and, on a cluster or
    hosts, release). ``detach``: one server, return once launched; ``judge_exit`` False: one server, leave the
    natural-exit check to the caller (the ``train_run`` asset's blocking check).

    Raises:
        RunError: ``gpu_unavailable``, ``bad_config`` (``resume`` without ``run_name``, ``detach`` off one
            server); what :func:`~dpflow_core.runs.scale.run_on_lab` raises.
    """
    server = servers[0]
    if detach and lab.mode != "single":
        raise RunError(f"detach follows nothing on a {lab.mode} lab: only one server's run can be left running",
                       code="bad_config")
    if lab.mode == "single" and not settings.run_name:
        name, active = active_or_new_run_name(server, dataset.sha256, "train")
    else:
        name, active = settings.run_name or default_run_name(dataset.sha256, "train"), False
    if lab.mode == "single":
        inventory = server.gpu_inventory()
        if not active:
            require_gpus(server, inventory)
    else:
        inventory = _checked_inventory(server, lab, "train", settings.gpu_ids)
    # a re-attached run keeps the config it was launched with
    config_name = settings.config_name if active else _config_name(server, lab, settings.config_name, inventory)
    spec = RunSpec(
        name=name, kind="train", dataset_path=dataset.remote_path, frequency_hz=dataset.frequency_hz,
        dataset_sha256=dataset.sha256, config_name=config_name, epochs=settings.epochs,
        max_train_steps=settings.max_train_steps, batch_size=settings.batch_size, num_workers=settings.num_workers,
        num_processes=settings.num_processes, gpu_ids=settings.gpu_ids, train_command=settings.train_command,
        resume=settings.resume, logging_mode=settings.logging_mode, extra_overrides=settings.extra_overrides,
    )
    _announce(on_event, spec, lab, servers)
    single = dict(inventory=inventory, poll_s=settings.poll_s, stall_timeout_s=settings.stall_timeout_s, detach=detach,
                  judge_exit=judge_exit)
    with _hooks(hooks, server, spec, lab) as run_hooks:
        result = run_on_lab(servers, lab, spec, _paths(dataset, servers), timeout_s=settings.timeout_s,
                            on_event=on_event, on_state=on_state, hooks=run_hooks,
                            **(single if lab.mode == "single" else {}))
    return LabRun(spec, result)


@dataclass(frozen=True)
class AblationRun(StageResult):
    """A baseline policy trained beside the camera policy (the ``no_camera_run`` / ``no_camera_checkpoint``
    assets): ``name`` as the closed-loop judge reports it (``no_camera``), ``run_name`` on the server, the
    :class:`TrainSettings` it was launched with (``settings``, as :func:`dataclasses.asdict` gives them), and
    once downloaded its ``checkpoint_path`` and ``checkpoint_sha256``. ``skipped``: why it was not trained
    (empty when it was), e.g. a lab's recordings, which have no simulator to roll it out in."""

    name: str
    run_name: str = ""
    settings: dict = dataclasses.field(default_factory=dict)
    checkpoint_path: str = ""
    checkpoint_sha256: str = ""
    skipped: str = ""

    def train_settings(self) -> TrainSettings:
        """The settings it was launched with (raises RunError ``bad_config`` when they are not valid)."""
        return TrainSettings(**self.settings)


#: The Hydra override of the camera-less ablation: the same trainer config with no image key, so the policy
#: sees only the TCP pose and the gripper width (what the closed-loop judge rolls out beside the camera policy).
NO_CAMERA_OVERRIDES = ("task.rgb_keys=[]",)
#: Run-name kind of the ablation: ``no-camera-<sha256[:12]>-<UTC time>``. Its own prefix keeps it out of the
#: ``train-<sha256[:12]>-*`` runs an unnamed training re-attaches to.
NO_CAMERA_KIND = "no-camera"


def no_camera_on_lab(
    servers: Sequence[GpuServer],
    lab: LabServers,
    dataset: RemoteDataset,
    settings: TrainSettings,
    *,
    detach: bool,
    on_event: EventCallback | None = None,
) -> LabRun:
    """The training run of ``settings`` without the camera (:data:`NO_CAMERA_OVERRIDES` appended last), on one
    server: the ablation that shows a task needs the camera (the world's issue: a policy trained without it
    must stay at or below 30 % closed-loop success).

    Named ``settings.run_name``, else this dataset's running ``no-camera-<sha256[:12]>-*`` run (re-attached
    to), else a new such name. ``detach``: return once launched, so the policy's own training can run beside
    it (the main job launches it first, then follows it after the policy's run with ``detach=False``, which
    re-attaches by name, also to a run that has ended).

    Raises:
        RunError: ``bad_config`` off one server (a Slurm cluster or several hosts: launch it as a training
            run with the override yourself), or ``resume`` set; what :func:`train_on_lab` raises.
    """
    if lab.mode != "single":
        raise RunError(f"the no-camera ablation runs on one server, not a {lab.mode} lab: train it with "
                       f"--override {NO_CAMERA_OVERRIDES[0]}", code="bad_config")
    if settings.resume:
        raise RunError("the no-camera ablation is not resumed: it re-attaches to its run by name", code="bad_config")
    name = settings.run_name or active_or_new_run_name(servers[0], dataset.sha256, NO_CAMERA_KIND)[0]
    blind = dataclasses.replace(settings, run_name=name,
                                extra_overrides=tuple(settings.extra_overrides) + NO_CAMERA_OVERRIDES)
    return train_on_lab(servers, lab, dataset, blind, detach=detach, on_event=on_event)
