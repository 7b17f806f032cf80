"""Benchmark: openpi norm stats of a LeRobot dataset (v3.0 or v2.1) vs decoding its video (not a test).

Writes a synthetic LeRobot dataset with :class:`dpflow_core.export.LeRobotWriter`
(smooth 7-D state tracks, textured H.264 frames), then times:

* ``compute_openpi_norm_stats`` (parquet columns only) -- first run and the
  median of the following runs; the result is checked against
  ``openpi_norm_stats`` of the arrays the dataset was written from;
* decoding every frame of every episode video with PyAV to RGB (one process,
  one decoder thread: what a statistics step that opened the videos would pay).

Figures go to docs/benchmarks.md.

    python bench/norm_stats.py --episodes 1000 --frames 150 --size 96x96 --format v3.0 --out /tmp/dpflow-bench-lerobot
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import av
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpflow_core import export as lr  # noqa: E402


def synthetic(k: int, n: int, h: int, w: int, texture: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """State (n, 7), frames (n, h, w, 3) uint8 (a texture panned over time), frame times (n,) s at ~30 Hz."""
    rng = np.random.default_rng(k)
    t = np.arange(n) / 30.0
    phase = rng.uniform(0, 2 * np.pi, 7)
    freq = rng.uniform(0.1, 0.5, 7)
    amp = np.array([0.1, 0.1, 0.05, 0.3, 0.3, 0.5, 0.03])
    base = np.array([0.4, 0.0, 0.3, 0.0, 0.0, 0.0, 0.05])
    state = (base + amp * np.sin(2 * np.pi * freq * t[:, None] + phase)).astype(np.float32)
    dx = (np.arange(n) * 2 + k * 7) % (texture.shape[1] - w)
    dy = (np.arange(n) + k * 3) % (texture.shape[0] - h)
    frames = np.stack([texture[y : y + h, x : x + w] for x, y in zip(dx, dy)])
    jitter = rng.normal(0, 3e-4, n)
    return state, frames, t + jitter - jitter[0]


def texture_for(h: int, w: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0 : 4 * h, 0 : 4 * w]
    texture = np.stack(
        [128 + 90 * np.sin(xs / 9.0 + ys / 23.0), 110 + 70 * np.cos(ys / 7.0), 140 + 80 * np.sin((xs - ys) / 13.0)], axis=-1
    )
    return np.clip(texture + rng.normal(0, 6, texture.shape), 0, 255).astype(np.uint8)


def build(out: Path, episodes: int, frames: int, h: int, w: int, version: str) -> float:
    texture = texture_for(h, w)
    started = time.perf_counter()
    with lr.LeRobotWriter(out, "pick the cup and place it on the plate", codebase_version=version) as writer:
        for k in range(episodes):
            s, f, t = synthetic(k, frames, h, w, texture)
            writer.add_episode(s, {lr.CAMERA_KEY: f}, t, stem=f"episode_{k:04d}")
        writer.finish()
    return time.perf_counter() - started


def reference(episodes: int, frames: int) -> tuple[np.ndarray, np.ndarray]:
    """The state and action arrays the dataset was written from (regenerated; no video)."""
    tiny = np.zeros((4, 4, 3), dtype=np.uint8)
    states = [synthetic(k, frames, 1, 1, tiny)[0] for k in range(episodes)]
    return np.concatenate(states), np.concatenate([lr.episode_actions(s, "next_state") for s in states])


def decode_all(out: Path) -> tuple[float, int]:
    started = time.perf_counter()
    count = 0
    for path in sorted((out / "videos").rglob("*.mp4")):
        with av.open(str(path)) as c:
            stream = c.streams.video[0]
            stream.thread_type = "NONE"
            for frame in c.decode(stream):
                frame.to_ndarray(format="rgb24")
                count += 1
    return time.perf_counter() - started, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--frames", type=int, default=150, help="frames per episode (~30 Hz)")
    ap.add_argument("--size", default="96x96", help="WxH of the video")
    ap.add_argument("--runs", type=int, default=5, help="norm stats runs (first + median of the rest)")
    ap.add_argument("--format", default="v3.0", choices=lr.FORMATS, help="LeRobot format written")
    ap.add_argument("--out", type=Path, default=Path("/tmp/dpflow-bench-lerobot"))
    ap.add_argument("--keep", action="store_true", help="keep the dataset; a later run with the same shape reuses it (build_s null)")
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    out = args.out / f"ds-{args.format}-{args.episodes}x{args.frames}-{w}x{h}"
    build_s = None
    if not out.exists():
        build_s = round(build(out, args.episodes, args.frames, h, w, args.format), 1)
    state, actions = reference(args.episodes, args.frames)
    size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6
    parquet_mb = sum(p.stat().st_size for p in (out / "data").rglob("*.parquet")) / 1e6

    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        stats = lr.compute_openpi_norm_stats(out)
        times.append(time.perf_counter() - t0)
    expected = lr.openpi_norm_stats(state, actions, [args.frames] * args.episodes)
    for key in ("state", "actions"):
        assert stats[key].to_json() == expected[key].to_json(), key
    decode_s, n_frames = decode_all(out)
    result = {
        "format": args.format,
        "episodes": args.episodes,
        "frames": int(len(state)),
        "video": f"{w}x{h} H.264 yuv420p gop {lr.VideoSpec().gop_size}",
        "dataset_mb": round(size_mb, 1),
        "parquet_mb": round(parquet_mb, 1),
        "build_s": build_s,
        "norm_stats_first_s": round(times[0], 3),
        "norm_stats_median_s": round(statistics.median(times[1:] or times), 3),
        "decode_all_video_s": round(decode_s, 1),
        "decoded_frames": n_frames,
        "decode_frames_per_s": round(n_frames / decode_s),
        "cpu": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    print(
        f"| {args.episodes} | {len(state):,} | {w}x{h} | {result['norm_stats_first_s']:.2f} | "
        f"{result['norm_stats_median_s']:.2f} | {result['decode_all_video_s']:.1f} ({result['decode_frames_per_s']:,} frames/s) |"
    )
    if not args.keep:
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
