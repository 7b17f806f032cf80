"""Small, valid ``dataset.npz`` replay buffers for tests and benchmarks.

The layout is the one of ``formats.md`` section 2. Each episode is a smooth
trajectory (a slow arc with a turning wrist and an opening/closing gripper),
and each image shows a bright square whose place follows the end-effector
position, so that images carry information about the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def synthetic_arrays(
    n_episodes: int = 4,
    episode_length: int | list[int] = 40,
    image_size: tuple[int, int] = (32, 32),
    frequency_hz: float = 10.0,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """The members of a synthetic replay buffer, keyed by npz member name.

    Args:
        n_episodes: number of episodes E.
        episode_length: steps per episode (one int for all, or one per episode).
        image_size: (W, H) of ``camera0_rgb`` in pixels.
        frequency_hz: sampling frequency written to the metadata (Hz).
        seed: seed of the per-episode variations.

    Returns:
        ``{"data__camera0_rgb": (T, H, W, 3) uint8, "data__robot0_eef_pos": (T, 3) float32 (m),
        "data__robot0_eef_rot_axis_angle": (T, 3) float32 (rad), "data__robot0_gripper_width": (T, 1)
        float32 (m), "data__robot0_demo_start_pose"/"data__robot0_demo_end_pose": (T, 6) float32,
        "data__timestamp": (T,) float64 (s), "meta__episode_ends": (E,) int64,
        "meta__info_json": (n,) uint8 JSON}``.
    """
    lengths = [episode_length] * n_episodes if isinstance(episode_length, int) else list(episode_length)
    assert len(lengths) == n_episodes
    rng = np.random.default_rng(seed)
    w, h = image_size
    pos, rot, grip, start, end, ts, imgs = [], [], [], [], [], [], []
    for length in lengths:
        t = np.arange(length, dtype=np.float64) / frequency_hz
        phase = rng.uniform(0, 2 * np.pi)
        s = np.linspace(0.0, 1.0, length)
        p = np.stack(
            [0.3 + 0.1 * np.cos(phase + 2.0 * s), 0.1 * np.sin(phase + 2.0 * s), 0.2 + 0.05 * s], axis=1
        ).astype(np.float32)
        r = np.stack([0.1 * np.sin(3.0 * s + phase), 0.2 * s, np.full_like(s, 0.5)], axis=1).astype(np.float32)
        g = (0.04 + 0.03 * np.cos(np.pi * s))[:, None].astype(np.float32)
        pose = np.concatenate([p, r], axis=1)
        frames = np.zeros((length, h, w, 3), dtype=np.uint8)
        frames[..., 2] = 40
        cx = np.clip(((p[:, 0] - 0.2) / 0.2 * (w - 1)).round().astype(int), 0, w - 1)
        cy = np.clip(((p[:, 1] + 0.1) / 0.2 * (h - 1)).round().astype(int), 0, h - 1)
        half = max(1, min(w, h) // 8)
        for i in range(length):
            frames[i, max(0, cy[i] - half) : cy[i] + half + 1, max(0, cx[i] - half) : cx[i] + half + 1, 0] = 255
            frames[i, :, :, 1] = int(255 * g[i, 0] / 0.07)
        pos.append(p), rot.append(r), grip.append(g), ts.append(t), imgs.append(frames)
        start.append(np.repeat(pose[:1], length, axis=0)), end.append(np.repeat(pose[-1:], length, axis=0))
    info = {
        "frequency_hz": float(frequency_hz),
        "n_episodes": int(n_episodes),
        "image_size": [int(w), int(h)],
        "episode_lengths": [int(v) for v in lengths],
        "total_steps": int(sum(lengths)),
        "converter_version": "synthetic",
    }
    return {
        "data__camera0_rgb": np.concatenate(imgs),
        "data__robot0_eef_pos": np.concatenate(pos),
        "data__robot0_eef_rot_axis_angle": np.concatenate(rot),
        "data__robot0_gripper_width": np.concatenate(grip),
        "data__robot0_demo_start_pose": np.concatenate(start),
        "data__robot0_demo_end_pose": np.concatenate(end),
        "data__timestamp": np.concatenate(ts),
        "meta__episode_ends": np.cumsum(lengths).astype(np.int64),
        "meta__info_json": np.frombuffer(json.dumps(info).encode("utf-8"), dtype=np.uint8).copy(),
    }


def write_npz(path: str | Path, arrays: dict[str, np.ndarray], compressed: bool = False) -> Path:
    """Write ``arrays`` as an ``.npz`` at exactly ``path`` (stored members unless ``compressed``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        (np.savez_compressed if compressed else np.savez)(f, **arrays)
    return path


def write_synthetic_dataset(path: str | Path, **kwargs) -> Path:
    """Write a valid synthetic ``dataset.npz`` at ``path``; ``kwargs`` go to :func:`synthetic_arrays`."""
    return write_npz(path, synthetic_arrays(**kwargs))


def conversion_value(path: str | Path, frequency_hz: float) -> dict:
    """What the ``dataset_npz`` asset hands on (``ConversionResult.to_dict()``) for the dataset file at ``path``,
    from the file itself: its size and SHA-256, episodes and steps from ``meta/episode_ends``, the image size."""
    import hashlib

    path = Path(path)
    with np.load(path) as npz:
        ends = npz["meta__episode_ends"]
        height, width = npz["data__camera0_rgb"].shape[1:3]
    return {
        "path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "size_bytes": path.stat().st_size,
        "sidecar_path": str(path.with_suffix(".json")), "norm_stats_path": str(path.parent / "norm_stats.json"),
        "frequency_hz": float(frequency_hz), "n_episodes": int(len(ends)), "total_steps": int(ends[-1]),
        "image_size": [int(width), int(height)],
    }
