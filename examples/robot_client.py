"""A robot computer's side of `dpflow serve`, with nothing but `openpi-client` installed.

It replays a recorded episode of a dpflow dataset.npz as if its samples were the
robot's sensors right now: every control cycle it sends each stream's recent samples
(as late as the policy's trained latencies say each sensor delivers them) with their
capture timestamps, receives an action chunk with the actions' target
times, keeps only the actions still ahead (UMI-style: after now plus the execution
latency), and prints what it would command and where the time went.

    scripts/setup-openpi-client.sh                       # once: .venv-openpi-client
    dpflow serve outputs/checkpoints/RUN/SHA/latest.ckpt --port 8000 &
    .venv-openpi-client/bin/python examples/robot_client.py --port 8000 \
        --dataset dataset.npz --episode 0 --cycles 5

A real robot builds the same request from its camera frames, its pose estimate
(the camera pose, position m + rotation vector rad, in the dataset's world frame)
and its gripper width (m), each stamped with its capture time on one clock.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def load_episode(path: str, episode: int, keys: list[str]) -> dict[str, np.ndarray]:
    """The episode's arrays of ``keys`` from a dpflow dataset.npz (members ``data__<key>``)."""
    with np.load(path) as z:
        ends = z["meta__episode_ends"]
        if not 0 <= episode < len(ends):
            raise SystemExit(f"{path}: episode {episode} out of range (it has {len(ends)})")
        start = 0 if episode == 0 else int(ends[episode - 1])
        return {k: z[f"data__{k}"][start:int(ends[episode])] for k in keys}


def sensor_latency_s(meta: dict, key: str) -> float:
    """How late the sensor of ``key`` delivers its samples (the trained camera/robot/gripper latency)."""
    sensor = "camera" if meta["observation"][key]["dtype"] == "uint8" else "gripper" if "gripper" in key else "robot"
    return float(meta["latency_s"][sensor])


def request_at(episode: dict[str, np.ndarray], step: int, history: int, freq: float, now: float,
               latency_s: dict[str, float]) -> dict:
    """What the robot's sensors have delivered at the control cycle of row ``step``, whose time is ``now``.

    A recorded row holds samples captured at one moment. Live, a sensor that is ``latency_s`` late has
    delivered only the rows captured at least that long ago: up to row ``step - latency_s * freq``
    (a camera 0.1 s late at 30 Hz: the frame of row ``step - 3``, beside the pose of row ``step``). Each
    row goes out stamped with its capture time, ``now - (step - row) / freq``; the server then pairs
    frames and poses exactly as training paired the rows. The ``history`` newest rows of each stream.
    """
    out = {}
    for key, values in episode.items():
        newest = int(np.floor(step - latency_s[key] * freq + 1e-9))
        lo = max(0, newest - history + 1)
        rows = np.arange(lo, newest + 1)
        out[key] = {"timestamp": now - (step - rows) / freq, "value": values[lo:newest + 1]}
    return out


def first_step(freq: float, latency_s: dict[str, float]) -> int:
    """The first row at which every stream has delivered a sample (the latest sensor's latency in rows)."""
    return max([int(np.ceil(v * freq - 1e-9)) for v in latency_s.values()] + [0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dataset", help="a dpflow dataset.npz to take the sensor samples from "
                        "(default: the served policy's training dataset, when this computer has it)")
    parser.add_argument("--episode", type=int, default=0)
    parser.add_argument("--cycles", type=int, default=5, help="control cycles to run")
    parser.add_argument("--exec-latency-s", type=float, default=0.01, help="command -> controller delay")
    args = parser.parse_args()
    from openpi_client import websocket_client_policy  # here, so the request logic imports without it

    policy = websocket_client_policy.WebsocketClientPolicy(host=args.host, port=args.port)
    meta = policy.get_server_metadata()
    print(f"server {meta['server']}: checkpoint {meta['checkpoint_sha256'][:12]}, "
          f"dataset {meta['dataset_sha256'][:12]}, To={meta['n_obs_steps']}, H={meta['horizon']}, "
          f"{meta['frequency_hz']:g} Hz, streams {sorted(k for k, v in meta['observation'].items() if v['kind'] == 'stream')}")
    dataset = args.dataset or meta["dataset_path"]
    if not dataset or not os.path.isfile(dataset):
        raise SystemExit(f"no dataset {dataset!r} here: give --dataset, a dpflow dataset.npz of this policy's task")
    keys = sorted(meta["observation"])
    episode = load_episode(dataset, args.episode, keys)
    streams = [k for k in keys if meta["observation"][k]["kind"] == "stream"]
    latency_s = {k: sensor_latency_s(meta, k) for k in streams}
    freq = float(meta["frequency_hz"])
    # enough samples for the oldest observation step, plus one on each side to interpolate between
    history = (meta["n_obs_steps"] - 1) * meta["obs_down_sample_steps"] + 3
    step = first_step(freq, latency_s)
    n_steps = len(next(iter(episode.values())))
    for _ in range(args.cycles):
        if step >= n_steps:
            break
        sent = time.time()
        obs = request_at({k: episode[k] for k in streams}, step, history, freq, sent, latency_s)
        obs |= {k: v[step] for k, v in episode.items() if meta["observation"][k]["kind"] == "constant"}
        obs["now_s"] = sent
        answer = policy.infer(obs)
        received = time.time()
        ahead = np.nonzero(answer["timestamp"] > received + args.exec_latency_s)[0]
        timing = answer["server_timing"]
        network_ms = (received - sent) * 1e3 - timing["total_ms"]
        print(f"step {step}: {len(ahead)} of {len(answer['timestamp'])} actions ahead; first "
              f"{np.round(answer['action'][ahead[0]], 4).tolist() if len(ahead) else None}; "
              f"decode {timing['decode_ms']:.2f} ms, preprocess {timing['preprocess_ms']:.2f} ms, "
              f"queue {timing['queue_ms']:.2f} ms, inference {timing['inference_ms']:.2f} ms, "
              f"postprocess {timing['postprocess_ms']:.2f} ms, network {network_ms:.2f} ms")
        step += int(meta["n_action_steps"])


if __name__ == "__main__":
    main()
