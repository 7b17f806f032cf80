"""`dpflow rollout`: a checkpoint judged in the simulated world, closed loop, against the baselines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dpflow_core.cli import app, counted
from dpflow_core.cli.options import settings_options
from dpflow_core.sim.settings import ClosedLoopSettings


def _trained_task(checkpoint: Path) -> str | None:
    """The task of the dataset a checkpoint was trained on (its sidecar's ``task``), when that is known here."""
    from dpflow_core.dataset import dataset_task
    from dpflow_core.errors import DpflowError
    from dpflow_core.train.checkpoint import load_checkpoint

    try:
        return dataset_task((load_checkpoint(checkpoint, require_complete=False).get("dataset") or {}).get("path"))
    except (DpflowError, OSError, ValueError):
        return None  # an unreadable checkpoint is reported by the rollout itself


@app.command("rollout")
@settings_options(ClosedLoopSettings)
def rollout_cmd(
    checkpoint: Optional[Path] = typer.Argument(None, help="A checkpoint trained on a world task (omit with --server)."),
    task: str = typer.Option(..., "--task", help="The world task: pick_place or stack."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Results folder (default: <checkpoint folder>/rollouts)."),
    server: Optional[str] = typer.Option(None, "--server", help="ws://HOST:PORT of `dpflow serve`: roll out through it."),
    recordings: Optional[Path] = typer.Option(None, "--recordings", help="The task folder it was trained on: its seeds are checked disjoint."),
    baseline_checkpoint: list[str] = typer.Option(
        [], "--baseline-checkpoint", metavar="NAME=PATH",
        help="Another checkpoint rolled out as a baseline on the same states (repeatable), e.g. no_camera=blind.ckpt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace earlier results in the output folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    settings: ClosedLoopSettings = None,
) -> None:
    """Closed-loop success on held-out initial states, with Wilson intervals, beside the oracle, replay and hold;
    exit status 1 unless it reaches --target and beats every non-oracle baseline by --margin."""
    from dpflow_core.sim.evaluate import evaluate_closed_loop
    from dpflow_core.sim.record import read_sim_task

    if (checkpoint is None) == (server is None):
        raise typer.BadParameter("give a CHECKPOINT or --server ws://HOST:PORT (one of them)")
    if checkpoint is not None:
        policy = checkpoint
        out = output or checkpoint.resolve().parent / "rollouts"
    else:
        from dpflow_core.serving.client import RemotePolicy

        policy = RemotePolicy(server)
        out = output or Path("rollouts")
    train_seeds = None
    if recordings is not None:
        if not recordings.is_dir():
            raise typer.BadParameter(f"{recordings}: no such folder (expected the task folder it was trained on)")
        meta = read_sim_task(recordings)
        if meta is None:
            raise typer.BadParameter(f"{recordings}: no sim_task.json (not recorded in the world)")
        if meta["task"] != task:
            raise typer.BadParameter(f"{recordings} holds {meta['task']!r} demonstrations, not --task {task!r}")
        train_seeds = [int(e["seed"]) for e in meta["episodes"]]
    trained_on = _trained_task(checkpoint) if checkpoint is not None else policy.metadata.get("task")
    if trained_on is not None and trained_on != task:
        raise typer.BadParameter(f"{checkpoint or server} was trained on task {trained_on!r} (its dataset's metadata"
                                 f"{', as the server says' if checkpoint is None else ''}), not --task {task!r}")
    others = {}
    for item in baseline_checkpoint:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise typer.BadParameter(f"--baseline-checkpoint {item!r}: expected NAME=PATH of an existing checkpoint file")
        if name in others:
            raise typer.BadParameter(f"--baseline-checkpoint {item!r}: the name {name!r} is given twice")
        others[name] = Path(path)
    try:
        result = evaluate_closed_loop(policy, task, out, settings, training_seeds=train_seeds, overwrite=overwrite,
                                      baseline_policies=others)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(f"{result.task}: {counted(result.episodes, 'held-out state')}, "
                   f"{counted(result.n_action_steps, 'action')} executed per decision")
        typer.echo(result.table())
        typer.echo(f"results: {result.out_dir}" + (f"; film: {result.video}, {result.contact_sheet}" if result.video else ""))
        typer.echo("closed_loop_success: " + ("PASS" if result.passed else f"FAIL ({result.reason})"))
    raise typer.Exit(0 if result.passed else 1)
