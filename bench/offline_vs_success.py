"""Which offline metric ranks checkpoints as closed-loop success does (issue 32): the study.

For each checkpoint (paths or globs; the same file under two names, such as ``latest.ckpt``, counts once):

1. roll it out closed loop on the same ``--states`` held-out initial states of ``--task``
   (``dpflow_core.sim.evaluate.evaluate_closed_loop``, what ``dpflow rollout`` runs; no baselines, no film);
2. compute every offline metric of ``dpflow_core.evaluation.offline_metrics`` on ``--heldout``, a
   ``dataset.npz`` converted from world recordings that no checkpoint trained on (their seeds are checked
   disjoint from each checkpoint's training recordings, both read from the datasets' sidecars and
   ``sim_task.json``; rollout states, from 1,000,000 up, are disjoint from both).

3. run the offline gate on it exactly as ``dpflow evaluate`` does
   (``dpflow_core.evaluation.evaluate_checkpoint`` on the dataset it was trained on, the held-out episodes of
   its own split, ``--samples-per-episode`` 48 and ``--margin`` 0.2 unless ``--gate-samples`` / ``--margin``
   say otherwise); ``evaluate_checkpoint`` refuses any other dataset (SHA-256), so the gate cannot be run on
   ``--heldout``. Its verdict and each criterion's figures go into the checkpoint's ``record.json``.

Open-loop replay's success on the same states is the reference of issue 32's gate rule ("reject every
checkpoint whose success is below the replay baseline's"): it is rolled out once
(``dpflow_core.sim.rollout.rollout_baseline``, replaying the lowest training seed's demonstration as
``evaluate_closed_loop`` does) and kept in ``--out/baselines/``. The gate's verdicts are crossed with success
against it (``dpflow_core.evaluation.ranking.gate_agreement``).

Then each metric's Spearman correlation with success, with a bootstrap interval over checkpoints,
rollout states and held-out episodes (``dpflow_core.evaluation.ranking``), is written as
``offline_vs_success.json`` and ``offline_vs_success.md`` in ``--out``. Every metric is an error:
one that ranks well has a rho near -1.

Each checkpoint's results are kept in ``--out/checkpoints/<sha256[:12]>/`` and reused by a later run with
the same settings (``--overwrite`` then replaces the summary), so the study can be rerun as a training
writes more checkpoints. Held-out recordings::

    dpflow sample-recordings /tmp/heldout_pp --task pick_place --episodes 20 --seed 900   # seeds 900000-900019
    dpflow pair /tmp/heldout_pp/pick_place -o /tmp/heldout_pp/manifest.json
    dpflow convert /tmp/heldout_pp/manifest.json -o /tmp/heldout_pp/dataset.npz --image-size 64,64

The study::

    .venv/bin/python bench/offline_vs_success.py '/tmp/r6/pp/checkpoints/epoch=*.ckpt' \\
        --heldout /tmp/heldout_pp/dataset.npz --task pick_place --states 50 --out /tmp/ovs
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _world_seeds(dataset: Path) -> tuple[str, list[int], dict]:
    """(task, seeds, ``sim_task.json``) of the world recordings a converted dataset came from (its sidecar's
    ``inputs.root``)."""
    from dpflow_core.sim.record import read_sim_task

    sidecar = Path(dataset).with_suffix(".json")
    try:
        root = json.loads(sidecar.read_text())["inputs"]["root"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"{sidecar}: no readable inputs.root ({exc}): cannot tell which recordings {dataset} holds")
    meta = read_sim_task(root)
    if meta is None:
        raise SystemExit(f"{root}: no sim_task.json: {dataset} was not recorded in the world")
    return meta["task"], [int(e["seed"]) for e in meta["episodes"]], meta


def _checkpoints(patterns: list[str]) -> list[tuple[Path, str]]:
    """Existing checkpoint files matching ``patterns``, each with its SHA-256, each file content once."""
    from dpflow_core.files import sha256_file

    paths = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).is_file() else [])
        if not found:
            raise SystemExit(f"{pattern}: no checkpoint")
        paths += [Path(p) for p in found]
    seen, out = set(), []
    for p in paths:
        digest = sha256_file(p)
        if digest not in seen:
            seen.add(digest)
            out.append((p, digest))
    return out


def _study_checkpoint(path: Path, digest: str, args, heldout, heldout_seeds, samples_cache, folder: Path) -> dict:
    """Rollouts and offline statistics of one checkpoint (reused from ``folder`` when its settings match)."""
    from dpflow_core.evaluation.offline_metrics import EpisodeStats, held_out_samples, policy_statistics
    from dpflow_core.files import write_text_atomic
    from dpflow_core.inference import load_policy
    from dpflow_core.sim.evaluate import ClosedLoopSettings, evaluate_closed_loop
    from dpflow_core.sim.record import SimRecordingSpec
    from dpflow_core.sim.tasks import check_disjoint

    settings = {"task": args.task, "states": args.states, "seed": args.seed, "draws": args.draws,
                "heldout_sha256": heldout["sha256"], "noise_seed": args.noise_seed}
    record_path = folder / "record.json"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("settings") == settings:
            with np.load(folder / "stats.npz") as data:
                record["stats"] = EpisodeStats.from_npz(data)
            record["reused"] = True
            return record
    policy = load_policy(path)
    trained = dict(policy.dataset)
    if abs(float(trained["frequency_hz"]) - heldout["buffer"].frequency_hz) > 0.01 * float(trained["frequency_hz"]):
        raise SystemExit(f"{path}: trained at {trained['frequency_hz']:.3f} Hz, {args.heldout} is "
                         f"{heldout['buffer'].frequency_hz:.3f} Hz: the held-out steps would mean other times")
    train_task, train_seeds, train_meta = _world_seeds(Path(trained["path"]))
    if train_task != args.task:
        raise SystemExit(f"{path}: trained on {train_task!r} recordings, not --task {args.task!r}")
    check_disjoint(train_seeds, heldout_seeds)  # held-out recordings never trained on

    t0 = time.perf_counter()
    key = (policy.spec.horizon, policy.spec.action_down_sample_steps, int(policy.network.n_action_steps),
           round(policy.camera_obs_latency_s, 6), policy.spec.obs_down_sample_steps)
    if key not in samples_cache:
        samples_cache[key] = held_out_samples(heldout["buffer"], policy.spec, frequency_hz=heldout["buffer"].frequency_hz,
                                              n_action_steps=key[2], latency_s=policy.camera_obs_latency_s)
    samples = samples_cache[key]
    stats = policy_statistics(policy, heldout["buffer"], samples, n_draws=args.draws, seed=args.noise_seed)
    offline_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    known = {f for f in SimRecordingSpec.__dataclass_fields__}
    recording = SimRecordingSpec(**{k: v for k, v in (train_meta.get("recording") or {}).items() if k in known})
    result = evaluate_closed_loop(policy, args.task, folder / "rollouts",
                                  ClosedLoopSettings(episodes=args.states, seed=args.seed, baselines=(), video_episodes=0),
                                  training_seeds=sorted(set(train_seeds) | set(heldout_seeds)), recording=recording,
                                  overwrite=True)
    rollout_s = time.perf_counter() - t0
    records = json.loads((folder / "rollouts" / "rollouts.json").read_text())
    record = {
        "checkpoint": str(path), "name": path.stem, "sha256": digest, "settings": settings,
        "trained_on": {"path": trained["path"], "sha256": trained.get("sha256"), "episodes": len(train_seeds)},
        "success": [bool(r["success"]) for r in records], "seeds": [int(r["seed"]) for r in records],
        "closed_loop": result.policy, "metrics": stats.values(),
        "samples": int(len(samples.rows)), "executed_steps": [int(s) for s in samples.steps],
        "critical_steps_share": float(samples.critical.mean()),
        "seconds": {"offline": round(offline_s, 2), "rollouts": round(rollout_s, 2)},
    }
    np.savez(folder / "stats.npz", **stats.to_npz())
    write_text_atomic(record_path, json.dumps(record, indent=1), overwrite=True)
    record["stats"], record["reused"] = stats, False
    return record


def _gate_checkpoint(path: Path, record: dict, args, folder: Path) -> dict:
    """The offline gate's verdict on one checkpoint, as ``dpflow evaluate`` decides it (reused from its
    ``record.json`` when the dataset, margin, samples and seed match); stored there under ``gate``."""
    from dpflow_core.evaluation import EvaluationSettings, evaluate_checkpoint
    from dpflow_core.files import write_text_atomic

    trained = record["trained_on"]
    settings = {"dataset": trained["path"], "dataset_sha256": trained.get("sha256"), "margin": args.margin,
                "samples_per_episode": args.gate_samples, "seed": 0}
    if (record.get("gate") or {}).get("settings") == settings:
        return record["gate"]
    t0 = time.perf_counter()
    # the loss-curve plot that dpflow evaluate adds from logs.json.txt plays no part in the verdict
    result = evaluate_checkpoint(path, trained["path"], folder / "gate", EvaluationSettings(
        max_samples_per_episode=args.gate_samples, margin=args.margin, seed=0), overwrite=True)
    record["gate"] = {
        "settings": settings, "beats_baseline": result.beats_baseline, "failed_criteria": list(result.failed_criteria),
        "criteria": result.gate, "held_out_episodes": list(result.held_out_episodes), "n_samples": result.n_samples,
        "executed_steps": list(result.executed_steps), "notes": list(result.notes),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    write_text_atomic(folder / "record.json", json.dumps({k: v for k, v in record.items() if k not in ("stats", "reused")},
                                                         indent=1), overwrite=True)
    return record["gate"]


def _replay_success(records: list[dict], args) -> dict:
    """Open-loop replay's rollout summary on the study's states (``--out/baselines/replay_seed<k>.json``).

    ``evaluate_closed_loop`` replays the demonstration of the lowest seed it is given as training seeds,
    which the study makes its training recordings' lowest; checkpoints trained on recordings with different
    lowest seeds get one replay each, and the best of them is the reference."""
    from dpflow_core.files import write_text_atomic
    from dpflow_core.sim.rollout import RolloutSummary, rollout_baseline, write_rollouts

    seeds = records[0]["seeds"]
    folder = args.out / "baselines"
    summaries = []
    for train_seed in sorted({min(_world_seeds(Path(r["trained_on"]["path"]))[1]) for r in records}):
        path = folder / f"replay_seed{train_seed}.json"
        settings = {"task": args.task, "seeds": seeds, "train_seed": train_seed}
        if path.is_file() and json.loads(path.read_text()).get("settings") == settings:
            summaries.append(json.loads(path.read_text()))
            continue
        t0 = time.perf_counter()
        rolled = rollout_baseline("replay", args.task, seeds, train_seed=train_seed)
        write_rollouts(folder, f"replay_seed{train_seed}", rolled)
        summary = {"settings": settings, **RolloutSummary.of("replay", rolled).__dict__,
                   "seconds": round(time.perf_counter() - t0, 2)}
        write_text_atomic(path, json.dumps(summary, indent=1), overwrite=True)
        summaries.append(summary)
    return max(summaries, key=lambda s: s["success_rate"])


def _gate_markdown(records: list[dict], agreement, replay: dict) -> str:
    lines = [f"Offline gate (`dpflow evaluate`) against closed-loop success; open-loop replay (the demonstration of "
             f"training seed {replay['settings']['train_seed']}): {replay['successes']}/{replay['n']}.", "",
             agreement.table(), "",
             f"Lowest success among passed checkpoints: "
             + ("none passed" if agreement.lowest_passed is None else f"{100 * agreement.lowest_passed:.0f} %")
             + "; highest among rejected: "
             + ("none rejected" if agreement.highest_rejected is None else f"{100 * agreement.highest_rejected:.0f} %")
             + f"; separable by a success threshold: {'yes' if agreement.separable else 'no'}; concordance "
             f"(passed above rejected, ties 1/2): {agreement.concordance:.2f}.", "",
             "| checkpoint | success | position (m): policy / best baseline | rotation (rad): policy / best baseline "
             "| gripper events: policy / best baseline / recorded | gate |", "|---|---:|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["closed_loop"]["success_rate"], r["name"])):
        g = r["gate"]["criteria"]

        def cell(name: str) -> str:
            c = g[name]
            mark = "" if c["passed"] else " **fail**"
            return f"{c['policy']:.4g} / {c['baseline']:.4g} ({c['best_baseline']}){mark}"

        ev = g["gripper_events"]
        lines.append(f"| {r['name']} | {100 * r['closed_loop']['success_rate']:.0f} % | {cell('position_error_m')} | "
                     f"{cell('rotation_error_rad')} | {cell('gripper_events')} / {ev['events']} | "
                     f"{'PASS' if r['gate']['beats_baseline'] else 'reject'} |")
    return "\n".join(lines) + "\n"


def _markdown(records: list[dict], correlations: dict, args) -> str:
    from dpflow_core.evaluation.offline_metrics import METRICS
    from dpflow_core.evaluation.ranking import correlation_table

    names = [m for m, _, _ in METRICS]
    lines = [f"Offline metrics against closed-loop success: {len(records)} checkpoints, {args.states} held-out "
             f"initial states of `{args.task}` each, offline metrics on `{args.heldout}`; bootstrap "
             f"{args.resamples} resamples of checkpoints, states and held-out episodes.", "",
             correlation_table(correlations), "",
             "| checkpoint | success | Wilson 95 % | " + " | ".join(f"`{m}`" for m in names) + " |",
             "|---|---:|---|" + "---:|" * len(names)]
    for r in sorted(records, key=lambda r: r["name"]):
        s = r["closed_loop"]
        lines.append(f"| {r['name']} | {100 * s['success_rate']:.0f} % | {100 * s['wilson_low']:.0f}-"
                     f"{100 * s['wilson_high']:.0f} % | " + " | ".join(f"{r['metrics'][m]:.4g}" for m in names) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoints", nargs="+", help="Checkpoint files or globs (quote them).")
    ap.add_argument("--heldout", type=Path, required=True, help="dataset.npz of held-out world recordings.")
    ap.add_argument("--task", default="pick_place")
    ap.add_argument("--states", type=int, default=50, help="Held-out initial states each checkpoint is rolled out on.")
    ap.add_argument("--seed", type=int, default=0, help="Block of rollout seeds (dpflow rollout --seed).")
    ap.add_argument("--draws", type=int, default=None, help="Policy samples per anchor of the best-of-N error.")
    ap.add_argument("--noise-seed", type=int, default=0, help="Seed of the first draw's diffusion noise.")
    ap.add_argument("--margin", type=float, default=None, help="The gate's margin (default: dpflow evaluate's).")
    ap.add_argument("--gate-samples", type=int, default=48, help="Anchors per held-out episode of the gate (dpflow evaluate --samples-per-episode).")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--overwrite", action="store_true", help="Replace an earlier summary in --out (per-checkpoint results are reused either way).")
    args = ap.parse_args()

    import torch

    from dpflow_core.evaluation.offline_metrics import BEST_OF_N, METRICS
    from dpflow_core.evaluation import DEFAULT_MARGIN
    from dpflow_core.evaluation.ranking import gate_agreement, rank_metrics
    from dpflow_core.files import sha256_file, write_text_atomic
    from dpflow_core.replay_buffer import ReplayBuffer

    torch.set_num_threads(args.torch_threads)
    if (args.out / "offline_vs_success.json").exists() and not args.overwrite:
        raise SystemExit(f"{args.out / 'offline_vs_success.json'} exists: pass --overwrite to replace it")
    args.draws = args.draws or BEST_OF_N
    args.margin = DEFAULT_MARGIN if args.margin is None else args.margin
    started = time.perf_counter()
    heldout_task, heldout_seeds, _ = _world_seeds(args.heldout)
    if heldout_task != args.task:
        raise SystemExit(f"{args.heldout} holds {heldout_task!r} recordings, not --task {args.task!r}")
    heldout = {"buffer": ReplayBuffer(args.heldout), "sha256": sha256_file(args.heldout)}
    checkpoints = _checkpoints(args.checkpoints)
    if len(checkpoints) < 2:
        raise SystemExit(f"{len(checkpoints)} distinct checkpoint(s): a ranking needs at least 2")
    samples_cache: dict = {}
    records = []
    for path, digest in checkpoints:
        folder = args.out / "checkpoints" / digest[:12]
        folder.mkdir(parents=True, exist_ok=True)
        r = _study_checkpoint(path, digest, args, heldout, heldout_seeds, samples_cache, folder)
        records.append(r)
        print(f"{r['name']}: success {100 * r['closed_loop']['success_rate']:.0f} %, "
              + ", ".join(f"{k} {v:.4g}" for k, v in r["metrics"].items())
              + (" (reused)" if r["reused"] else f" [{r['seconds']['offline']:.0f} s offline, "
                                                 f"{r['seconds']['rollouts']:.0f} s rollouts]"), flush=True)
        before = r.get("gate")
        g = _gate_checkpoint(path, r, args, folder)
        print(f"  gate {'PASS' if g['beats_baseline'] else 'reject'}"
              + (f" (fails {', '.join(g['failed_criteria'])})" if g["failed_criteria"] else "")
              + (" (reused)" if g is before else f" [{g['seconds']:.0f} s]"), flush=True)
    seeds = {tuple(r["seeds"]) for r in records}
    if len(seeds) != 1:
        raise SystemExit("the checkpoints were rolled out on different initial states")
    t0 = time.perf_counter()
    success = np.array([r["success"] for r in records])
    correlations = rank_metrics([r["stats"] for r in records], success, resamples=args.resamples)
    rank_s = time.perf_counter() - t0
    replay = _replay_success(records, args)
    agreement = gate_agreement([r["name"] for r in records], [r["closed_loop"]["success_rate"] for r in records],
                               [r["gate"]["beats_baseline"] for r in records], replay["success_rate"])
    summary = {
        "task": args.task, "states": args.states, "rollout_seeds": [min(records[0]["seeds"]), max(records[0]["seeds"])],
        "heldout": {"path": str(args.heldout), "sha256": heldout["sha256"], "episodes": len(heldout_seeds),
                    "recording_seeds": [min(heldout_seeds), max(heldout_seeds)]},
        "draws": args.draws, "resamples": args.resamples,
        "metrics": [{"name": m, "unit": u, "description": d} for m, u, d in METRICS],
        "correlations": {k: c.to_dict() for k, c in correlations.items()},
        "replay": replay, "margin": args.margin, "gate_agreement": agreement.to_dict(),
        "checkpoints": [{k: v for k, v in r.items() if k != "stats"} for r in records],
        "seconds": {"total": round(time.perf_counter() - started, 1), "ranking": round(rank_s, 2),
                    "offline_per_checkpoint": [r["seconds"]["offline"] for r in records],
                    "rollouts_per_checkpoint": [r["seconds"]["rollouts"] for r in records]},
    }
    write_text_atomic(args.out / "offline_vs_success.json", json.dumps(summary, indent=2), overwrite=True)
    table = _markdown(records, correlations, args) + "\n" + _gate_markdown(records, agreement, replay)
    write_text_atomic(args.out / "offline_vs_success.md", table, overwrite=True)
    print(table)
    print(f"results: {args.out / 'offline_vs_success.json'}, {args.out / 'offline_vs_success.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
