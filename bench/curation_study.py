"""Curation that pays, measured: train on everything, on ``dpflow curate``'s selection and on the truth's.

Issue 32's curation study on the world's ``pick_place``. Steps (each skipped when its product exists under
``--out``, so an interrupted study resumes):

1. record ``--episodes`` scripted demonstrations, ``--bad-fraction`` of them bad on purpose
   (``dpflow_core.sim.faults``: idle stretches, wrong targets, dropped blocks, regrasp loops, duplicates;
   the truth in ``curation_truth.json``, which dpflow's curation never reads);
2. pair them; ``dpflow curate``'s functions score and decide from the recordings alone; the flags are
   compared with the truth (recall per kind, false positives among the good ones);
3. three training sets, each converted at 64 x 64: ``all`` (the pairing manifest), ``dpflow`` (the curated
   manifest: flagged ones dropped, idle ones trimmed) and ``oracle`` (the same curation run with labels
   from the truth: every bad one dropped, every good one kept untrimmed);
4. train the ``sim`` config on each (``python -m dpflow_core.train``, one thread each, side by side);
5. roll each out on the same ``--rollouts`` held-out initial states (``evaluate_closed_loop``, no
   baselines) and print success with Wilson 95 % intervals.

Example (docs/benchmarks.md's curation table)::

    .venv/bin/python bench/curation_study.py --out /tmp/cur --episodes 120 --bad-fraction 0.2 \\
        --epochs 80 --rollouts 200 --json

The checkpoints (``--out/run_<set>/checkpoints/``) also serve ``bench/offline_vs_success.py`` as trainings on
a data subset and on corrupted demonstrations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETS = ("all", "dpflow", "oracle")


def flag_figures(episodes: list[dict], truth: dict) -> dict:
    """Recall and false-positive rate of curation's decisions against the truth file.

    ``episodes``: ``curation.json``'s entries (stem, flags, auto_decision); ``truth``: ``curation_truth.json``.
    An episode counts as flagged when it has any flag. Returns ``{"bad", "good", "flagged_bad", "flagged_good",
    "recall", "false_positive_rate", "per_kind": {kind: [flagged, n]}, "dropped_bad", "dropped_good"}``.

    Raises:
        ValueError: the two name different stems.
    """
    by_stem = {e["stem"]: e for e in episodes}
    t = {e["stem"]: e for e in truth["episodes"]}
    if set(by_stem) != set(t):
        raise ValueError(f"curation and truth name different stems: {sorted(set(by_stem) ^ set(t))[:5]}")
    bad = [s for s in t if t[s]["bad"]]
    good = [s for s in t if not t[s]["bad"]]
    flagged = {s for s, e in by_stem.items() if e["flags"]}
    dropped = {s for s, e in by_stem.items() if e["auto_decision"] == "drop"}
    per_kind: dict[str, list[int]] = {}
    for s in bad:
        k = per_kind.setdefault(t[s]["kind"], [0, 0])
        k[0] += s in flagged
        k[1] += 1
    return {"bad": len(bad), "good": len(good), "flagged_bad": len(flagged & set(bad)),
            "flagged_good": len(flagged & set(good)),
            "recall": len(flagged & set(bad)) / max(len(bad), 1),
            "false_positive_rate": len(flagged & set(good)) / max(len(good), 1),
            "dropped_bad": len(dropped & set(bad)), "dropped_good": len(dropped & set(good)),
            "per_kind": per_kind}


def _train_all(datasets: dict[str, Path], out: Path, epochs: int, extra: list[str]) -> dict[str, Path]:
    """Train each dataset's ``sim`` policy side by side; the latest checkpoint of each."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    procs = {}
    for name, ds in datasets.items():
        ckpt = out / f"run_{name}" / "checkpoints" / "latest.ckpt"
        if ckpt.is_file():
            continue
        log = open(out / f"train_{name}.log", "w")
        cmd = [sys.executable, "-m", "dpflow_core.train", "--config-name=sim", f"task.dataset_path={ds}",
               f"training.num_epochs={epochs}", f"hydra.run.dir={out / f'run_{name}'}", *extra]
        procs[name] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (p, log) in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"training {name} failed (exit {p.returncode}): see {out / f'train_{name}.log'}")
        log.close()
    return {name: out / f"run_{name}" / "checkpoints" / "latest.ckpt" for name in datasets}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--episodes", type=int, default=120)
    ap.add_argument("--bad-fraction", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=80, help="Epochs of 50 steps for each training.")
    ap.add_argument("--rollouts", type=int, default=200)
    ap.add_argument("--train-overrides", nargs="*", default=[])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--flags-only", action="store_true",
                    help="Stop after the flags against the truth (record, pair, curate): no conversion or training.")
    args = ap.parse_args()

    from dpflow_core.conversion import ConversionSettings, convert
    from dpflow_core.curation.apply import Label, curate
    from dpflow_core.pairing import pair_recordings, save_manifest
    from dpflow_core.sim.evaluate import ClosedLoopSettings, evaluate_closed_loop
    from dpflow_core.sim.faults import FaultSpec, read_truth
    from dpflow_core.sim.record import read_sim_task, record_task

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    task_dir = out / "recordings" / "pick_place"
    t = time.perf_counter()
    if not (task_dir / "sim_task.json").is_file():
        record_task(out / "recordings", "pick_place", args.episodes, faults=FaultSpec(bad_fraction=args.bad_fraction))
    times["record_s"] = time.perf_counter() - t
    truth = read_truth(task_dir)

    t = time.perf_counter()
    manifest, _ = save_manifest(pair_recordings(task_dir), out / "manifests")
    auto = curate(manifest, out / "curation_dpflow", overwrite=True)
    labels = {e["stem"]: Label("drop" if e["bad"] else "keep", "curation_truth.json", "oracle")
              for e in truth["episodes"]}
    oracle = curate(manifest, out / "curation_oracle", labels=labels, overwrite=True)
    times["curate_s"] = time.perf_counter() - t
    flags = flag_figures(auto.episodes, truth)
    if args.flags_only:
        print(json.dumps({"flags": flags, "kept": {"dpflow": auto.kept, "oracle": oracle.kept}, "times_s": times}, indent=2))
        return 0

    t = time.perf_counter()
    sources = {"all": manifest, "dpflow": auto.manifest_path, "oracle": oracle.manifest_path}
    datasets = {}
    for name, m in sources.items():
        datasets[name] = out / f"dataset_{name}.npz"
        if not datasets[name].is_file():
            convert(m, datasets[name], ConversionSettings(image_size=(64, 64)))
    times["convert_s"] = time.perf_counter() - t

    t = time.perf_counter()
    ckpts = _train_all(datasets, out, args.epochs, args.train_overrides)
    times["train_s"] = time.perf_counter() - t

    t = time.perf_counter()
    seeds = [int(e["seed"]) for e in read_sim_task(task_dir)["episodes"]]
    results = {}
    for name, ckpt in ckpts.items():
        res_dir = out / f"rollouts_{name}"
        if not (res_dir / "closed_loop.json").is_file():
            evaluate_closed_loop(ckpt, "pick_place", res_dir, ClosedLoopSettings(episodes=args.rollouts, baselines=()),
                                 training_seeds=seeds)
        results[name] = json.loads((res_dir / "closed_loop.json").read_text())["policy"]
    times["rollout_s"] = time.perf_counter() - t

    kept = {"all": len(auto.episodes), "dpflow": auto.kept, "oracle": oracle.kept}
    print(f"flags against the truth: {flags['flagged_bad']}/{flags['bad']} bad flagged "
          f"(recall {flags['recall']:.0%}), {flags['flagged_good']}/{flags['good']} good flagged "
          f"(false positives {flags['false_positive_rate']:.0%}); per kind {flags['per_kind']}")
    print(f"{'training set':<14}{'episodes':>9}{'success':>10}  Wilson 95 %")
    for name in SETS:
        r = results[name]
        print(f"{name:<14}{kept[name]:>9}{r['successes']:>5}/{r['n']:<4}  {r['success_rate']:.1%} "
              f"({r['wilson_low']:.1%}-{r['wilson_high']:.1%})  {r['failure_modes']}")
    if args.json:
        print(json.dumps({"flags": flags, "kept": kept, "results": results, "times_s": times}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
