"""Benchmark of the trainer's data pipeline (not a test; results go to docs/benchmarks.md).

Measures, for the default task shape (224x224 images, To=2, horizon 16,
down-sampling 3, batch 64):

1. start-up of a training process on a 1x and a 10x dataset: wall time to
   open and validate the replay buffer, build the sample index and fit the
   normaliser (everything the trainer does with data before the model), and
   the resident memory that adds, each in a fresh process;
2. samples/s of ``DataLoader(SequenceDataset, EpochBatchSampler)`` with 0 and
   N worker processes, page cache warm (a second pass over the same batches).

Usage::

    .venv/bin/python bench/dataloader.py --workdir /tmp/dpflow-bench --frames 2000 --scale 10

The datasets are synthetic ``dataset.npz`` files written member by member
(never the whole image array in memory), with the layout of formats.md section 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

EPISODE_LENGTH = 200
IMAGE_HW = (224, 224)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def write_dataset(path: Path, n_frames: int, frequency_hz: float = 30.0) -> Path:
    """Write a synthetic uncompressed dataset.npz of ``n_frames`` steps (episodes of 200)."""
    n_episodes = max(2, n_frames // EPISODE_LENGTH)
    lengths = [EPISODE_LENGTH] * n_episodes
    total = sum(lengths)
    h, w = IMAGE_HW
    t = np.concatenate([np.arange(n) for n in lengths]).astype(np.float64)
    pos = np.stack([0.3 + 0.1 * np.cos(t / 50), 0.1 * np.sin(t / 50), 0.2 + 0.0005 * t], 1).astype(np.float32)
    rot = np.stack([0.1 * np.sin(t / 30), 0.001 * t, np.full_like(t, 0.5)], 1).astype(np.float32)
    grip = (0.04 + 0.03 * np.cos(t / 40))[:, None].astype(np.float32)
    pose = np.concatenate([pos, rot], 1)
    ends = np.cumsum(lengths).astype(np.int64)
    starts = ends - EPISODE_LENGTH
    info = {"frequency_hz": frequency_hz, "n_episodes": n_episodes, "image_size": [w, h], "total_steps": total}
    members = {
        "data__robot0_eef_pos": pos,
        "data__robot0_eef_rot_axis_angle": rot,
        "data__robot0_gripper_width": grip,
        "data__robot0_demo_start_pose": np.repeat(pose[starts], lengths, axis=0),
        "data__robot0_demo_end_pose": np.repeat(pose[ends - 1], lengths, axis=0),
        "data__timestamp": t / frequency_hz,
        "meta__episode_ends": ends,
        "meta__info_json": np.frombuffer(json.dumps(info).encode(), dtype=np.uint8),
    }
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open("data__camera0_rgb.npy", "w", force_zip64=True) as f:
            header = {"descr": "|u1", "fortran_order": False, "shape": (total, h, w, 3)}
            np.lib.format.write_array_header_1_0(f, header)
            yy, xx = np.mgrid[0:h, 0:w]
            chunk = 256
            for s in range(0, total, chunk):
                k = np.arange(s, min(total, s + chunk))[:, None, None]
                frames = np.empty((len(k), h, w, 3), dtype=np.uint8)
                frames[..., 0] = (xx[None] + 3 * k) % 256
                frames[..., 1] = (yy[None] + 5 * k) % 256
                frames[..., 2] = (xx[None] ^ yy[None]) % 256
                f.write(frames.tobytes())
        for name, arr in members.items():
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)
    os.replace(tmp, path)
    return path


def _spec():
    from dpflow_core.train.data import ObsActionSpec

    return ObsActionSpec(
        n_obs_steps=2,
        horizon=16,
        obs_down_sample_steps=3,
        action_down_sample_steps=3,
        obs_latency_steps={"camera0_rgb": 4, "robot0_gripper_width": 1},
    )


def startup(path: str) -> dict:
    """Run in a fresh process: cost of the trainer's data start-up on ``path``."""
    import torch  # noqa: F401  (counted in the baseline, as in the trainer)

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.data import SequenceDataset, normalizer_stats, split_episodes
    from dpflow_core.train.sampler import EpochBatchSampler

    base = _rss_mb()
    t0 = time.perf_counter()
    rb = ReplayBuffer(path)
    spec = _spec()
    train_mask, _ = split_episodes(rb.n_episodes, 0.05, 42)
    ds = SequenceDataset(rb, spec, train_mask)
    normalizer_stats(rb, spec)
    EpochBatchSampler(len(ds), 64, seed=42).epoch_indices(0)
    elapsed = time.perf_counter() - t0
    return {
        "frames": rb.n_steps,
        "file_gb": Path(path).stat().st_size / 1e9,
        "samples": len(ds),
        "startup_s": elapsed,
        "rss_base_mb": base,
        "rss_added_mb": _rss_mb() - base,
    }


def throughput(path: str, workers: int, batch_size: int, batches: int) -> float:
    """Samples/s of the training DataLoader (second pass, page cache warm)."""
    import torch
    from torch.utils.data import DataLoader

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.data import SequenceDataset
    from dpflow_core.train.sampler import EpochBatchSampler

    torch.set_num_threads(1)
    rb = ReplayBuffer(path)
    ds = SequenceDataset(rb, _spec(), np.ones(rb.n_episodes, bool))
    sampler = EpochBatchSampler(len(ds), batch_size, seed=0, max_batches=batches)
    loader = DataLoader(ds, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
    rate = 0.0
    for _ in range(2):
        sampler.set_epoch(0)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += batch["action"].shape[0]
        rate = n / (time.perf_counter() - t0)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dpflow-bench"))
    parser.add_argument("--frames", type=int, default=2000, help="steps of the 1x dataset")
    parser.add_argument("--scale", type=int, default=10, help="size of the large dataset, in multiples of 1x")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--startup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup:
        print(json.dumps(startup(args.startup)))
        return

    sizes = {"1x": args.frames, f"{args.scale}x": args.frames * args.scale}
    paths = {}
    for label, frames in sizes.items():
        p = args.workdir / f"dataset_{frames}.npz"
        if not p.exists():
            t0 = time.perf_counter()
            write_dataset(p, frames)
            print(f"wrote {p} ({p.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        paths[label] = p

    print("| dataset | frames | file | samples | start-up | RSS after imports | RSS added by start-up |")
    print("|---|---|---|---|---|---|---|")
    for label, p in paths.items():
        out = subprocess.run(
            [sys.executable, __file__, "--startup", str(p)], capture_output=True, text=True, check=True
        ).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(
            f"| {label} | {r['frames']} | {r['file_gb']:.2f} GB | {r['samples']} | {r['startup_s'] * 1000:.0f} ms | "
            f"{r['rss_base_mb']:.0f} MB | {r['rss_added_mb']:.1f} MB |"
        )
    print()
    print(f"| workers | samples/s (batch {args.batch_size}, {args.batches} batches, warm cache, 1x) |")
    print("|---|---|")
    for workers in args.workers:
        print(f"| {workers} | {throughput(str(paths['1x']), workers, args.batch_size, args.batches):.0f} |")


if __name__ == "__main__":
    main()
