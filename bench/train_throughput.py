"""Benchmark: denoising samples per second of the built-in trainer, old path against new (not a test).

One run measures, on the same synthetic replay buffer and the same model (a camera config:
``--config demo`` with ``task.rgb_keys=[camera0_rgb]``, frames of ``--image-size`` pixels,
batch ``--batch-size``), interleaved round after round, each measurement in a fresh process:

* ``baseline``: today's settings: one noise sample per observation (K=1), torch's default
  thread count, the config's data loader (``num_workers: 0`` for demo), no compile;
* ``threads_only``: the same with ``training.torch_threads`` of the new path (to separate the
  two effects);
* ``new``: ``training.noise_samples_per_obs=K``, ``training.torch_threads``, ``training.mixed_precision``
  (``--mixed-precision``: bf16 autocast, or ``auto``), a data worker (``dataloader.num_workers``, persistent)
  so that loading overlaps the step;
* ``--sweep-k 1,2,4,8,16``: the new path at each K (how K was chosen);
* ``--beside-no-camera``: each measurement runs beside the same training without the camera, started
  at the same time, as the README main job trains its two policies on the machine's cores.

A measurement runs ``--warmup`` steps, then ``--steps`` timed steps through
:meth:`dpflow_core.train.workspace.Workspace.train_step` (forward, backward, AdamW, LR schedule,
EMA: the trainer's own code), each step's wait for its batch timed apart. Denoising samples
per second = batch x K x steps / (step time + data time). The load average is recorded before
and after (the machine is shared).

    .venv/bin/python bench/train_throughput.py --json
    .venv/bin/python bench/train_throughput.py --k 8 --threads 1 --rounds 3 --sweep-k 1,2,4,8,16
    .venv/bin/python bench/train_throughput.py --config sim --k 1 --workers 0 --beside-no-camera --json
    .venv/bin/python bench/train_throughput.py --config sim --k 1 --workers 0 --mixed-precision bf16 --beside-no-camera --json

``--json`` prints ``{"baseline_samples_per_s", "samples_per_s", "ratio", ...}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def camera_overrides(dataset: str, batch_size: int) -> list[str]:
    """Overrides that turn the demo/tiny config into a camera config on ``dataset``."""
    return [
        f"task.dataset_path={dataset}",
        "task.rgb_keys=[camera0_rgb]",
        "task.image_size=null",
        f"dataloader.batch_size={batch_size}",
        "logging.mode=disabled",
    ]


def write_dataset(path: Path, image_size: int, n_episodes: int = 12, episode_length: int = 100) -> Path:
    """A synthetic ``dataset.npz`` with one camera of ``image_size`` x ``image_size`` pixels."""
    from tests.synthetic_dataset import write_synthetic_dataset

    if not path.exists():
        write_synthetic_dataset(
            path, n_episodes=n_episodes, episode_length=episode_length, image_size=(image_size, image_size)
        )
    return path


def measure(config: str, overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """Train ``warmup + steps`` steps of ``config`` with ``overrides`` in this process; timings of the last ``steps``.

    Returns samples/s (denoising samples: batch x K), steps/s, the mean and largest data time
    per step (s), the median step time (s), K, the thread count and the device.
    """
    import torch
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_DIR
    from dpflow_core.train.workspace import Workspace, _to_device, apply_threads

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config, overrides=overrides)
    with tempfile.TemporaryDirectory(prefix="dpflow-throughput-") as run_dir:
        ws = Workspace(cfg, run_dir)
        apply_threads(ws.speed["torch_threads"])
        ws._setup_data()
        ws._build()
        ws.model.train()
        k = ws.speed["noise_samples_per_obs"]
        batch_size = int(cfg.dataloader.batch_size)
        data_times: list[float] = []
        step_times: list[float] = []
        epoch = 0
        while len(step_times) < warmup + steps:
            ws.train_sampler.set_epoch(epoch)
            batches = iter(ws.train_loader)
            while len(step_times) < warmup + steps:
                waited = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                batch = _to_device(batch, ws.device)
                started = time.perf_counter()
                ws.train_step(batch)  # float(loss) waits for the device
                step_times.append(time.perf_counter() - started)
                data_times.append(started - waited)
            epoch += 1
        data, step = data_times[warmup:], step_times[warmup:]
        total = sum(data) + sum(step)
        cuda = ws.device.type == "cuda"
        return {
            "peak_memory_mib": torch.cuda.max_memory_allocated(ws.device) / 2**20 if cuda else None,
            "gpu": torch.cuda.get_device_name(ws.device) if cuda else None,
            "mixed_precision": str(cfg.training.mixed_precision),
            "allow_tf32": ws.speed["allow_tf32"],
            "samples_per_s": batch_size * k * len(step) / total,
            "steps_per_s": len(step) / total,
            "data_time_s_mean": statistics.fmean(data),
            "data_time_s_max": max(data),
            "step_time_s_median": statistics.median(step),
            "noise_samples_per_obs": k,
            "batch_size": batch_size,
            "torch_threads": torch.get_num_threads(),
            "num_workers": int(cfg.dataloader.num_workers),
            "device": str(ws.device),
        }


def run_children(specs: list[dict[str, Any]], timeout_s: float, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """:func:`measure` of each spec (config, overrides, steps, warmup) in a fresh process of its own (its own
    thread pool and device state, nothing left from an earlier variant), all of them at once: one spec is
    one training alone, two are two trainings side by side on the same cores."""
    env = dict(os.environ if env is None else env, TQDM_DISABLE="1")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)  # the thread count is the variant's own setting
    procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for spec in specs]
    out = []
    for spec, proc in zip(specs, procs):
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"measurement {spec['name']} failed:\n{stderr[-3000:]}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def run_child(spec: dict[str, Any], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """:func:`measure` of ``spec`` in a fresh process (:func:`run_children` of one)."""
    return run_children([spec], timeout_s, env)[0]


def variants(args, dataset: str) -> list[dict[str, Any]]:
    base = camera_overrides(dataset, args.batch_size)
    new_speed = [f"training.torch_threads={args.threads}", f"training.mixed_precision={args.mixed_precision}"]
    new_loader = [f"dataloader.num_workers={args.workers}", f"dataloader.persistent_workers={args.workers > 0}"]
    out = [
        # today's settings spelled out: a config group may set its own threads or K since
        {"name": "baseline", "overrides": base + ["training.torch_threads=null", "training.noise_samples_per_obs=1",
                                                  "training.mixed_precision=no"]},
        {"name": "threads_only", "overrides": base + new_speed[:1] + ["training.mixed_precision=no"]},
        {"name": "new", "overrides": base + new_speed + new_loader + [f"training.noise_samples_per_obs={args.k}"]},
    ]
    for k in args.sweep_k:
        out.append(
            {"name": f"k={k}", "overrides": base + new_speed + new_loader + [f"training.noise_samples_per_obs={k}"]}
        )
    return out


def _loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="demo", help="trainer config name (default: demo, with a camera)")
    parser.add_argument("--image-size", type=int, default=64, help="frame side in pixels (default 64)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--k", type=int, default=8, help="noise samples per observation of the new path")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the new path")
    parser.add_argument("--workers", type=int, default=1, help="data workers of the new path")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "auto"],
                        help="training.mixed_precision of the new path (the baseline stays float32)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of interleaved measurements")
    parser.add_argument("--sweep-k", default="", help="comma-separated K values to measure on the new path too")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dpflow-bench-throughput")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--beside-no-camera", action="store_true",
                        help="run each measurement beside the same training without the camera (task.rgb_keys=[]), "
                             "as the README main job trains its camera and no-camera policies")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(measure(spec["config"], spec["overrides"], spec["steps"], spec["warmup"])))
        return
    args.sweep_k = [int(v) for v in args.sweep_k.split(",") if v.strip()]
    args.workdir.mkdir(parents=True, exist_ok=True)
    dataset = write_dataset(args.workdir / f"camera{args.image_size}.npz", args.image_size)
    load_before = _loadavg()
    results: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for v in variants(args, str(dataset)):
            spec = {**v, "config": args.config, "steps": args.steps, "warmup": args.warmup}
            if args.beside_no_camera:
                # the README main job's pair: the same training without the camera, started with it
                blind = {**spec, "name": v["name"] + " (no camera)", "overrides": [*v["overrides"], "task.rgb_keys=[]"]}
                m, m_blind = run_children([spec, blind], args.timeout)
                m["no_camera_step_time_s_median"] = m_blind["step_time_s_median"]
            else:
                m = run_child(spec, args.timeout)
            results.setdefault(v["name"], []).append(m)
            if not args.json:
                print(
                    f"round {r} {v['name']:>12}: {m['samples_per_s']:8.0f} samples/s, step "
                    f"{m['step_time_s_median']:.3f} s, data {m['data_time_s_mean'] * 1e3:.1f} ms "
                    f"(max {m['data_time_s_max'] * 1e3:.1f}), K={m['noise_samples_per_obs']}, "
                    f"{m['torch_threads']} thread(s), {m['num_workers']} worker(s), load {_loadavg()}",
                    file=sys.stderr,
                    flush=True,
                )
    summary = {name: {
        "samples_per_s": statistics.median(m["samples_per_s"] for m in ms),
        "samples_per_s_rounds": [round(m["samples_per_s"], 1) for m in ms],
        "data_time_s_mean": statistics.fmean(m["data_time_s_mean"] for m in ms),
        "step_time_s_median": statistics.median(m["step_time_s_median"] for m in ms),
        **({"no_camera_step_time_s_median": statistics.median(m["no_camera_step_time_s_median"] for m in ms)}
           if "no_camera_step_time_s_median" in ms[0] else {}),
        **{key: ms[0][key] for key in ("noise_samples_per_obs", "torch_threads", "num_workers", "batch_size")},
    } for name, ms in results.items()}
    base, new = summary["baseline"]["samples_per_s"], summary["new"]["samples_per_s"]
    out = {
        "baseline_samples_per_s": round(base, 1),
        "samples_per_s": round(new, 1),
        "ratio": round(new / base, 2),
        "ratio_same_threads": round(new / summary["threads_only"]["samples_per_s"], 2),
        "config": args.config,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "cpu_count": os.cpu_count(),
        "beside_no_camera": args.beside_no_camera,
        "loadavg_before": load_before,
        "loadavg_after": _loadavg(),
        "variants": summary,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
