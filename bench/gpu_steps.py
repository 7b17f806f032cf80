"""Benchmark: training steps per second and data time per step on a GPU (not a test).

For the demo config (low-dimensional, as shipped) and UMI's config
(``train_diffusion_unet_timm_umi``: ViT-B/16 CLIP layout at 224x224, batch 64), each
precision setting and each K (``training.noise_samples_per_obs``), in a fresh process per
measurement, through the trainer's own step (:func:`bench.train_throughput.measure`):

* ``fp32``: ``training.mixed_precision=no``, ``training.allow_tf32=false`` (today's settings);
* ``tf32``: TF32 matmuls and cuDNN convolutions (Ampere and newer);
* ``bf16``: accelerate's bf16 autocast, plus TF32 for what stays in float32.

Data: a synthetic replay buffer (uint8 frames in an uncompressed ``.npz``, memory-mapped),
loaded by the config's data loader with ``pin_memory`` (pinned batches, copied to the GPU
with ``non_blocking``) and ``--workers`` persistent workers. Reports steps/s, denoising
samples/s, the mean and largest data time per step, the median step time and the peak GPU
memory. ``--cpu`` (alias ``--dry-run``) runs the same on the CPU with a small batch and a
step or two, to show the script works where no GPU is lent.

    .venv/bin/python bench/gpu_steps.py --json > gpu_steps.json        # on the GPU machine
    .venv/bin/python bench/gpu_steps.py --cpu --json                     # anywhere: 5-10 minutes on 2 cores
    .venv/bin/python bench/gpu_steps.py --cpu --configs demo             # the quick check, under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from train_throughput import run_child, write_dataset  # noqa: E402

PRECISIONS = {
    "fp32": ["training.mixed_precision=no", "training.allow_tf32=false"],
    "tf32": ["training.mixed_precision=no", "training.allow_tf32=true"],
    "bf16": ["training.mixed_precision=bf16", "training.allow_tf32=true"],
}


def config_overrides(name: str, dataset: dict[int, Path], batch_size: int | None, workers: int) -> list[str]:
    """The dataset (64 px for the demo, 224 px for UMI), the batch and the data loader of one config."""
    loader = [
        f"dataloader.num_workers={workers}",
        f"dataloader.persistent_workers={workers > 0}",
        "dataloader.pin_memory=true",
        "logging.mode=disabled",
    ]
    if batch_size is not None:
        loader.append(f"dataloader.batch_size={batch_size}")
    if name == "demo":
        return [f"task.dataset_path={dataset[64]}", *loader]
    # identity: the synthetic poses are the TCP's already
    return [f"task.dataset_path={dataset[224]}", "task.dataset_frequeny=null", "task.tx_cam_tcp=identity", *loader]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="demo,train_diffusion_unet_timm_umi")
    parser.add_argument("--precisions", default="fp32,tf32,bf16")
    parser.add_argument("--k", default="1,8", help="comma-separated training.noise_samples_per_obs values")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the config's (demo 32, UMI 64)")
    parser.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="CPU, batch 4, 1 timed step")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "dpflow-bench-gpu")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        args.steps, args.warmup, args.workers = 1, 1, min(args.workers, 1)
        args.batch_size = args.batch_size or 4
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("error: no CUDA device visible; run with --cpu for the CPU dry run")
    args.workdir.mkdir(parents=True, exist_ok=True)
    n_episodes = 4 if args.cpu else 12
    dataset = {
        side: write_dataset(args.workdir / f"camera{side}-{n_episodes}.npz", side, n_episodes=n_episodes)
        for side in (64, 224)
    }
    results = []
    for name in args.configs.split(","):
        for precision in args.precisions.split(","):
            for k in (int(v) for v in args.k.split(",")):
                overrides = [
                    *config_overrides(name, dataset, args.batch_size, args.workers),
                    *PRECISIONS[precision],
                    f"training.noise_samples_per_obs={k}",
                    # on a small CPU machine two spinning threads per process only slow it down
                    *(["training.torch_threads=1"] if args.cpu else []),
                ]
                spec = {"name": f"{name}/{precision}/K={k}", "config": name, "overrides": overrides,
                        "steps": args.steps, "warmup": args.warmup}
                m = run_child(spec, args.timeout, env=env)
                results.append({"config": name, "precision": precision, **m})
                if not args.json:
                    print(
                        f"{spec['name']:>45}: {m['steps_per_s']:7.2f} steps/s, {m['samples_per_s']:9.0f} samples/s, "
                        f"data {m['data_time_s_mean'] * 1e3:.2f} ms (max {m['data_time_s_max'] * 1e3:.2f}), "
                        f"step {m['step_time_s_median'] * 1e3:.1f} ms, peak {m['peak_memory_mib'] or 0:.0f} MiB, "
                        f"{m['device']}",
                        flush=True,
                    )
    out = {"cpu_dry_run": args.cpu, "loadavg": [round(v, 2) for v in os.getloadavg()], "results": results}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
