"""`dpflow` commands of the platform stage."""

from __future__ import annotations

from pathlib import Path

import typer

from dpflow_core.cli import app, counted


@app.command("report")
def report(
    source: Path = typer.Argument(..., help="A pairing manifest (JSON, the paired_episodes output) or a "
                                  "Matrix Studio task folder (paired first; its manifest saved in OUT/manifests/)."),
    out: Path = typer.Option(..., "-o", "--out", help="Report folder: report.html, quality.json, previews/."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a report already in the folder."),
) -> None:
    """Episode quality report: duration, rates, VIO score, pose_valid gaps, previews, outliers."""
    from dpflow_core.pairing import manifest_file_for
    from dpflow_core.report import write_report

    manifest = manifest_file_for(source, out)
    result = write_report(manifest, out, overwrite=overwrite)
    for e in result.episodes:
        flag = f"  OUTLIER: {'; '.join(e.outlier_reasons)}" if e.is_outlier else ""
        typer.echo(
            f"{e.stem}: {e.duration_s:.2f} s, score median {e.score_median:.2f}, "
            f"{len(e.pose_gaps)} pose gaps ({e.pose_gap_total_s:.2f} s){flag}"
        )
    for r in result.unreadable:
        typer.echo(f"{r['stem']}: not measured: {r['code']}: {r['reason']}")
    typer.echo(f"{counted(len(result.episodes), 'episode')}, {counted(len(result.outliers), 'outlier')} -> {result.html_path}")
    if not result.episodes:
        from dpflow_core.pairing import read_manifest_json, reject_summary

        rejected = list(read_manifest_json(manifest).get("rejected") or []) + result.unreadable
        typer.secho(f"error: no episode to report on in {manifest}; reasons:\n{reject_summary(rejected)}",
                    fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
