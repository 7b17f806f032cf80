"""Read a LeRobot dataset with lerobot's own ``LeRobotDataset``; run by the interpreter of a lerobot environment.

    .venv-lerobot-0.4/bin/python tests/lerobot_reader.py DATASET OUT.npz [SOURCE.npz]

made by ``scripts/setup-lerobot.sh`` (lerobot 0.4.4 reads v3.0, lerobot 0.3.3 reads v2.1).
Iterates every frame through ``LeRobotDataset.__getitem__`` and saves state, action, timestamp,
frame_index, episode_index, index, task text and the camera frames (uint8, (N, H, W, 3)) to
OUT.npz, with lerobot's metadata (its ``meta.stats`` and, per episode, the video file and time
range lerobot resolved) as JSON members.

What is not lerobot's own: torchvision does not import beside the CPU torch here, so a stand-in
module named ``torchvision`` is registered (lerobot's dataset modules import it at the top and use
it only to decode video and to convert PNG images), and lerobot's ``decode_video_frames`` is
replaced by a PyAV decoder. That decoder receives exactly the file and the timestamps lerobot
computes (the episode's ``from_timestamp`` added to the frame's ``timestamp`` in v3.0), and keeps
lerobot's rule: the closest decoded frame must lie within ``tolerance_s`` of each query, else
it fails.

With SOURCE.npz (per episode ``state_<k>``, ``action_<k>``, ``frames_<k>``), the statistics lerobot's
``compute_stats.compute_episode_stats`` and ``aggregate_stats`` compute from those arrays are saved
too (member ``lerobot_stats``), for the v3.0 ``meta/stats.json`` test.
"""

from __future__ import annotations

import json
import sys
import types

import av
import datasets  # noqa: F401 - imported before the stand-in: datasets probes for torchvision's spec
import numpy as np
import torch

_tv = types.ModuleType("torchvision")
_tv.transforms = types.ModuleType("torchvision.transforms")
_tv.io = types.ModuleType("torchvision.io")
sys.modules.update({"torchvision": _tv, "torchvision.transforms": _tv.transforms, "torchvision.io": _tv.io})

import lerobot  # noqa: E402
import lerobot.datasets.lerobot_dataset as lrd  # noqa: E402

_decoded: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_queries: list[tuple[str, float]] = []


def _pyav_decode(video_path, timestamps, tolerance_s, backend=None):
    """(len(timestamps), 3, H, W) float32 in [0, 1], like lerobot's decoders."""
    key = str(video_path)
    if key not in _decoded:
        times, frames = [], []
        with av.open(key) as c:
            s = c.streams.video[0]
            for f in c.decode(s):
                times.append(float(f.pts * s.time_base))
                frames.append(f.to_ndarray(format="rgb24"))
        _decoded[key] = (np.asarray(times), np.stack(frames))
    times, frames = _decoded[key]
    out = []
    for ts in timestamps:
        j = int(np.argmin(np.abs(times - ts)))
        if abs(times[j] - ts) > tolerance_s:
            raise ValueError(f"{video_path}: no frame within {tolerance_s} s of {ts} (closest {times[j]})")
        _queries.append((key, float(ts)))
        out.append(frames[j])
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float() / 255.0


lrd.decode_video_frames = _pyav_decode


def _jsonable(stats):
    return {k: ({n: np.asarray(v).tolist() for n, v in s.items()}) for k, s in (stats or {}).items()}


def main(root: str, out: str, source: str | None = None) -> None:
    ds = lrd.LeRobotDataset("local/dpflow_export", root=root)
    video_keys = list(ds.meta.video_keys)
    cols: dict[str, list] = {k: [] for k in ("state", "action", "timestamp", "frame_index", "episode_index", "index")}
    frames: dict[str, list] = {k: [] for k in video_keys}
    tasks = []
    for i in range(len(ds)):
        item = ds[i]
        cols["state"].append(item["observation.state"].numpy())
        cols["action"].append(item["action"].numpy())
        for k in ("timestamp", "frame_index", "episode_index", "index"):
            cols[k].append(item[k].item())
        for k in video_keys:
            frames[k].append((item[k].permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8))
        tasks.append(item["task"])
    result = {k: np.asarray(v) for k, v in cols.items()}
    for n, k in enumerate(video_keys):
        result[f"frames_{n}"] = np.stack(frames[k])
    meta = {
        "lerobot_version": lerobot.__version__,
        "codebase_version": ds.meta.info["codebase_version"],
        "fps": ds.meta.fps,
        "num_episodes": ds.num_episodes,
        "num_frames": ds.num_frames,
        "video_keys": video_keys,
        "tasks": sorted(set(tasks)),
        "stats": _jsonable(ds.meta.stats),
        "queries": _queries[:3] + _queries[-3:],
        "video_files": sorted({q for q, _ in _queries}),
    }
    if source is not None:
        import lerobot.datasets.compute_stats as cs

        src = np.load(source)
        per_episode = []
        for e in range(ds.meta.total_episodes):
            data = {"observation.state": src[f"state_{e}"], "action": src[f"action_{e}"]}
            ep = cs.compute_episode_stats(data, {k: {"dtype": "float32"} for k in data})
            # compute_episode_stats samples camera frames from image files; give it the same sampled frames
            fr = src[f"frames_{e}"]
            idx = cs.sample_indices(len(fr))
            imgs = np.stack([cs.auto_downsample_height_width(fr[j].transpose(2, 0, 1)) for j in idx])
            cam = cs.get_feature_stats(imgs, axis=(0, 2, 3), keepdims=True)
            ep[video_keys[0]] = {k: v if k == "count" else np.squeeze(v / 255.0, axis=0) for k, v in cam.items()}
            per_episode.append(ep)
        meta["lerobot_stats"] = _jsonable(cs.aggregate_stats(per_episode))
    result["meta"] = np.array(json.dumps(meta))
    np.savez(out, **result)


if __name__ == "__main__":
    main(*sys.argv[1:])
