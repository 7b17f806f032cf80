"""The main job: recordings to an evaluated checkpoint, materialised through Dagster.

``dpflow demo`` (and ``scripts/demo.sh``) runs the ``dpflow_pipeline`` job of
:mod:`dpflow_dagster.definitions` on the instance in ``$DAGSTER_HOME`` (the
project's ``dagster_home/`` by default, SQLite), so ``dagster dev -w
workspace.yaml`` shows the same runs, materialisations and lineage afterwards.
It runs one task partition: the task folder's name, added to the instance's
``task`` partitions when missing; the folder holding the task folder is the
recordings root (``$DPFLOW_RECORDINGS_ROOT``).

Without options it writes sample Matrix Studio recordings and trains on the CPU
of this machine (the local GPU-server transport). A YAML file given with
``--config`` points it at a real task folder and a real server::

    recordings: /data/matrix_studio/output/pick_cup   # a Matrix Studio task folder (the partition)
    out: /data/dpflow                                 # datasets, manifests, runs
    server:                                           # omit for the local machine
      host: gpu01.lab.example
      port: 22
      user: alice
      key_file: ~/.ssh/id_ed25519
      known_hosts: ~/.ssh/known_hosts
      repo_path: ~/dpflow
      python: ~/miniconda3/envs/dpflow/bin/python
      data_root: /data/dpflow
    assets:                                           # per-asset launchpad config
      dataset_npz: {image_width: 224, image_height: 224}
      train_run: {num_processes: 4, epochs: 100}

A ``server:`` section for a Slurm cluster (``scheduler: slurm`` and ``slurm:``) or for several
servers (``hosts:``), as the README's "Scaling out" shows, runs the same job there: the
definitions take the ``gpu_server`` resource from that file (``DPFLOW_LAB``).
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import typer
import yaml
from rich.console import Console

from dpflow_core.cli import posix_usage
from dpflow_core.errors import InvalidNameError, RemoteError
from dpflow_core.names import validate_name
from dpflow_core.server.lab import SCALE_KEYS, lab_servers

REPO = Path(__file__).resolve().parents[1]
# soft_wrap: paths are printed whole, also when the output goes to a file or a CI log
console = Console(highlight=False, soft_wrap=True)

#: Settings of the demo on the embedded default: small images and a short CPU training.
#: The main job trains the world's camera policy (the ``sim`` trainer config, 64x64 wrist camera) and judges it
#: closed loop on 200 held-out initial states (rollout_evaluation / closed_loop_success).
DEMO_ASSET_CONFIG: dict[str, dict[str, Any]] = {
    "dataset_npz": {"image_width": 64, "image_height": 64},
}
#: Added for a task recorded in the world (the default, or a --recordings folder holding sim_task.json); a lab's
#: recordings keep the trainer's `auto` config (the `demo` config on a CPU).
WORLD_ASSET_CONFIG: dict[str, dict[str, Any]] = {
    "smoke_run": {"config_name": "sim"},
    "train_run": {"config_name": "sim"},
    "rollout_evaluation": {"episodes": 200},
}
#: Added after WORLD_ASSET_CONFIG for one world task. ``stack`` executes 4 actions of each predicted chunk before
#: deciding again, not the ``sim`` config's 8 (a decision every 0.3 s, not 0.7 s): it places within 12 mm, and that took the
#: same checkpoint from 59.5 % to 69.5 % on the same 200 held-out states (65.5-74.5 % on two more blocks), while
#: ``pick_place`` fell from 96.5 % to 84.5 % with 4 (docs/benchmarks.md, "actions executed per decision"). It is a
#: training override so that the checkpoint carries it: rollouts, ``dpflow serve`` and a robot read it from there.
WORLD_TASK_ASSET_CONFIG: dict[str, dict[str, dict[str, Any]]] = {
    "stack": {"train_run": {"extra_overrides": ["n_action_steps=4"]}},
}
#: Demonstrations the main job records in the world when no --recordings is given.
WORLD_EPISODES = 120

_SERVER_ENV = {
    "host": "DPFLOW_SERVER_HOST",
    "port": "DPFLOW_SERVER_PORT",
    "user": "DPFLOW_SERVER_USER",
    "key_file": "DPFLOW_SERVER_KEY",
    "known_hosts": "DPFLOW_KNOWN_HOSTS",
    "data_root": "DPFLOW_SERVER_ROOT",
    "repo_path": "DPFLOW_SERVER_REPO",
    "python": "DPFLOW_SERVER_PYTHON",
    "activate": "DPFLOW_SERVER_ACTIVATE",
    "nvidia_smi": "DPFLOW_SERVER_NVIDIA_SMI",
    "expect_gpu": "DPFLOW_SERVER_EXPECT_GPU",
}


#: The keys of a lab.yaml (``--config``) at the top level.
LAB_KEYS = ("recordings", "out", "server", "assets")


def _refuse(config: Optional[Path], key: object, where: str, valid) -> typer.BadParameter:
    return typer.BadParameter(
        f"{config}: unknown key {key!r}{where}; valid keys: {', '.join(sorted(valid))}"
    )


def check_lab_settings(settings: dict, config: Optional[Path]) -> None:
    """Refuse unknown top-level and ``server:`` keys of a lab.yaml, naming the key, the file and the valid keys.

    A ``server:`` section with the keys of a Slurm cluster or several servers (``scheduler``, ``slurm``,
    ``hosts``, ...) is checked whole by :func:`dpflow_core.server.lab.lab_servers`, as ``dpflow scale`` does.

    Raises:
        typer.BadParameter: an unknown key or value, or ``server``/``assets`` not a mapping.
    """
    for key in settings:
        if key not in LAB_KEYS:
            raise _refuse(config, key, " at the top level", LAB_KEYS)
    for section in ("server", "assets"):
        if settings.get(section) is not None and not isinstance(settings[section], dict):
            raise typer.BadParameter(f"{config}: {section!r} must be a mapping, got {settings[section]!r}")
    server = settings.get("server") or {}
    if is_scaled(settings):
        try:
            lab_servers(server, config or "lab.yaml")
        except RemoteError as exc:
            raise typer.BadParameter(str(exc)) from None
        return
    for key in server:
        if key not in _SERVER_ENV:
            raise _refuse(config, key, " under 'server'", set(_SERVER_ENV) | set(SCALE_KEYS))


def is_scaled(settings: dict) -> bool:
    """True when a lab.yaml's ``server:`` names a Slurm cluster or several servers (any of its scale keys)."""
    return any(key in SCALE_KEYS for key in settings.get("server") or {})


def check_asset_settings(assets: dict, config: Optional[Path], job) -> None:
    """Refuse ``assets:`` entries that name no configurable step of ``job`` or a field its config lacks.

    The valid names and fields come from the job's op config schemas (the launchpad's config).

    Raises:
        typer.BadParameter: naming the key, the file and the valid keys.
    """
    fields_by_step = {}
    for name, node in job.graph.node_dict.items():
        schema = node.definition.config_schema
        fields = getattr(schema.as_field().config_type, "fields", None) if schema is not None else None
        if fields:
            fields_by_step[name] = set(fields)
    for name, values in assets.items():
        if name not in fields_by_step:
            raise _refuse(config, name, " under 'assets'", fields_by_step)
        if values is not None and not isinstance(values, dict):
            raise typer.BadParameter(f"{config}: assets.{name} must be a mapping, got {values!r}")
        for field in values or {}:
            if field not in fields_by_step[name]:
                raise _refuse(config, field, f" under 'assets: {name}'", fields_by_step[name])


def check_run_config(job, run_config: dict, config: Optional[Path]) -> None:
    """Refuse asset settings of the wrong type or value (e.g. ``max_train_steps: three``) before any work.

    Uses Dagster's own validation of the job's run config (:func:`dagster.validate_run_config`).

    Raises:
        typer.BadParameter: naming the file and each setting Dagster rejected, with its reason.
    """
    import dagster as dg
    from dagster._core.errors import DagsterInvalidConfigError

    try:
        dg.validate_run_config(job, run_config)
    except DagsterInvalidConfigError as exc:
        reasons = "; ".join(e.message for e in exc.errors) or str(exc)
        raise typer.BadParameter(f"{config or 'the demo settings'}: invalid asset settings: {reasons}") from None
    # values the types allow but the judge's settings refuse (episodes 0, n_action_steps 0) would fail only after
    # the training: they are refused now, by the same ClosedLoopSettings the rollout_evaluation asset builds
    from dpflow_dagster.defs.rollouts import RolloutEvaluationConfig

    values = ((run_config.get("ops") or {}).get("rollout_evaluation") or {}).get("config") or {}
    try:
        RolloutEvaluationConfig(**values).settings()
    except ValueError as exc:
        raise typer.BadParameter(f"{config or 'the demo settings'}: invalid asset settings: rollout_evaluation: "
                                 f"{exc}") from None


def _merge(base: dict, extra: dict) -> dict:
    """Per asset, ``extra``'s fields over ``base``'s; Hydra ``extra_overrides`` are joined, ``extra``'s last (so
    they win), so that a lab.yaml's own overrides keep a world task's."""
    out = {k: dict(v) for k, v in base.items()}
    for key, values in (extra or {}).items():
        values = dict(values or {})
        joined = [*out.get(key, {}).get("extra_overrides", []), *values.pop("extra_overrides", [])]
        out.setdefault(key, {}).update(values)
        if joined:
            out[key]["extra_overrides"] = joined
    return out


def demo_asset_config(recordings: Optional[Path], assets: dict) -> dict[str, dict[str, Any]]:
    """The demo's config per asset: :data:`DEMO_ASSET_CONFIG`, then for a task recorded in the world (no
    ``recordings``: the main job's ``pick_place``; else a folder holding ``sim_task.json``) :data:`WORLD_ASSET_CONFIG`
    and that task's :data:`WORLD_TASK_ASSET_CONFIG`, then the lab.yaml's ``assets`` (each key replaces the
    defaults', except ``extra_overrides``, which are appended: a later Hydra override wins). The no-camera
    ablation (``no_camera_run``) trains as ``train_run`` does, its own entry merged in the same way.

    Raises:
        ValueError: the folder's ``sim_task.json`` is not the world's (names the file).
    """
    from dpflow_core.sim.record import read_sim_task

    meta = {"task": "pick_place"} if recordings is None else read_sim_task(Path(recordings).expanduser())
    config = DEMO_ASSET_CONFIG
    if meta is not None:
        config = _merge(_merge(config, WORLD_ASSET_CONFIG), WORLD_TASK_ASSET_CONFIG.get(meta["task"], {}))
    config = _merge(config, assets)
    same_training = {k: v for k, v in config.get("train_run", {}).items() if k not in ("run_name", "resume")}
    config["no_camera_run"] = _merge({"no_camera_run": same_training}, {"no_camera_run": config.get("no_camera_run", {})})[
        "no_camera_run"]
    return config


#: Log lines of the filesystem IO manager, hidden from the progress display.
_IO_MESSAGES = ("Loading file from", "Writing file at", "Loading partition", "Writing partition", "Loading 1 partitions")


def _follow(instance, run_id: str, stop: threading.Event) -> None:
    """Print the run's step starts, materialisations, check results and log lines as they happen."""
    from dagster import AssetCheckSeverity, DagsterEventType

    cursor = 0
    t0 = time.monotonic()
    while True:
        done = stop.is_set()
        for record in instance.all_logs(run_id)[cursor:]:
            cursor += 1
            event = record.dagster_event
            stamp = f"[{time.monotonic() - t0:6.1f}s]"
            step = record.step_key or ""
            if event is None:
                if step and record.user_message and not record.user_message.startswith(_IO_MESSAGES):
                    console.print(f"{stamp} [dim]{step}[/dim] {record.user_message}")
                continue
            kind = event.event_type
            if kind == DagsterEventType.STEP_START:
                console.print(f"{stamp} [bold cyan]{step}[/bold cyan] started")
            elif kind == DagsterEventType.ASSET_MATERIALIZATION:
                console.print(f"{stamp} [green]materialized[/green] {event.asset_key.to_user_string()}")
            elif kind == DagsterEventType.ASSET_CHECK_EVALUATION:
                ev = event.event_specific_data
                verdict = "[green]passed[/green]" if ev.passed else (
                    "[yellow]WARN[/yellow]" if ev.severity == AssetCheckSeverity.WARN else "[red]FAILED[/red]")
                if not ev.passed and ev.description:
                    verdict += f": {ev.description}"
                console.print(f"{stamp} check {ev.asset_key.to_user_string()}:{ev.check_name} {verdict}")
            elif kind == DagsterEventType.STEP_FAILURE:
                console.print(f"{stamp} [red]{step} failed[/red]: {failure_reason(event)}")
        if done:
            return
        stop.wait(0.5)


def failure_reason(event) -> str:
    """The dpflow reason of a ``STEP_FAILURE`` event: the ``dg.Failure`` description, else the innermost
    error's first line (``KeyError: 'path'``), never a stack trace."""
    data = event.step_failure_data
    if data.user_failure_data is not None and data.user_failure_data.description:
        return data.user_failure_data.description
    error = data.error
    while error is not None and error.cause is not None:
        error = error.cause
    if error is None:
        return "failed (no error recorded)"
    return error.message.strip().replace("\n", "; ")


#: A step failure caused by failed blocking checks: dpflow's (:func:`~dpflow_dagster.partitions.fail_blocking_checks`)
#: or Dagster's own wording.
BLOCKING_FAILURE = re.compile(r"failed: (blocking check \S+ failed|\d+ blocking asset checks? failed)")


def failure_summary(result, steps_in_job: set[str]) -> tuple[list[str], list[str]]:
    """(failures, warnings). Failures: one line per failed ERROR-severity check (with its task and
    description), per failed step (its reason) and one naming the steps of ``steps_in_job`` that did
    not start; empty when nothing failed. Warnings: one line per failed WARN-severity check."""
    import dagster as dg

    steps, checks, warnings, started = [], [], [], set()
    for event in result.all_events:
        kind = event.event_type_value
        if kind == "STEP_FAILURE":
            steps.append(f"step {event.step_key} failed: {failure_reason(event)}")
        elif kind == "ASSET_CHECK_EVALUATION" and not event.asset_check_evaluation_data.passed:
            ev = event.asset_check_evaluation_data
            task = f" (task {ev.partition})" if ev.partition else ""
            name = f"check {ev.asset_key.to_user_string()}:{ev.check_name}{task}"
            if ev.severity == dg.AssetCheckSeverity.WARN:  # e.g. "CPU run: GPU release not checked": said, not failed
                warnings.append(f"{name} warns: {ev.description or 'no description'}")
            else:
                line = f"{name} failed: {ev.description or 'no description'}"
                if ev.check_name in ("beats_baseline", "closed_loop_success"):
                    line += ("; the policy did not learn enough to be trusted: train longer (lab.yaml "
                             "`assets: train_run: {epochs: N}`) or record more episodes")
                checks.append(line)
        elif kind == "STEP_START":
            started.add(event.step_key)
    # a step that failed because its blocking checks did is named by those checks' lines already
    lines = checks + [line for line in steps if not (checks and BLOCKING_FAILURE.search(line))]
    not_run = sorted(steps_in_job - started)
    if lines and not_run:
        lines.append(f"not run (an upstream step or blocking check failed): {', '.join(not_run)}")
    return lines, warnings


#: What the summary shows for each asset: (label, key of the ``to_dict()`` of the asset's value).
_SUMMARY = {
    "paired_episodes": [("manifest", "manifest_path"), ("accepted episodes", "accepted"), ("rejected", "rejected")],
    "dataset_npz": [("dataset", "path"), ("SHA-256", "sha256"), ("frequency (Hz)", "frequency_hz"), ("norm stats", "norm_stats_path")],
    "remote_dataset": [("on the server", "remote_path")],
    "smoke_run": [("smoke run directory", "run_dir")],
    "train_run": [("run directory", "run_dir"), ("global_step", "global_step")],
    "checkpoint": [("checkpoint", "local_path"), ("reproducibility record", "record_path")],
    "evaluation": [("beats every baseline", "beats_baseline"), ("policy MSE (not gated)", "policy_mse"),
                   ("plots", "trajectory_plot"), ("errors per step", "error_plot"), ("loss curve", "loss_plot")],
    "no_camera_checkpoint": [("no-camera ablation", "checkpoint_path"), ("no-camera ablation skipped", "skipped")],
    "rollout_evaluation": [("rollouts", "out_dir"), ("film", "video"), ("contact sheet", "contact_sheet")],
    "lerobot_dataset": [("LeRobot dataset", "path")],
    "norm_stats": [("openpi norm stats", "path")],
}


def _print_outputs(result, ops: set[str]) -> None:
    """Where each asset's products are, from the values the assets returned."""
    for name, fields in _SUMMARY.items():
        if name not in ops:
            continue
        try:
            value = result.output_for_node(name)
        except Exception:  # the step failed or did not run: its failure was printed above
            continue
        values = value.to_dict()
        if name == "rollout_evaluation":
            if not values["simulated"]:
                console.print(f"  {name:16s} no simulator for this task (the offline gate judges it)")
                continue
            console.print(f"  {name:16s} closed loop on {values['episodes']} held-out initial states:")
            for line in value.table().splitlines():
                console.print(f"    {line}")
        for label, key in fields:
            if values.get(key) not in (None, ""):
                console.print(f"  {name:16s} {label}: {values[key]}")


def run_demo(
    recordings: Optional[Path],
    out: Path,
    episodes: int,
    seed: int,
    config: Optional[Path],
) -> int:
    """Run the ``dpflow_pipeline`` job; return 0 when every step and blocking check passed."""
    try:
        settings = yaml.safe_load(config.read_text()) if config else {}
    except yaml.YAMLError as exc:  # a missing brace, a tab: the file and YAML's own line and column
        raise typer.BadParameter(f"{config}: not valid YAML: {exc}") from None
    if settings and not isinstance(settings, dict):
        raise typer.BadParameter(f"{config}: expected a mapping at the top level")
    settings = settings or {}
    check_lab_settings(settings, config)
    out = Path(settings.get("out", out)).expanduser().resolve()
    recordings = recordings or (Path(settings["recordings"]).expanduser() if settings.get("recordings") else None)
    if is_scaled(settings):
        # the whole server section is the gpu_server resource (dpflow_dagster.resources.gpu_server_from_lab_file)
        os.environ["DPFLOW_LAB"] = str(Path(config).resolve())
    for key, value in () if is_scaled(settings) else (settings.get("server") or {}).items():
        if key == "expect_gpu" and not isinstance(value, bool):
            raise typer.BadParameter(f"{config}: server.expect_gpu must be true or false, got {value!r}")
        os.environ[_SERVER_ENV[key]] = (
            str(Path(value).expanduser()) if key in ("key_file", "known_hosts") else str(value).lower() if key == "expect_gpu"
            else str(value)
        )
    # the definitions read these when imported; the asset settings are checked against them before any work
    os.environ["DPFLOW_WORKDIR"] = str(out)
    os.environ.setdefault("DPFLOW_SERVER_ROOT", str(out / "server"))
    os.environ.setdefault("DAGSTER_HOME", str(REPO / "dagster_home"))
    os.environ.setdefault("WANDB_MODE", "offline")

    from dpflow_dagster.definitions import defs

    job = defs.resolve_job_def("dpflow_pipeline")
    check_asset_settings(settings.get("assets") or {}, config, job)
    try:
        asset_config = demo_asset_config(recordings, settings.get("assets") or {})
    except ValueError as exc:  # a sim_task.json that is not the world's
        raise typer.BadParameter(str(exc)) from None
    ops = {node.name for node in job.graph.node_defs} | set(job.graph.node_dict)
    run_config = {
        "ops": {name: {"config": values} for name, values in asset_config.items() if name in ops},
        # the follower prints progress and failures (their reasons, without stack traces)
        "loggers": {"console": {"config": {"log_level": "CRITICAL"}}},
    }
    check_run_config(job, run_config, config)

    if recordings is not None and not Path(recordings).expanduser().is_dir():
        # refused before anything is written: a mistyped path leaves no output folder behind
        raise typer.BadParameter(f"{Path(recordings).expanduser().resolve()}: no such folder (expected a Matrix Studio task folder)")
    out.mkdir(parents=True, exist_ok=True)
    if recordings is None:
        from dpflow_core.sim.record import record_task

        recordings = out / "recordings" / "pick_place"
        if not any(recordings.glob("*_vio.mcap")):
            n = episodes or WORLD_EPISODES
            console.print(f"recording {n} scripted demonstrations of pick_place in the simulated world to {recordings}")
            record_task(recordings.parent, "pick_place", n, seed=seed)
        else:
            console.print(f"using the recordings already in {recordings}")
    recordings = Path(recordings).expanduser().resolve()
    from dpflow_core.pairing.tasks import holds_recordings, task_folders

    if not recordings.is_dir():
        raise typer.BadParameter(f"{recordings}: no such folder (expected a Matrix Studio task folder)")
    if not holds_recordings(recordings):
        found = sorted(task_folders(recordings)) if recordings.is_dir() else []
        raise typer.BadParameter(
            f"{recordings}: not a Matrix Studio task folder (no <STEM>.mcap files)"
            + (f"; give one of its task folders: {', '.join(found[:20])}" if found else "")
        )
    try:
        task = validate_name(recordings.name, "task")
    except InvalidNameError as exc:
        raise typer.BadParameter(f"{recordings}: the task folder's name is the partition key: {exc.reason}") from exc
    # the output root holds the task folders; the task folder's name is the partition
    os.environ["DPFLOW_RECORDINGS_ROOT"] = str(recordings.parent)
    Path(os.environ["DAGSTER_HOME"]).mkdir(parents=True, exist_ok=True)

    import dagster as dg

    from dpflow_dagster.partitions import task_partitions

    instance = dg.DagsterInstance.get()
    if not instance.has_dynamic_partition(task_partitions.name, task):
        instance.add_dynamic_partitions(task_partitions.name, [task])
    run_id = str(uuid.uuid4())
    console.print(f"Dagster instance: {os.environ['DAGSTER_HOME']} (run {run_id}, task partition {task!r})")
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(instance, run_id, stop), daemon=True)
    follower.start()
    try:
        result = job.execute_in_process(
            run_config=run_config, instance=instance, run_id=run_id, partition_key=task, raise_on_error=False
        )
    finally:
        stop.set()
        follower.join(timeout=10)

    failures, warnings = failure_summary(result, set(job.graph.node_dict))
    console.print()
    _print_outputs(result, ops)
    console.print(f"Dagster instance: {os.environ['DAGSTER_HOME']}")
    lab = f"DPFLOW_LAB={os.environ['DPFLOW_LAB']} " if is_scaled(settings) else ""
    console.print(
        f"Open the UI:  DAGSTER_HOME={os.environ['DAGSTER_HOME']} DPFLOW_WORKDIR={os.environ['DPFLOW_WORKDIR']} {lab}"
        f"DPFLOW_RECORDINGS_ROOT={os.environ['DPFLOW_RECORDINGS_ROOT']} .venv/bin/dg dev  "
        "(then http://127.0.0.1:3000; the same variables let the UI re-materialise this task)"
    )
    for line in warnings:
        console.print(f"[yellow]  {line}[/yellow]")
    if not result.success or failures:
        console.print(f"[red]dpflow demo failed[/red] (task {task!r}):")
        for line in failures or ["the run failed without a failed step or check (see the run in the UI)"]:
            console.print(f"  {line}")
        return 1
    if warnings:
        console.print(f"[green]dpflow demo: every step and blocking check passed[/green] ({len(warnings)} warning(s) above)")
    else:
        console.print("[green]dpflow demo: every step and check passed[/green]")
    return 0


cli = posix_usage(typer.Typer(add_completion=False, pretty_exceptions_enable=False))


@cli.command()
def main(
    recordings: Optional[Path] = typer.Option(
        None, help="A Matrix Studio task folder (its name is the task partition); default: sample recordings are written."
    ),
    out: Path = typer.Option(
        Path("outputs"), help="Folder for recordings, manifests, datasets and runs (the Dagster UI's default work folder)."
    ),
    episodes: int = typer.Option(0, help="Demonstrations to record in the world when --recordings is not given (0: 120)."),
    seed: int = typer.Option(0, help="Seed of the sample recordings."),
    config: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help="YAML: recordings, out, server, assets."),
) -> None:
    """Recordings -> dataset -> GPU server -> smoke run -> training -> checkpoint -> evaluation, through Dagster."""
    raise typer.Exit(run_demo(recordings, out, episodes, seed, config))


if __name__ == "__main__":
    cli(prog_name="dpflow demo")
