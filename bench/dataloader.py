"""Benchmark of the trainer's data pipeline (not a test; results go to docs/benchmarks.md).

Measures, for the default task shape (224x224 images, To=2, horizon 16,
down-sampling 3, batch 64):

1. start-up of a training process on a 1x and a 10x dataset: wall time to
   open and validate the replay buffer, build the sample index and fit the
   normaliser (everything the trainer does with data before the model), and
   the resident memory that adds, each in a fresh process;
2. samples/s of three loaders over the same batches, interleaved round after round,
   each measurement in a fresh process, page cache warm (a second pass over the same
   batches): dpflow's trainer loader (``SequenceDataset.__getitems__``: whole batches
   gathered into one shared-memory buffer, frames uint8), the same dataset one sample
   at a time through ``default_collate``, and a UMI-``UmiDataset``-style per-sample
   loader on the ``dpflow export-umi`` zarr (JPEG-XL frames, float32 in the worker).

Usage::

    .venv/bin/python bench/dataloader.py --workdir /tmp/dpflow-bench --frames 2000 --scale 10 --workers 2 --rounds 3

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
        # UMI's latencies at 30 Hz: (camera 0.125 s - robot 0.0001 s) and (camera - gripper 0.02 s) x 30
        obs_latency_steps={"robot0_eef_pos": 3.747, "robot0_eef_rot_axis_angle": 3.747, "robot0_gripper_width": 3.15},
    )


def startup(path: str) -> dict:
    """Run in a fresh process: cost of the trainer's data start-up on ``path``."""
    import torch  # noqa: F401  (counted in the baseline, as in the trainer)

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.batches import SequenceDataset
    from dpflow_core.train.data import normalizer_stats, split_episodes
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


class UmiStyleDataset:
    """The per-sample loader of UMI's ``UmiDataset``, rebuilt for comparison (our code, not UMI's).

    What makes that loader what it is: frames kept JPEG-XL compressed in UMI's zarr
    replay buffer (``dpflow export-umi``, read through zarr's ``ZipStore``), one sample
    per ``__getitem__`` (each of its To frames decoded on its own), images turned into
    ``(To, 3, H, W)`` float32 in [0, 1] inside the worker, and ``default_collate``
    stacking the samples. The low-dimensional part is dpflow's own, one row at a
    time, so both loaders give the same observation and action.
    """

    def __init__(self, zarr_path: str, ds):
        self.zarr_path = zarr_path
        self.ds = ds
        self._rgb = None

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict:
        import torch

        from dpflow_core.train.data import encode_action, encode_obs, obs_positions, read_raw

        if self._rgb is None:  # opened in each worker, after the fork
            import zarr
            from imagecodecs.numcodecs import register_codecs

            register_codecs()
            group = zarr.open_group(zarr.storage.ZipStore(self.zarr_path, mode="r"), mode="r", zarr_format=2)
            self._rgb = group["data/camera0_rgb"]
        spec = self.ds.spec
        rows = self.ds.index[[i]]
        raw = read_raw(self.ds.lowdim, spec, rows)
        obs, base = encode_obs(raw, spec)
        steps = obs_positions(spec, "camera0_rgb", rows).astype(np.int64)[0]
        frames = np.stack([self._rgb[int(t)] for t in steps])
        out = {k: torch.from_numpy(v[0]) for k, v in obs.items()}
        out["camera0_rgb"] = torch.from_numpy(np.moveaxis(frames, -1, 1).astype(np.float32) / 255.0)
        return {"obs": out, "action": torch.from_numpy(encode_action(raw["action"], base, spec)[0])}


LOADERS = ("batched", "per_sample", "umi_style")


def throughput(path: str, loader_kind: str, workers: int, batch_size: int, batches: int, zarr_path: str = "") -> dict:
    """Samples/s of one loader over the same batches (second pass, page cache warm).

    ``batched``: dpflow's trainer loader, whole batches from ``SequenceDataset.__getitems__``
    gathered into one (shared-memory) buffer per key. ``per_sample``: the same dataset
    through ``dataset[i]`` and ``default_collate`` (dpflow's loader before issue 19).
    ``umi_style``: :class:`UmiStyleDataset` on the zarr export of the same dataset.
    """
    import torch
    from torch.utils.data import DataLoader, Dataset

    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.batches import SequenceDataset, pass_batch
    from dpflow_core.train.sampler import EpochBatchSampler

    torch.set_num_threads(1)
    rb = ReplayBuffer(path)
    ds = SequenceDataset(rb, _spec(), np.ones(rb.n_episodes, bool))
    sampler = EpochBatchSampler(len(ds), batch_size, seed=0, max_batches=batches)
    common = {"batch_sampler": sampler, "num_workers": workers, "persistent_workers": workers > 0}
    if loader_kind == "batched":
        loader = DataLoader(ds, collate_fn=pass_batch, **common)
    elif loader_kind == "per_sample":

        class PerSample(Dataset):  # hides __getitems__: one __getitem__ per sample
            def __len__(self):
                return len(ds)

            def __getitem__(self, i):
                return ds[i]

        loader = DataLoader(PerSample(), **common)
    elif loader_kind == "umi_style":
        loader = DataLoader(UmiStyleDataset(zarr_path, ds), **common)
    else:
        raise ValueError(f"unknown loader {loader_kind!r}; choose from {LOADERS}")
    rate, image_dtype = 0.0, ""
    for _ in range(2):
        sampler.set_epoch(0)
        t0 = time.perf_counter()
        n = 0
        for batch in loader:
            n += batch["action"].shape[0]
            image_dtype = str(batch["obs"]["camera0_rgb"].dtype)
        rate = n / (time.perf_counter() - t0)
    return {"loader": loader_kind, "workers": workers, "samples_per_s": rate, "image_dtype": image_dtype}


def _median(values: list[float]) -> float:
    return float(np.median(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dpflow-bench"))
    parser.add_argument("--frames", type=int, default=2000, help="steps of the 1x dataset")
    parser.add_argument("--scale", type=int, default=10, help="size of the large dataset, in multiples of 1x")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every loader")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--startup", help=argparse.SUPPRESS)
    parser.add_argument("--throughput", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.startup:
        print(json.dumps(startup(args.startup)))
        return
    if args.throughput:
        path, kind, workers, zarr_path, _ = args.throughput
        zarr_path = "" if zarr_path == "-" else zarr_path
        print(json.dumps(throughput(path, kind, int(workers), args.batch_size, args.batches, zarr_path)))
        return

    sizes = {"1x": args.frames, f"{args.scale}x": args.frames * args.scale}
    if args.skip_startup:
        sizes = {"1x": args.frames}
    paths = {}
    for label, frames in sizes.items():
        p = args.workdir / f"dataset_{frames}.npz"
        if not p.exists():
            t0 = time.perf_counter()
            write_dataset(p, frames)
            print(f"wrote {p} ({p.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        paths[label] = p

    if not args.skip_startup:
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

    zarr_path = ""
    if "umi_style" in args.loaders:
        zp = paths["1x"].with_name(paths["1x"].stem + ".zarr.zip")
        if not zp.exists():
            from dpflow_core.export.umi import export_umi

            t0 = time.perf_counter()
            export_umi(paths["1x"], zp)
            print(f"wrote {zp} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        zarr_path = str(zp)

    # Each measurement in a fresh process; the loaders take turns, round after round, so that
    # the load other jobs put on the machine falls on all of them alike.
    rates: dict[tuple[str, int], list[float]] = {}
    dtypes: dict[str, str] = {}
    for _ in range(args.rounds):
        for workers in args.workers:
            for kind in args.loaders:
                out = subprocess.run(
                    [sys.executable, __file__, "--batch-size", str(args.batch_size), "--batches", str(args.batches),
                     "--throughput", str(paths["1x"]), kind, str(workers), zarr_path or "-", "x"],
                    capture_output=True, text=True, check=True,
                ).stdout
                r = json.loads(out.strip().splitlines()[-1])
                rates.setdefault((kind, workers), []).append(r["samples_per_s"])
                dtypes[kind] = r["image_dtype"]
                print(f"{kind} workers={workers}: {r['samples_per_s']:.0f} samples/s", file=sys.stderr)
    print(
        f"| loader | workers | images leave the loader as | samples/s median (min-max), {args.rounds} interleaved "
        f"rounds, batch {args.batch_size}, {args.batches} batches, warm cache, 1x | x umi_style |"
    )
    print("|---|---|---|---|---|")
    for workers in args.workers:
        base = _median(rates[("umi_style", workers)]) if ("umi_style", workers) in rates else float("nan")
        for kind in args.loaders:
            v = rates[(kind, workers)]
            print(
                f"| {kind} | {workers} | {dtypes[kind]} | {_median(v):.0f} ({min(v):.0f}-{max(v):.0f}) | "
                f"{_median(v) / base:.1f} |"
            )


if __name__ == "__main__":
    main()
