"""The Dagster side of the run recipe: the ``smoke_run`` / ``train_run`` configs and their Dagster Pipes hooks.

:class:`SmokeRunConfig` and :class:`TrainRunConfig` spell the fields of
:class:`~dpflow_core.runs.settings.SmokeSettings` / :class:`~dpflow_core.runs.settings.TrainSettings`
(names from the settings' ``config`` metadata, defaults taken from the settings themselves, a test keeps
them complete) plus what only Dagster has (Pipes, observations); ``SmokeSettings.from_config(config)`` maps
one onto the settings. :class:`PipesHooks` opens the Pipes session of a run on one server for
:mod:`dpflow_core.runs.recipe`; :func:`scale_metadata` describes a run's checks.

This module holds no definitions of its own: :mod:`dpflow_dagster.defs.training` uses it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import dagster as dg
from pydantic import Field

from dpflow_core.runs import is_builtin_trainer, run_dir_for
from dpflow_core.runs.launch import attachable_handle
from dpflow_core.runs.scale import RunHooks, ScaleResult
from dpflow_core.runs.settings import SmokeSettings, TrainSettings, front_ends
from dpflow_dagster.pipes import LogTailReporter, PipesSshMessageReader, messages_path, reported_results

_TEMPLATE = "Train command template: {run_dir} {dataset} {overrides} {num_processes} {gpu_ids} {config_name}."


def _default(cls: type, name: str) -> Any:
    """The settings' default as the config holds it (its ``unset`` value for None, a list for a tuple)."""
    value = getattr(cls(), name)
    if value is None:
        return front_ends(cls)[name]["unset"]
    return list(value) if isinstance(value, tuple) else value


def _smoke(name: str) -> Any:
    return _default(SmokeSettings, name)


def _train(name: str) -> Any:
    return _default(TrainSettings, name)


class SmokeRunConfig(dg.Config):
    """Settings of the smoke run (rule 6): one GPU, few steps, small batch, no checkpoints."""

    run_name: str = Field(default=_smoke("run_name"), description="Run name; empty: smoke-<dataset sha256[:12]>-<UTC timestamp>.")
    config_name: str = Field(default=_smoke("config_name"), description="Trainer config; 'auto': train_diffusion_unet_image with GPUs, demo without.")
    epochs: int = Field(default=_smoke("epochs"), description="training.num_epochs of the smoke run.")
    max_train_steps: int = Field(default=_smoke("max_train_steps"), description="training.max_train_steps (batches per epoch; also caps validation).")
    batch_size: int = Field(default=_smoke("batch_size"), description="dataloader.batch_size per process (small).")
    num_workers: int = Field(default=_smoke("num_workers"), description="dataloader.num_workers (small).")
    gpu_ids: list[int] = Field(default_factory=lambda: _smoke("gpu_ids"), description="The GPU to use, at most one (empty: a free one from nvidia-smi now); refused when busy or absent, and on a Slurm cluster.")
    train_command: str = Field(default=_smoke("train_command"), description=_TEMPLATE)
    extra_overrides: list[str] = Field(default_factory=lambda: _smoke("extra_overrides"), description="Further Hydra overrides, appended last.")
    timeout_s: float = Field(default=_smoke("timeout_s"), description="Seconds before the smoke run is ended.")
    resume_check_epochs: int = Field(default=_smoke("resume_check_epochs"), description="Epochs of the resume-continuity check's runs (>= 2).")
    resume_check_steps: int = Field(default=_smoke("resume_check_steps"), description="Batches per epoch of the resume-continuity check's runs.")
    pipes: bool = Field(default=True, description="The built-in trainer reports each step through Dagster Pipes; off: logs.json.txt only.")


class TrainRunConfig(dg.Config):
    """Settings of the training run (rule 8). 0 / -1 / empty keep the trainer config's value."""

    run_name: str = Field(
        default=_train("run_name"),
        description="Run name; empty: attach to the running train-<dataset sha256[:12]>-* run, else a new one "
        "named with the UTC timestamp.",
    )
    config_name: str = Field(default=_train("config_name"), description="Trainer config; 'auto': train_diffusion_unet_image with GPUs, demo without.")
    epochs: int = Field(default=_train("epochs"), description="training.num_epochs; 0: the config's.")
    max_train_steps: int = Field(default=_train("max_train_steps"), description="training.max_train_steps (batches per epoch); 0: the config's.")
    batch_size: int = Field(default=_train("batch_size"), description="dataloader.batch_size per process; 0: the config's.")
    num_workers: int = Field(default=_train("num_workers"), description="dataloader.num_workers; -1: the config's.")
    num_processes: int = Field(default=_train("num_processes"), description="Processes/GPUs: 0 = one per free GPU (1 on CPU).")
    gpu_ids: list[int] = Field(default_factory=lambda: _train("gpu_ids"), description="GPUs to use, e.g. [0, 1] (empty: free ones from nvidia-smi now); busy or absent ones are refused, and any on a Slurm cluster.")
    train_command: str = Field(default=_train("train_command"), description=_TEMPLATE)
    resume: bool = Field(default=_train("resume"), description="Continue run_name from its latest.ckpt (verified complete first).")
    logging_mode: str = Field(default=_train("logging_mode"), description="logging.mode: offline | online | disabled.")
    extra_overrides: list[str] = Field(default_factory=lambda: _train("extra_overrides"), description="Further Hydra overrides, appended last.")
    poll_s: float = Field(default=_train("poll_s"), description="Seconds between polls of logs.json.txt.")
    stall_timeout_s: float = Field(default=_train("stall_timeout_s"), description="Seconds without a new log line after the first step that count as a stall.")
    monitor_timeout_s: float = Field(default=_train("timeout_s"), description="Stop following after this many seconds (0: until the run ends; 86400 on a cluster or hosts, where the run is then ended); re-materialize to re-attach.")
    observation_every_s: float = Field(default=60.0, description="Seconds between progress observations (GPU memory, disk) in the asset's history.")
    pipes: bool = Field(default=True, description="The built-in trainer reports through Dagster Pipes (log lines, step reports, checkpoints, the final materialization); off: logs.json.txt only.")
    report_every_n_steps: int = Field(default=10, description="Global steps between step reports (loss, lr, steps/s, ETA) in the run's event log.")


class PipesHooks:
    """The hooks factory of :mod:`dpflow_core.runs.recipe` for a run on one server: a Dagster Pipes session when the
    built-in trainer runs it (``enabled``; a training run re-attached to reads ``logs.json.txt`` instead, through a
    :class:`LogTailReporter` when ``train``); ``on_launch`` / ``on_progress`` are passed on.

    After the run: ``reader`` (None without Pipes for a smoke run), ``session`` (None without Pipes) and, for
    ``train``, ``reported`` and ``in_run_check``: what the trainer reported (:func:`reported_results`).
    """

    def __init__(self, context: dg.AssetExecutionContext, enabled: bool, report_every_n_steps: int, *,
                 train: bool = False, on_launch: Callable | None = None, on_progress: Callable | None = None):
        self.context, self.enabled, self.every, self.train = context, enabled, report_every_n_steps, train
        self.on_launch, self.on_progress = on_launch, on_progress
        self.reader: Any = None
        self.session: dg.PipesSession | None = None
        self.reported: dg.MaterializeResult | None = None
        self.in_run_check: dg.AssetCheckResult | None = None

    def _hooks(self, **kw: Any) -> RunHooks:
        return RunHooks(on_poll=self.reader.poll if self.reader is not None else None, on_launch=self.on_launch,
                        on_progress=self.on_progress, **kw)

    @contextlib.contextmanager
    def __call__(self, server, spec) -> Iterator[RunHooks]:
        use = self.enabled and is_builtin_trainer(spec.train_command)
        if use and self.train:
            use = attachable_handle(server, spec) is None
        if not use:
            if self.train:
                self.reader = LogTailReporter(self.context, spec.name, self.every)
            yield self._hooks()
            return
        self.reader = PipesSshMessageReader(self.context, server, messages_path(run_dir_for(server, spec.name)), spec.name)
        with dg.open_pipes_session(self.context, dg.PipesEnvContextInjector(), self.reader,
                                   extras={"report_every_n_steps": self.every}) as session:
            self.session = session
            yield self._hooks(extra_env=dict(session.get_bootstrap_env_vars()))
            if self.train:
                self.reported, self.in_run_check = reported_results(session)


def numbers(**values: Any) -> dict[str, Any]:
    """The values that are numbers (int or float, so the UI plots them across materializations)."""
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def lines(items) -> str:
    """A markdown list of ``items`` (``none`` when empty)."""
    return "\n".join(f"- {i}" for i in items) or "none"


def scale_metadata(result: ScaleResult) -> dict[str, Any]:
    """Metadata of a run on a Slurm cluster or several hosts: the job id and state, each check, the problems."""
    table = "| check | passed | detail |\n|---|---|---|\n" + "\n".join(
        f"| {name} | {'yes' if ok else 'no'} | {detail.replace('|', '/')} |" for name, ok, detail in result.checks)
    metadata: dict[str, Any] = {
        "scheduler": result.mode, "run_name": result.run_name, "checks": dg.MetadataValue.md(table),
        "problems": "; ".join(result.problems) or "none", "passed": result.passed,
    }
    if result.run_dir:
        metadata["path"] = dg.MetadataValue.path(result.run_dir)
    if result.mode == "slurm" and result.job is not None:
        metadata.update({
            "slurm_job_id": result.job_id, "slurm_state": result.state or "unknown", "slurm_exit_code": result.exit_code or "",
            "slurm_nodes": result.job.nodes, "slurm_output": dg.MetadataValue.path(result.job.output_path),
            "slurm_script": dg.MetadataValue.path(result.job.script_path), "release": result.release or "",
        })
    for key, value in result.hosts.items():
        metadata[f"hosts/{key}"] = ", ".join(map(str, value))
    metadata.update(numbers(epoch=result.epoch, global_step=result.global_step))
    if result.oom_advice:
        metadata["oom_advice"] = dg.MetadataValue.md(lines(result.oom_advice))
    return metadata
