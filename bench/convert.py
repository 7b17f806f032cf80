"""Benchmark of the conversion to dataset.npz (not a test; figures go to docs/benchmarks.md).

Converts the same sample episodes three ways and prints a markdown table:

* ``dpflow convert`` with 1 worker and with N workers (a fresh process per run,
  so peak RSS is that run's own: the parent, and the largest worker);
* the decode+resize floor: PyAV decode + ``cv2.resize(INTER_AREA)`` + BGR->RGB of
  the same access units, in one process, no alignment and no writing (and, for
  reference, PyAV decode with the swscale area scaler dpflow uses).

Run for 4 and 16 episodes: the parent's peak RSS must not grow with the episode count.

    python bench/convert.py --episodes 4 16 --workers 2 --out /tmp/dpflow-bench
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _entry(path: Path) -> dict:
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"path": str(path), "size_bytes": path.stat().st_size, "sha256": h}


def _prepare(out: Path, n: int, seconds: float, width: int, height: int) -> Path:
    """Write ``n`` sample episodes (once) and a manifest accepting them; return the manifest path."""
    from dpflow_core.recordings import samples
    from dpflow_core.recordings.topics import DAS_DEFAULT

    root = out / f"rec{n}" / "bench"
    manifest = out / f"manifest{n}.json"
    if manifest.exists():
        return manifest
    spec = replace(samples.SampleSpec(), width=width, height=height)
    eps = [samples.write_episode(root, f"bench_{k:04d}", replace(spec, seconds=seconds), seed=k) for k in range(n)]
    doc = {
        "manifest_version": 1, "root": str(root), "task": "bench", "created_at": "bench",
        "topics": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(DAS_DEFAULT).items()},
        "accepted": [{"stem": e.stem, "vio_status": {"status": "success"}, "validation": {},
                      "files": {"raw_mcap": _entry(e.raw_mcap), "vio_mcap": _entry(e.vio_mcap),
                                "vio_json": _entry(e.vio_json)}} for e in eps],
        "rejected": [],
    }
    manifest.write_text(json.dumps(doc))
    return manifest


def _one(manifest: str, out: str, workers: int, size: tuple[int, int]) -> None:
    """Child process: one conversion; print its figures as JSON."""
    from dpflow_core.conversion import convert

    started = time.perf_counter()
    r = convert(manifest, out, image_size=size, workers=workers)
    wall = time.perf_counter() - started
    print(json.dumps({
        "wall_s": wall,
        "frames": r.total_steps,
        "bytes": r.size_bytes,
        "rss_parent_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "timings_s": r.metadata["timings_s"],
        "rss_worker_mb": max(e["worker_peak_rss_mb"] for e in r.metadata["episodes"]) if workers > 1 else None,
    }))


def _floor(manifest: Path, size: tuple[int, int]) -> dict:
    """Decode+resize floor over the same access units (read beforehand, not timed)."""
    import av
    import cv2

    from dpflow_core.conversion import _SWS_FLAGS
    from dpflow_core.recordings import read_streams

    cv2.setNumThreads(1)
    doc = json.loads(manifest.read_text())
    packets = [read_streams(e["files"]["vio_mcap"]["path"]).camera_packets for e in doc["accepted"]]
    out = {}
    for name in ("cv2_area", "pyav_area"):
        frames = 0
        started = time.perf_counter()
        for units in packets:
            ctx = av.CodecContext.create("h264", "r")
            ctx.thread_count = 1
            for data in units:
                for f in ctx.decode(av.Packet(data)):
                    if name == "cv2_area":
                        rgb = cv2.cvtColor(cv2.resize(f.to_ndarray(format="bgr24"), size, interpolation=cv2.INTER_AREA),
                                           cv2.COLOR_BGR2RGB)
                    else:
                        rgb = f.reformat(width=size[0], height=size[1], format="rgb24", interpolation=_SWS_FLAGS).to_ndarray()
                    frames += rgb.shape[0] > 0
        out[name] = {"wall_s": time.perf_counter() - started, "frames": frames}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, nargs="+", default=[4, 16])
    p.add_argument("--seconds", type=float, default=8.0, help="Episode length (s).")
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--height", type=int, default=240)
    p.add_argument("--image-size", default="224,224")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="N of the N-worker run.")
    p.add_argument("--out", type=Path, default=Path("/tmp/dpflow-bench"))
    p.add_argument("--one", nargs=3, metavar=("MANIFEST", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    size = tuple(int(v) for v in args.image_size.split(","))
    if args.one:
        _one(args.one[0], args.one[1], int(args.one[2]), size)
        return

    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in args.episodes:
        manifest = _prepare(args.out, n, args.seconds, args.width, args.height)
        floor = _floor(manifest, size)
        runs = {}
        for w in sorted({1, args.workers}):
            target = args.out / f"ds{n}_w{w}_{os.getpid()}.npz"
            proc = subprocess.run([sys.executable, __file__, "--image-size", args.image_size, "--one", str(manifest),
                                   str(target), str(w)], capture_output=True, text=True, check=True)
            runs[w] = json.loads(proc.stdout.strip().splitlines()[-1])
            for p_ in (target, target.with_suffix(".json"), target.with_name(f"{target.stem}.norm_stats.json")):
                p_.unlink(missing_ok=True)
        floor_fps = floor["cv2_area"]["frames"] / floor["cv2_area"]["wall_s"]
        pyav_fps = floor["pyav_area"]["frames"] / floor["pyav_area"]["wall_s"]
        for w, r in runs.items():
            fps = r["frames"] / r["wall_s"]
            t = r["timings_s"]
            name = (f"dpflow convert, {w} worker{'s' if w > 1 else ''} (align {t['episodes']:.2f} s, "
                    f"write+hash {t['write']:.2f} s, norm stats {t['norm_stats']:.2f} s)")
            rows.append((n, name, r["frames"], r["wall_s"], fps, fps / floor_fps, r["rss_parent_mb"], r["rss_worker_mb"]))
        rows.append((n, "floor: PyAV decode + cv2.resize INTER_AREA", floor["cv2_area"]["frames"],
                     floor["cv2_area"]["wall_s"], floor_fps, 1.0, None, None))
        rows.append((n, "ref: PyAV decode + swscale area to RGB (dpflow's scaler)", floor["pyav_area"]["frames"],
                     floor["pyav_area"]["wall_s"], pyav_fps, pyav_fps / floor_fps, None, None))

    print(f"camera {args.width}x{args.height} H.264, {args.seconds:g} s episodes at 30 Hz -> {size[0]}x{size[1]}; "
          f"{os.cpu_count()} cores\n")
    print("| episodes | method | frames | wall s | frames/s | x floor | peak RSS parent MB | peak RSS worker MB |")
    print("|---|---|---|---|---|---|---|---|")
    for n, name, frames, wall, fps, ratio, rss_p, rss_w in rows:
        rss_p = "-" if rss_p is None else f"{rss_p:.0f}"
        rss_w = "-" if rss_w is None else f"{rss_w:.0f}"
        print(f"| {n} | {name} | {frames} | {wall:.2f} | {fps:.0f} | {ratio:.2f} | {rss_p} | {rss_w} |")


if __name__ == "__main__":
    main()
