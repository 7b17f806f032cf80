"""Benchmark: the npz conversion and the LeRobot v3.0 and v2.1 exports of the same episodes, side by side.

Writes (once) a Matrix Studio task folder of sample recordings, pairs it, then in one run, each
step in its own fresh process (so every step pays its own imports and its peak RSS is its own):

* ``convert`` to ``dataset.npz``;
* ``export_lerobot`` with ``codebase_version="v3.0"`` and ``"v2.1"`` (same alignment, same video
  encoding; only the layout differs);
* ``compute_openpi_norm_stats`` of each export (openpi defaults: action horizon 50, batch 32;
  parquet columns only), checked equal between the two formats.

Prints JSON and the markdown table of docs/benchmarks.md.

    python bench/lerobot_export.py --episodes 1000 --seconds 1 --size 64x48 --workers 2 --out /tmp/dpflow-bench-export
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prepare(out: Path, episodes: int, seconds: float, w: int, h: int) -> Path:
    """The pairing manifest of ``episodes`` sample recordings (written once, reused)."""
    from dpflow_core.pairing import pair_recordings, write_manifest
    from dpflow_core.recordings.samples import SampleSpec, write_task

    manifest = out / f"manifest-{episodes}x{seconds}s-{w}x{h}.json"
    if manifest.exists():
        return manifest
    base = out / f"rec-{episodes}x{seconds}s-{w}x{h}"
    shutil.rmtree(base, ignore_errors=True)
    spec = replace(SampleSpec(), width=w, height=h, gop_size=15)
    write_task(base, episodes=episodes, seconds=seconds, seed=1, task="bench", spec=spec)
    return write_manifest(pair_recordings(base / "bench"), manifest)


def step(kind: str, manifest: str, out: str, workers: int, w: int, h: int) -> None:
    """Child process: one step; prints its figures as JSON (``wall_s`` after the imports, ``import_s`` apart)."""
    t0 = time.perf_counter()
    from dpflow_core.conversion import ConversionSettings, convert
    from dpflow_core.export import ExportSettings, compute_openpi_norm_stats, export_lerobot

    started = time.perf_counter()
    if kind == "npz":
        r = convert(manifest, out, ConversionSettings(image_size=(w, h)), workers=workers)
        figures = {"episodes": r.n_episodes, "frames": r.total_steps}
    elif kind.startswith("export-"):
        r = export_lerobot(manifest, out, ExportSettings(image_size=(w, h), codebase_version=kind[len("export-"):]), workers=workers)
        figures = {"episodes": r.n_episodes, "frames": r.total_frames}
    else:
        stats = compute_openpi_norm_stats(out)
        figures = {"norm_stats": {k: v.to_json() for k, v in stats.items()}}
    wall = time.perf_counter() - started
    size = Path(out).stat().st_size if Path(out).is_file() else sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file())
    print(json.dumps({**figures, "wall_s": wall, "import_s": started - t0, "bytes": size,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def run_step(kind: str, manifest: Path, out: Path, workers: int, w: int, h: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--step", kind, str(manifest), str(out), str(workers), str(w), str(h)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--step":
        kind, manifest, out, workers, w, h = sys.argv[2:8]
        step(kind, manifest, out, int(workers), int(w), int(h))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=1.0, help="recording length per episode (+-15 %%)")
    ap.add_argument("--size", default="64x48", help="WxH of the recorded and the written frames")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=Path("/tmp/dpflow-bench-export"))
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    manifest = prepare(args.out, args.episodes, args.seconds, w, h)
    prepare_s = time.perf_counter() - t0
    run = args.out / f"run-{os.getpid()}"
    results = {
        "npz": run_step("npz", manifest, run / "dataset.npz", args.workers, w, h),
        "export-v3.0": run_step("export-v3.0", manifest, run / "lerobot-v3.0", args.workers, w, h),
        "export-v2.1": run_step("export-v2.1", manifest, run / "lerobot-v2.1", args.workers, w, h),
    }
    for v in ("v3.0", "v2.1"):
        results[f"norm-stats-{v}"] = run_step(f"norm-stats-{v}", manifest, run / f"lerobot-{v}", args.workers, w, h)
    assert results["norm-stats-v3.0"]["norm_stats"] == results["norm-stats-v2.1"]["norm_stats"], "formats disagree"
    files = {v: sum(1 for p in (run / f"lerobot-{v}").rglob("*") if p.is_file()) for v in ("v3.0", "v2.1")}
    shutil.rmtree(run)
    print(json.dumps({"prepare_s": round(prepare_s, 1), "files": files, "cpu": os.cpu_count(),
                      **{k: {n: x for n, x in r.items() if n != "norm_stats"} for k, r in results.items()}}, indent=2))
    for kind in ("npz", "export-v3.0", "export-v2.1"):
        r = results[kind]
        print(f"| {kind} | {r['episodes']} | {r['frames']:,} | {r['wall_s']:.1f} s | {r['frames'] / r['wall_s']:,.0f} | "
              f"{r['bytes'] / 1e6:.1f} MB | {r['rss_mb']:.0f} MB |")
    for v in ("v3.0", "v2.1"):
        r = results[f"norm-stats-{v}"]
        print(f"| norm stats {v} | | | {r['wall_s']:.2f} s | | | {r['rss_mb']:.0f} MB |")
    print(f"imports per step: {min(r['import_s'] for r in results.values()):.1f}-{max(r['import_s'] for r in results.values()):.1f} s")


if __name__ == "__main__":
    main()
