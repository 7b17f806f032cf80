"""Benchmark: accuracy and cost of the offsets measured from each recording (issue 29; not a test).

Records simulated-world episodes (MuJoCo renders each frame at its capture time) with known camera
lags and IMU shifts, then for each episode, in one process:

* decodes the camera to the conversion size with :func:`dpflow_core.conversion.decode.decode_camera`,
  alone and again feeding :class:`dpflow_core.offsets.ImageMotion` (the added tracking time is the
  tracker's own clock);
* times :func:`dpflow_core.offsets.measure_offsets` (the lag scans) and the reading of the file
  (:func:`~dpflow_core.recordings.reader.read_streams`, which also reads the IMU);
* prints the estimate against the truth with its confidence.

Figures go to docs/benchmarks.md.

    python bench/offsets.py --size 320x240 --convert-size 224x224 --out /tmp/dpflow-bench-offsets [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dpflow_core.sim.record as sim_record  # noqa: E402
from dpflow_core.conversion.decode import decode_camera  # noqa: E402
from dpflow_core.offsets import ImageMotion, measure_offsets  # noqa: E402
from dpflow_core.recordings.reader import read_streams  # noqa: E402
from dpflow_core.sim.tasks import initial_state, new_world  # noqa: E402

LAGS_S = (-0.15, -0.1, -0.05, 0.0, 0.05, 0.1, 0.15)
IMU_SHIFTS_S = (0.0, 0.02, -0.03)


def record(out: Path, task: str, k: int, lag: float, imu_shift: float, size: tuple[int, int]) -> Path:
    """One episode of ``task`` (seed 500 + k) with the camera ``lag`` s late and the IMU ``imu_shift`` s late."""
    real = sim_record.write_recording

    def write(task_dir, stem, rng, spec, topics, streams):
        moved = dataclasses.replace(streams, imu_ts_ns=streams.imu_ts_ns + int(round(imu_shift * 1e9)))
        return real(task_dir, stem, rng, spec, topics, moved)

    task_dir = out / task
    task_dir.mkdir(parents=True, exist_ok=True)
    world = new_world(task, *size)
    sim_record.write_recording = write
    try:
        stem = f"{task}_{k:04d}"
        sim_record.record_episode(task_dir, stem, initial_state(task, 500 + k), sim_record.SimRecordingSpec(
            width=size[0], height=size[1], camera_latency_s=lag), world)
    finally:
        sim_record.write_recording = real
        world.close()
    return task_dir / f"{stem}_vio.mcap"


def measure(path: Path, convert_size: tuple[int, int]) -> dict:
    t = time.perf_counter()
    streams = read_streams(path)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    _frames, idx, *_ = decode_camera(streams.camera_packets, convert_size, "h264", None, path, streams.camera_ts_ns)
    decode_s = time.perf_counter() - t
    motion = ImageMotion(len(streams.camera_packets))
    t = time.perf_counter()
    decode_camera(streams.camera_packets, convert_size, "h264", None, path, streams.camera_ts_ns, motion.add)
    decode_tracked_s = time.perf_counter() - t
    tracked = motion.seconds
    t = time.perf_counter()
    result = measure_offsets(motion, streams.camera_ts_ns[idx], streams.pose_ts_ns, streams.quat_xyzw,
                             streams.position_m, streams.pose_valid, streams.imu_ts_ns, streams.gyro_rps)
    # the similarity fits run inside measure_offsets, on the tracker's clock: counted as tracking
    estimate_s = time.perf_counter() - t - (motion.seconds - tracked)
    return {"frames": int(len(idx)), "read_s": read_s, "decode_s": decode_s, "decode_tracked_s": decode_tracked_s,
            "track_s": motion.seconds, "estimate_s": estimate_s, **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="320x240", help="recorded camera W x H")
    ap.add_argument("--convert-size", default="224x224", help="decoded (conversion) W x H")
    ap.add_argument("--tasks", default="pick_place,stack")
    ap.add_argument("--lags", default=",".join(str(v) for v in LAGS_S), help="camera lags, s")
    ap.add_argument("--out", default="/tmp/dpflow-bench-offsets")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    convert_size = tuple(int(v) for v in args.convert_size.split("x"))
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    rows = []
    for task in args.tasks.split(","):
        for k, lag in enumerate(float(v) for v in args.lags.split(",")):
            shift = IMU_SHIFTS_S[k % len(IMU_SHIFTS_S)]
            path = record(out, task, k, lag, shift, size)
            r = measure(path, convert_size)
            rows.append({"task": task, "camera_lag_s": lag, "imu_shift_s": shift, **r})
            cam, imu = r["camera_offset"], r["imu_offset"]
            cam_err = None if cam["offset_s"] is None else 1e3 * (cam["offset_s"] - lag)
            imu_err = None if imu["offset_s"] is None else 1e3 * (imu["offset_s"] - shift)
            print(f"{task:10s} lag {1e3 * lag:+6.0f} ms -> {cam['status']:14s} {cam['offset_s']} err {cam_err and round(cam_err, 1)} ms "
                  f"R2 {cam['r2']} contrast {cam['contrast']} rot {cam['rotation_rms_rps']} rad/s | imu {1e3 * shift:+4.0f} ms -> "
                  f"err {imu_err and round(imu_err, 2)} ms R2 {imu['r2']} | decode {1e3 * r['decode_s']:.0f} ms, tracking "
                  f"{1e3 * r['track_s']:.0f} ms, estimate {1e3 * r['estimate_s']:.0f} ms ({r['frames']} frames)", flush=True)
    cam_err = [abs(r["camera_offset"]["offset_s"] - r["camera_lag_s"]) for r in rows if r["camera_offset"]["offset_s"] is not None]
    imu_err = [abs(r["imu_offset"]["offset_s"] - r["imu_shift_s"]) for r in rows if r["imu_offset"]["offset_s"] is not None]
    added = [(r["track_s"] + r["estimate_s"]) / r["decode_s"] for r in rows]
    summary = {"episodes": len(rows), "camera_measured": len(cam_err), "camera_abs_error_ms_median": 1e3 * statistics.median(cam_err),
               "camera_abs_error_ms_max": 1e3 * max(cam_err), "imu_abs_error_ms_median": 1e3 * statistics.median(imu_err),
               "imu_abs_error_ms_max": 1e3 * max(imu_err), "added_cost_vs_decode_median": statistics.median(added),
               "tracking_ms_per_frame": 1e3 * float(np.median([r["track_s"] / r["frames"] for r in rows])),
               "decode_ms_per_frame": 1e3 * float(np.median([r["decode_s"] / r["frames"] for r in rows]))}
    print(json.dumps(summary, indent=2) if args.json else summary)


if __name__ == "__main__":
    main()
