"""`dpflow validate`: the blocking checks of a converted dataset, from the command line.

The same checks, by the same function (:func:`dpflow_core.dataset.validate_dataset`), as the
``dataset_npz_checks`` Dagster multi-check, plus every member against the archive's own CRC-32
(:func:`dpflow_core.replay_buffer.integrity.check_archive`, no sidecar needed) and the file's SHA-256
against its ``dataset.json`` sidecar (:func:`dpflow_core.dataset.check_recorded_sha256`) when the
sidecar is there; without one, ``sha256_matches_sidecar`` is a warning that says the hash was not checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dpflow_core.cli import app


@app.command("validate")
def validate_cmd(
    dataset: Path = typer.Argument(..., help="The dataset.npz to check."),
    image_size: Optional[str] = typer.Option(None, "--image-size", help="Expected frame size W,H (default: the metadata's)."),
    min_train_length: Optional[int] = typer.Option(
        None, "--min-train-length",
        help="Shortest episode that yields a training sample (steps; default dpflow_core.dataset.MIN_TRAIN_LENGTH, 46).",
    ),
    max_short_episodes: int = typer.Option(0, "--max-short-episodes", help="Warn above this many short episodes."),
    as_json: bool = typer.Option(False, "--json", help="Print the verdicts as JSON."),
) -> None:
    """Check a dataset.npz; print each verdict; exit 1 when a blocking (error) check fails."""
    from dpflow_core.conversion.settings import image_size_of
    from dpflow_core.conversion import sidecar_path_for
    from dpflow_core.dataset import MIN_TRAIN_LENGTH, CheckResult, check_recorded_sha256, validate_dataset
    from dpflow_core.replay_buffer.integrity import check_archive

    if min_train_length is None:
        min_train_length = MIN_TRAIN_LENGTH
    size = image_size_of(image_size) if image_size else None
    results = validate_dataset(dataset, image_size=size, min_train_length=min_train_length,
                               max_short_episodes=max_short_episodes)
    archive = check_archive(dataset) if dataset.is_file() else None
    # The archive's own CRC-32s: a changed byte in any member is found with or without a sidecar. A file
    # that is no zip at all has failed every check above for that one reason already.
    if archive is not None and archive.error is None:
        results.append(CheckResult("archive_crc32", archive.ok, "error", archive.describe(),
                                   {"damaged": {d.member: d.reason for d in archive.damaged}, "error": archive.error}))
    sidecar = sidecar_path_for(dataset)
    if sidecar.exists():
        results.append(check_recorded_sha256(dataset, sidecar))
    elif archive is not None and archive.error is None:  # said, not skipped: nothing recorded to compare with
        results.append(CheckResult(
            "sha256_matches_sidecar", False, "warn",
            f"no {sidecar.name} beside the dataset: its SHA-256 was not checked against a recorded one; "
            "the archive's own CRC-32s were", {"path": str(dataset), "sidecar_path": str(sidecar)}))
    failed = [r for r in results if not r.passed and r.severity == "error"]
    if as_json:
        typer.echo(json.dumps({"path": str(dataset), "passed": not failed,
                               "checks": [{"name": r.name, "passed": r.passed, "severity": r.severity,
                                           "description": r.description} for r in results]}, indent=2))
    else:
        # checks that failed for one reason (a file that does not open fails every check) share one line
        lines: list[tuple[str, list[str], str]] = []
        for r in results:
            verdict = "PASS" if r.passed else ("FAIL" if r.severity == "error" else "WARN")
            if lines and lines[-1][0] == verdict and lines[-1][2] == r.description and not r.passed:
                lines[-1][1].append(r.name)
            else:
                lines.append((verdict, [r.name], r.description))
        for verdict, names, description in lines:
            typer.echo(f"{verdict}  {', '.join(names)}: {description}")
        typer.echo(f"{dataset}: " + ("all blocking checks passed" if not failed else
                                      f"{len(failed)} blocking check(s) failed: {', '.join(r.name for r in failed)}"))
    if failed:
        raise typer.Exit(1)
