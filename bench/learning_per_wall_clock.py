"""Learning per wall-clock second: the two-level minibatch (K noise samples per encoded observation)
against one noise sample per observation, at equal training time, judged by closed-loop success.

Issue 26's "learning per wall-clock" figure. Both arms train the world's ``sim`` camera config on the same
converted ``pick_place`` recordings, side by side (one torch thread each, one process per core), for the
same wall-clock budget: the K = 1 arm (Diffusion Policy's loss, what the trainer did before K) gets as
many more steps as its cheaper step allows. The step times come from a calibration in this run
(``bench/train_throughput.py``'s measurement, fresh processes, both arms interleaved), so the budget is
equal by construction; the wall time each training really took is printed beside it. Each arm's schedule
(cosine learning rate, warm-up, EMA) is sized to its own step count, so neither is cut mid-schedule.
Then each checkpoint is rolled out on the same held-out initial states (``evaluate_closed_loop``, seeds
1,000,000 and up, disjoint from the recordings' seeds).

    .venv/bin/python bench/learning_per_wall_clock.py --dataset /tmp/pp/dataset.npz \\
        --recordings /tmp/pp/recordings/pick_place --k-steps 3000 --rollouts 200 --out /tmp/lpw --json \\
        [--step-times 0.1645 0.3854]

Prints one table (arm, K, steps, training wall time, successes, rate, Wilson 95 %) and with ``--json``
the figures, the calibration and the load average.
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
STEPS_PER_EPOCH = 50  # the sim config's training.max_train_steps


def calibrate(k: int, workdir: Path) -> float:
    """Median seconds per training step of the ``sim`` config at ``k`` noise samples (one thread, batch 64),
    measured by ``bench/train_throughput.py`` in a fresh process."""
    out = subprocess.run([sys.executable, str(REPO / "bench" / "train_throughput.py"), "--config", "sim", "--rounds", "1",
                          "--steps", "8", "--warmup", "2", "--k", str(k), "--workdir", str(workdir / f"cal_k{k}"), "--json"],
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["variants"]["new"]["step_time_s_median"])


def launch(dataset: Path, run_dir: Path, k: int, epochs: int) -> subprocess.Popen:
    """One ``sim`` training of ``epochs`` x 50 steps at ``k`` noise samples per observation, in the background."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "dpflow_core.train", "--config-name=sim", f"task.dataset_path={dataset}",
           f"hydra.run.dir={run_dir}", f"training.num_epochs={epochs}", f"training.noise_samples_per_obs={k}"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(run_dir.parent / f"{run_dir.name}.log", "w"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", type=Path, required=True, help="a converted pick_place dataset.npz (64 x 64)")
    ap.add_argument("--recordings", type=Path, required=True, help="its task folder (sim_task.json: training seeds)")
    ap.add_argument("--k", type=int, default=8, help="noise samples per observation of the new arm")
    ap.add_argument("--k-steps", type=int, default=3000, help="training steps of the K arm (multiple of 50)")
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--step-times", type=float, nargs=2, metavar=("K1_S", "K_S"),
                    help="seconds per step of K=1 and of K, measured beforehand (skips the calibration; on a shared "
                         "machine a calibration beside other work can misjudge the ratio)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from dpflow_core.sim.evaluate import ClosedLoopSettings, evaluate_closed_loop
    from dpflow_core.sim.record import read_sim_task

    args.out.mkdir(parents=True, exist_ok=True)
    calibration = ({"k=1": args.step_times[0], f"k={args.k}": args.step_times[1]} if args.step_times
                   else {f"k={k}": calibrate(k, args.out) for k in (1, args.k)})
    k_epochs = max(1, args.k_steps // STEPS_PER_EPOCH)
    budget_s = k_epochs * STEPS_PER_EPOCH * calibration[f"k={args.k}"]
    one_epochs = max(1, round(budget_s / calibration["k=1"] / STEPS_PER_EPOCH))
    arms = {f"K={args.k}": (args.k, k_epochs), "K=1": (1, one_epochs)}
    started = time.perf_counter()
    procs = {}
    for name, (k, epochs) in arms.items():
        run_dir = args.out / f"run_k{k}"
        procs[name] = (launch(args.dataset, run_dir, k, epochs), time.perf_counter(), run_dir)
    wall: dict[str, float] = {}
    while len(wall) < len(procs):  # each arm's own end (waiting on them in turn would give the later end to both)
        for name, (proc, t0, run_dir) in procs.items():
            if name not in wall and proc.poll() is not None:
                if proc.returncode != 0:
                    raise SystemExit(f"training {name} failed: see {run_dir.parent / (run_dir.name + '.log')}")
                wall[name] = time.perf_counter() - t0
        time.sleep(1.0)
    train_seeds = [int(e["seed"]) for e in read_sim_task(args.recordings)["episodes"]]
    results = {}
    for name, (_proc, _t0, run_dir) in procs.items():
        res = evaluate_closed_loop(run_dir / "checkpoints" / "latest.ckpt", "pick_place", args.out / f"rollouts_{name}",
                                   ClosedLoopSettings(episodes=args.rollouts, baselines=(), video_episodes=0),
                                   training_seeds=train_seeds, overwrite=True)
        results[name] = res.policy
    print(f"calibration (s/step, one thread, batch 64): {calibration}; budget {budget_s / 60:.1f} min per arm")
    print("| arm | K | steps | training wall time | successes | success | Wilson 95 % |\n|---|---:|---:|---:|---:|---:|---|")
    for name, (k, epochs) in arms.items():
        r = results[name]
        print(f"| {name} | {k} | {epochs * STEPS_PER_EPOCH} | {wall[name] / 60:.1f} min | {r['successes']}/{r['n']} | "
              f"{100 * r['success_rate']:.1f} % | {100 * r['wilson_low']:.1f}-{100 * r['wilson_high']:.1f} % |")
    if args.json:
        print(json.dumps({"calibration_s_per_step": calibration, "budget_s": budget_s,
                          "arms": {n: {"k": k, "steps": e * STEPS_PER_EPOCH, "train_wall_s": wall[n], **results[n]}
                                   for n, (k, e) in arms.items()},
                          "total_s": time.perf_counter() - started, "load_average": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
