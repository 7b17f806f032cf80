"""Closed-loop benchmark of the world's camera policy: what the README main job must reach, measured.

Steps (each skipped when its product is given):

1. record ``--episodes`` scripted demonstrations of ``--task`` in the world (``dpflow_core.sim.record``), in
   each of ``--blocks`` seed blocks (block k: seeds ``k * 1000`` on, into ``recordings/`` for k = 0 and
   ``recordings_b<k>/`` after; ``dpflow sample-recordings --seed k`` writes the same);
2. pair and convert them, all blocks into one dataset, at 64 x 64 (``dpflow pair`` / ``dpflow convert``'s
   functions; block k > 0 under stems ``b<k>_<stem>``);
3. train the ``sim`` trainer config (the camera policy) and the same config without the camera
   (``task.rgb_keys=[]``), each with ``python -m dpflow_core.train`` on this machine;
4. roll each out on ``--rollouts`` held-out initial states, beside the oracle, replay and hold baselines
   on the same states (``dpflow_core.sim.evaluate.evaluate_closed_loop``, what ``dpflow rollout`` runs),
   executing ``--n-action-steps`` of each chunk (default: the checkpoint's).

Prints one table (predictor, successes, rate, Wilson 95 % interval) and, with ``--json``, the figures
and the wall time of each step. Example (the README main job's figures)::

    .venv/bin/python bench/closed_loop.py --task pick_place --episodes 120 --rollouts 200 --out /tmp/cl
    .venv/bin/python bench/closed_loop.py --task stack --episodes 120 --rollouts 200 --out /tmp/cl_stack

and the ``stack`` recipe over its 60 % target (960 demonstrations in two seed blocks, 79.5 %)::

    .venv/bin/python bench/closed_loop.py --task stack --episodes 480 --blocks 2 --rollouts 200 --skip-no-camera \
        --n-action-steps 4 --out /tmp/cl_C --train-overrides training.num_epochs=1000

``--checkpoint`` / ``--no-camera-checkpoint`` reuse trained checkpoints; ``--dataset`` a converted one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _train(dataset: Path, run_dir: Path, extra: list[str]) -> Path:
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "dpflow_core.train", "--config-name=sim", f"task.dataset_path={dataset}",
           f"hydra.run.dir={run_dir}", *extra]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return run_dir / "checkpoints" / "latest.ckpt"


def _pair_block(task_dir: Path, k: int, out: Path):
    """Block 0 pairs by name; block k > 0 repeats block 0's stems (``stack_0000`` ...), so it pairs from an
    explicit manifest that renames them ``b<k>_<stem>`` (README, "two recording sessions whose stems collide")."""
    from dpflow_core.pairing import pair_recordings

    if k == 0:
        return pair_recordings(task_dir)
    stems = sorted(p.name[: -len("_vio.json")] for p in task_dir.glob("*_vio.json"))
    explicit = out / f"pairs_b{k}.json"
    explicit.write_text(json.dumps({"episodes": [
        {"stem": f"b{k}_{s}", "raw_mcap": f"{s}.mcap", "vio_mcap": f"{s}_vio.mcap", "vio_json": f"{s}_vio.json"}
        for s in stems]}))
    return pair_recordings(task_dir, explicit_manifest=explicit, task=task_dir.name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="pick_place")
    ap.add_argument("--episodes", type=int, default=120, help="Demonstrations per seed block.")
    ap.add_argument("--blocks", type=int, default=1, help="Seed blocks of --episodes demonstrations each.")
    ap.add_argument("--n-action-steps", type=int, help="Actions executed per chunk in the rollouts.")
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dataset", type=Path)
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--no-camera-checkpoint", type=Path)
    ap.add_argument("--skip-no-camera", action="store_true", help="Do not train or roll out the camera-less policy.")
    ap.add_argument("--train-overrides", nargs="*", default=[], help="Hydra overrides for both trainings.")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dpflow_core.conversion import ConversionSettings, convert
    from dpflow_core.pairing import pair_recordings, save_manifest
    from dpflow_core.sim.evaluate import ClosedLoopSettings, evaluate_closed_loop
    from dpflow_core.sim.record import read_sim_task, record_task

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    roots = [out / ("recordings" if k == 0 else f"recordings_b{k}") for k in range(args.blocks)]
    task_dirs = [root / args.task for root in roots]
    dataset = args.dataset
    if dataset is None:
        t = time.perf_counter()
        for k, (root, task_dir) in enumerate(zip(roots, task_dirs)):
            if not (task_dir / "sim_task.json").is_file():
                record_task(root, args.task, args.episodes, seed=k)
        times["record_s"] = time.perf_counter() - t
        t = time.perf_counter()
        dataset = out / "dataset.npz"
        if not dataset.is_file():
            manifests = [save_manifest(_pair_block(d, k, out), out / ("manifests" if k == 0 else f"manifests_b{k}"))[0]
                         for k, d in enumerate(task_dirs)]
            convert(manifests if len(manifests) > 1 else manifests[0], dataset, ConversionSettings(image_size=(64, 64)))
        times["convert_s"] = time.perf_counter() - t
    train_seeds = [int(e["seed"]) for d in task_dirs for e in (read_sim_task(d) or {"episodes": []})["episodes"]] or None

    t = time.perf_counter()
    ckpt = args.checkpoint or _train(dataset, out / "run_camera", args.train_overrides)
    times["train_camera_s"] = time.perf_counter() - t
    settings = ClosedLoopSettings(episodes=args.rollouts, video_episodes=4, n_action_steps=args.n_action_steps)
    t = time.perf_counter()
    camera = evaluate_closed_loop(ckpt, args.task, out / "rollouts_camera", settings, training_seeds=train_seeds,
                                  overwrite=True)
    times["rollouts_camera_and_baselines_s"] = time.perf_counter() - t
    rows = [("policy (camera)", camera.policy)] + sorted(camera.baselines.items())
    if not args.skip_no_camera:
        t = time.perf_counter()
        blind_ckpt = args.no_camera_checkpoint or _train(dataset, out / "run_no_camera",
                                                         [*args.train_overrides, "task.rgb_keys=[]"])
        times["train_no_camera_s"] = time.perf_counter() - t
        t = time.perf_counter()
        blind = evaluate_closed_loop(blind_ckpt, args.task, out / "rollouts_no_camera",
                                     ClosedLoopSettings(episodes=args.rollouts, baselines=(), video_episodes=0,
                                                        n_action_steps=args.n_action_steps),
                                     training_seeds=train_seeds, overwrite=True)
        times["rollouts_no_camera_s"] = time.perf_counter() - t
        rows.insert(1, ("no-camera policy", blind.policy))

    print(f"| {args.task} predictor | successes | success | Wilson 95 % |\n|---|---:|---:|---|")
    for name, s in rows:
        print(f"| {name} | {s['successes']}/{s['n']} | {100 * s['success_rate']:.1f} % | "
              f"{100 * s['wilson_low']:.1f}-{100 * s['wilson_high']:.1f} % |")
    print(f"closed_loop_success: {'PASS' if camera.passed else 'FAIL (' + camera.reason + ')'}")
    print("times: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    if args.json:
        print(json.dumps({"task": args.task, "rows": dict(rows), "passed": camera.passed, "times_s": times,
                          "checkpoint": str(ckpt), "load_average": os.getloadavg()}, indent=1, default=str))
    return 0 if camera.passed else 1


if __name__ == "__main__":
    sys.exit(main())
