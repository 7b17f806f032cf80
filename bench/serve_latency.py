"""Round-trip latency of ``dpflow serve`` on loopback against in-process ``predict_action`` (issue 27).

For each policy, in one run:

1. a checkpoint: the ``demo`` trainer config (low-dimensional only) and the ``sim`` config (a
   96 x 96 ``camera0_rgb`` keypoint encoder), each trained for one step on a synthetic 96 x 96
   dataset (latency does not depend on training; ``--demo-checkpoint`` / ``--camera-checkpoint``
   reuse others);
2. in process: ``load_policy(ckpt).predict_action(obs)`` on the aligned observation, one torch
   thread (what the server uses), ``--requests`` times;
3. through the server: ``dpflow serve CKPT --port 0 --threads 1 --batch-window-s W`` in its own
   process, :class:`~dpflow_core.serving.client.RemotePolicy` clients sending what a robot sends
   (per stream the recent samples with capture timestamps, and ``now_s``: the server aligns them):
   one client ``--requests`` requests back to back, then two clients at once (two threads, a
   barrier, ``--requests`` each), for each collection window ``W`` of ``--windows``.

Printed per policy: p50 / p95 round trip (ms) of one client and of two, the two-client to
one-client ratio, the in-process figures, the per-request split (medians of decode, preprocess,
queue, inference, postprocess, network), how often the two clients' requests shared a batch, and
the largest difference between an answer and the in-process ``predict_action`` of the same
observation and noise seed (the server must answer what the policy answers). The machine's load
average is printed before and after: on a shared machine the figures move with it. Under load,
give the run its own scheduler group with a higher weight (with autogroup scheduling, as on Debian,
``nice`` alone only ranks processes within their session), as the figures in docs/benchmarks.md::

    setsid sh -c 'echo -10 > /proc/self/autogroup; exec nice -n -10 .venv/bin/python bench/serve_latency.py \
        --out /tmp/serve-bench --json /tmp/serve-bench/figures.json' </dev/null
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from dpflow_core.train.data import GRIPPER_KEY, POS_KEY, ROT_KEY  # noqa: E402

IMAGE_SIZE = (96, 96)
HISTORY = 6  # samples per stream in each request: what a robot keeps of the last ~0.5 s at 10 Hz


def train_checkpoint(config: str, dataset: Path, run_dir: Path) -> Path:
    """One optimisation step of the ``config`` trainer config on ``dataset``; its ``latest.ckpt``."""
    cmd = [sys.executable, "-m", "dpflow_core.train", f"--config-name={config}", f"task.dataset_path={dataset}",
           f"hydra.run.dir={run_dir}", "logging.mode=disabled", "training.num_epochs=1",
           "training.max_train_steps=1", "training.max_val_steps=1"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return run_dir / "checkpoints" / "latest.ckpt"


class Requests:
    """Robot requests cut from episode 0 of a dataset.npz: streams stamped as if captured just now."""

    def __init__(self, dataset: Path, meta: dict):
        with np.load(dataset) as z:
            end = int(z["meta__episode_ends"][0])
            keys = [k for k, v in meta["observation"].items() if v["kind"] == "stream"]
            self.episode = {k: z[f"data__{k}"][:end] for k in keys}
        self.freq = float(meta["frequency_hz"])
        shifts = meta["obs_latency_shift_s"].values()
        self.lead = int(np.ceil(max(shifts, default=0.0) * self.freq - 1e-9))  # poses run ahead of the frames
        self.rgb = [k for k, v in meta["observation"].items() if v["dtype"] == "uint8"]
        self.steps = np.arange(HISTORY, end - self.lead)

    def at(self, j: int) -> tuple[dict, float]:
        """``(streams, now_s)`` of request ``j``: the newest frame at step ``s``, the newest pose ``lead`` later."""
        s = int(self.steps[j % len(self.steps)])
        now = time.time()
        stamp = lambda idx: now - (s + self.lead - idx) / self.freq  # noqa: E731  (the newest pose is now)
        out = {}
        for key, values in self.episode.items():
            newest = s if key in self.rgb else s + self.lead
            idx = np.arange(newest - HISTORY + 1, newest + 1)
            out[key] = {"timestamp": stamp(idx), "value": values[idx]}
        return out, now


def percentiles(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"p50_ms": float(np.percentile(a, 50)), "p95_ms": float(np.percentile(a, 95)), "n": int(len(a))}


def in_process(policy, requests: Requests, n: int) -> dict[str, float]:
    """Latency of ``predict_action`` alone (the observation aligned beforehand), after 10 of warm-up."""
    import torch

    from dpflow_core.serving.timing import align_observation

    ms = []
    for j in range(n + 10):
        streams, now = requests.at(j)
        obs = align_observation(streams, policy, now)
        start = time.perf_counter()
        with torch.no_grad():
            policy.predict_action(obs, generator=torch.Generator().manual_seed(j))
        if j >= 10:
            ms.append((time.perf_counter() - start) * 1e3)
    return percentiles(ms)


class Server:
    """``dpflow serve`` in its own process, stopped by its PID."""

    def __init__(self, checkpoint: Path, window_s: float, log: Path):
        self.log = open(log, "w")
        cmd = [str(REPO / ".venv" / "bin" / "dpflow"), "serve", str(checkpoint), "--port", "0", "--threads", "1",
               "--batch-window-s", str(window_s)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("serving "):
            self.stop()
            raise SystemExit(f"dpflow serve did not start: {line!r}, see {log}")
        self.url = "ws://" + line.rsplit("ws://", 1)[1].strip()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()


def client_run(url: str, requests: Requests, n: int, first: int, barrier: threading.Barrier | None,
               records: list) -> None:
    """``n`` requests back to back after 5 of warm-up; appends ``(j, streams, now, answer, timing)`` per request."""
    from dpflow_core.serving.client import RemotePolicy

    with RemotePolicy(url) as remote:
        for j in range(first, first + 5):
            remote.predict_action(requests.at(j)[0], noise_seed=j, now_s=time.time())
        if barrier is not None:
            barrier.wait()
        for j in range(first, first + n):
            streams, now = requests.at(j)
            answer = remote.predict_action(streams, noise_seed=j, now_s=now)
            records.append((j, streams, now, answer, dict(remote.last_timing)))


def served(url: str, requests: Requests, n: int, clients: int) -> list:
    records: list = []
    barrier = threading.Barrier(clients) if clients > 1 else None
    threads = [threading.Thread(target=client_run, args=(url, requests, n, 100_000 * (c + 1), barrier, records))
               for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(records) != n * clients:
        raise SystemExit(f"{n * clients - len(records)} requests got no answer")
    return records


def summary(records: list) -> dict:
    out = percentiles([r[4]["round_trip_ms"] for r in records])
    for part in ("decode", "preprocess", "queue", "inference", "postprocess", "network"):
        out[f"{part}_ms_median"] = float(np.median([r[4][f"{part}_ms"] for r in records]))
    sizes = [int(r[4]["batch_size"]) for r in records]
    out["batched_share"] = float(np.mean([s > 1 for s in sizes]))
    return out


def largest_difference(policy, records: list, every: int = 10) -> float:
    """Largest |server answer - in-process predict_action| over every ``every``-th request (same streams, now, seed)."""
    import torch

    from dpflow_core.serving.timing import align_observation

    worst = 0.0
    for j, streams, now, answer, _ in records[::every]:
        obs = align_observation(streams, policy, now)
        with torch.no_grad():
            want = policy.predict_action(obs, generator=torch.Generator().manual_seed(j))
        worst = max(worst, *(float(np.abs(answer[k] - want[k]).max()) for k in ("action", "timestamp")))
    return worst


def bench_policy(name: str, checkpoint: Path, dataset: Path, windows: list[float], n: int, out: Path) -> dict:
    import torch

    from dpflow_core.inference import load_policy
    from dpflow_core.serving.server import load_server

    torch.set_num_threads(1)
    meta = load_server(checkpoint).metadata
    policy = load_policy(checkpoint)
    requests = Requests(dataset, meta)
    result = {"checkpoint": str(checkpoint), "rgb_keys": list(policy.spec.rgb_keys),
              "in_process": in_process(policy, requests, n), "windows": {}}
    for window in windows:
        server = Server(checkpoint, window, out / f"serve-{name}-{window:g}.log")
        try:
            one = served(server.url, requests, n, 1)
            two = served(server.url, requests, n, 2)
        finally:
            server.stop()
        result["windows"][f"{window:g}"] = {
            "one_client": summary(one),
            "two_clients": summary(two),
            "max_abs_difference": largest_difference(policy, one + two),
        }
    return result


def print_table(name: str, r: dict) -> None:
    ip = r["in_process"]
    print(f"\n{name} ({'camera ' + ', '.join(r['rgb_keys']) if r['rgb_keys'] else 'no camera'}): "
          f"in-process predict_action p50 {ip['p50_ms']:.1f} ms, p95 {ip['p95_ms']:.1f} ms")
    print("| window (ms) | 1 client p50 / p95 | 2 clients p50 / p95 | 2 / 1 (p95) | batched | "
          "decode | preprocess | queue | inference | postprocess | network (2 clients, medians) | max diff |")
    for w, f in r["windows"].items():
        one, two = f["one_client"], f["two_clients"]
        print(f"| {float(w) * 1e3:g} | {one['p50_ms']:.1f} / {one['p95_ms']:.1f} | {two['p50_ms']:.1f} / "
              f"{two['p95_ms']:.1f} | {two['p95_ms'] / one['p95_ms']:.2f} | {two['batched_share']:.0%} | "
              + " | ".join(f"{two[f'{p}_ms_median']:.2f}" for p in
                           ("decode", "preprocess", "queue", "inference", "postprocess", "network"))
              + f" | {f['max_abs_difference']:.1e} |")


def _autogroup() -> str:
    try:
        return Path("/proc/self/autogroup").read_text().strip()
    except OSError:
        return "no autogroup"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a work folder (datasets, checkpoints, server logs)")
    ap.add_argument("--requests", type=int, default=200, help="timed requests per client and case")
    ap.add_argument("--windows", default="0,0.002,0.005,0.01", help="collection windows to try, seconds")
    ap.add_argument("--demo-checkpoint", type=Path)
    ap.add_argument("--camera-checkpoint", type=Path)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    from synthetic_dataset import write_synthetic_dataset

    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / "dataset.npz"
    if not dataset.exists():
        write_synthetic_dataset(dataset, n_episodes=4, episode_length=60, image_size=IMAGE_SIZE)
    checkpoints = {
        "demo": args.demo_checkpoint or train_checkpoint("demo", dataset, args.out / "run-demo"),
        "camera (sim config)": args.camera_checkpoint or train_checkpoint("sim", dataset, args.out / "run-sim"),
    }
    windows = [float(w) for w in args.windows.split(",")]
    figures = {"load_before": os.getloadavg(), "nice": os.nice(0), "autogroup": _autogroup(), "cpus": os.cpu_count(),
               "policies": {}}
    started = time.time()
    for name, ckpt in checkpoints.items():
        figures["policies"][name] = bench_policy(name.split()[0], ckpt, dataset, windows, args.requests, args.out)
    figures |= {"load_after": os.getloadavg(), "wall_s": time.time() - started}
    print(f"load average before {figures['load_before']}, after {figures['load_after']}, "
          f"nice {figures['nice']}, {figures['autogroup']}, {figures['cpus']} CPUs, {figures['wall_s']:.0f} s")
    for name, r in figures["policies"].items():
        print_table(name, r)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
